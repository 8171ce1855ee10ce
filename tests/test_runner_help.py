"""Issue #52 item 4: ``--help`` on a runner exited 1 (absl's), and ``schedule_choice --help`` did not list the
flags it takes from ``experiments.executor_cost``.  Now it exits 0 and lists every flag the runner reads."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_exits_0_and_lists_the_runners_own_flags():
    cases = {"train": ["--schedule", "--checkpoint_dir", "zb_v", "dualpipe_v"],
             "schedule_choice": ["--devices", "--microbatches", "--cores", "flags of experiments.executor_cost"],
             "launch": ["--num_processes", "--stall_timeout"]}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = {name: subprocess.Popen([sys.executable, "-m", f"experiments.{name}", "--help"], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in cases}
    for name, p in procs.items():
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 0, (name, out[-2000:])
        for want in cases[name]:
            assert want in out, (name, want, out[-2000:])


def test_runners_keep_compiled_programs_in_the_cache_dir_they_are_given(tmp_path):
    """Issue #52 item 3: the runners turn JAX's persistent compilation cache on (``--compilation_cache_dir``;
    '' turns it off): a run leaves its compiled programs there for the next one."""
    from helpers import SUBPROCESS_XLA_FLAGS
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    args = [sys.executable, "-m", "experiments.train", "--model=mlp", "--stages=2", "--microbatches=2", "--batch=8",
            "--d_model=16", "--steps=2", "--eval_every=0", "--progress=false", f"--out_dir={tmp_path}/run"]
    on, off = tmp_path / "cache", tmp_path / "unused"
    p = subprocess.run(args + [f"--compilation_cache_dir={on}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert on.is_dir() and any(on.iterdir()), "nothing was cached"
    env["JAX_COMPILATION_CACHE_DIR"] = str(off)        # the default follows it; '' must still turn the cache off
    p = subprocess.run(args + ["--compilation_cache_dir="], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert not off.exists() or not any(off.iterdir())
