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
