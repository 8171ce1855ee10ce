"""Multi-host (issue #6 part 1): 2 processes x 2 CPU devices (gloo over loopback, started by
``experiments.launch``) train like 1 process x 4 devices -- the same losses and final parameters to float
rounding (1e-6 relative: a cross-device sum, the clipping's global gradient norm, is added in another order by
the inter-process collectives; README, "Multi-process runs") -- for a synchronous (1f1b), an asynchronous
(pipeoptim) and a bidirectional (chimera) schedule; a process that cannot reach the coordinator fails with a
clear message within a bounded time.  The first test runs on both CI legs (the newest JAX's too:
``every_leg``)."""

import json
import os
import subprocess
import sys

import numpy as np
import jax
import pytest
from helpers import assert_close, SUBPROCESS_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [
    "--model=mlp",
    "--stages=4",
    "--steps=4",
    "--microbatches=4",
    "--batch=32",
    "--eval_every=0",
    "--progress=false",
    "--d_model=32",
]


def env():
    e = dict(os.environ)
    # each process sets its own device count; keep the suite's fast-compile setting for both runs
    e["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS
    e["JAX_PLATFORMS"] = "cpu"
    return e


def run(cmd, timeout=300):
    p = subprocess.run(
        [sys.executable, "-m", *cmd], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param("1f1b", marks=pytest.mark.every_leg),
        "pipeoptim",
        "chimera",
    ],
)
def test_two_processes_equal_one(schedule, tmp_path):
    out, ck = {}, tmp_path / "ck"
    for name, cmd in (
        ("multi", ["experiments.launch", "--num_processes=2", "--"]),
        ("single", ["experiments.train"]),
    ):
        d = tmp_path / name
        # pipeoptim: the 2 processes also write checkpoints cooperatively (steps 2 and 4)
        extra = (
            [f"--checkpoint_dir={ck}", "--checkpoint_every=2"]
            if name == "multi" and schedule == "pipeoptim"
            else []
        )
        p = run(cmd + ARGS + extra + [f"--schedule={schedule}", f"--out_dir={d}", f"--save_params={d}/p.npz"])
        losses = [json.loads(l)["loss"] for l in open(d / "metrics.jsonl")]
        out[name] = (losses, np.load(d / "p.npz"))
        if name == "multi":
            assert "2 processes x 2 cpu devices" in p.stdout
    (lm, pm), (ls, ps) = out["multi"], out["single"]
    assert len(lm) == 4 and np.allclose(lm, ls, rtol=1e-6, atol=0)
    assert pm.files == ps.files and len(pm.files) > 0
    for k in pm.files:
        assert_close(pm[k], ps[k], rtol=1e-6, atol=1e-7)
    if schedule == "pipeoptim":
        # the 2-process checkpoint of step 2 (in-flight pipeline included), resumed by 1 process with 4
        # devices, ends where the uninterrupted run ended
        import shutil

        assert sorted(os.listdir(ck)) == ["2", "4"]
        shutil.rmtree(ck / "4")
        d = tmp_path / "resumed"
        run(
            [
                "experiments.train",
                *ARGS,
                f"--schedule={schedule}",
                f"--checkpoint_dir={ck}",
                f"--out_dir={d}",
                f"--save_params={d}/p.npz",
            ]
        )
        assert json.load(open(d / "summary.json"))["resumed_at"] == 2
        pr = np.load(d / "p.npz")
        for k in ps.files:
            assert_close(pr[k], ps[k], rtol=1e-6, atol=1e-7)


def test_unreachable_coordinator_fails_fast():
    # bounded by the subprocess timeout (a hang raises TimeoutExpired), not by a wall-clock assertion
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            *ARGS,
            "--num_processes=2",
            "--process_id=1",
            "--coordinator=127.0.0.1:9",
            "--init_timeout=3",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert p.returncode != 0
    assert "could not reach the coordinator at 127.0.0.1:9 within 3 s" in p.stderr


def test_bad_multihost_flags():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--num_processes=2",
            "--process_id=5",
            "--coordinator=127.0.0.1:1234",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "process_id=5: give this process's index in [0, 1]" in p.stderr


@pytest.mark.every_leg
def test_two_processes_equal_one_with_model_axes(tmp_path):
    """2 processes x 4 devices train the GPT on stage 2 x data 2 x tensor 2 like 1 process x 8 (to float
    rounding: the data replicas' all-reduce sums in the collectives' own order)."""
    args = [
        "--model=gpt",
        "--stages=2",
        "--data=2",
        "--tensor=2",
        "--steps=3",
        "--microbatches=2",
        "--batch=8",
        "--seq_len=16",
        "--d_model=32",
        "--heads=2",
        "--eval_every=0",
        "--sample_len=0",
        "--progress=false",
    ]
    out = {}
    for name, cmd in (
        ("multi", ["experiments.launch", "--num_processes=2", "--"]),
        ("single", ["experiments.train"]),
    ):
        d = tmp_path / name
        p = run(cmd + args + [f"--out_dir={d}", f"--save_params={d}/p.npz"])
        out[name] = ([json.loads(l)["loss"] for l in open(d / "metrics.jsonl")], np.load(d / "p.npz"))
        if name == "multi":
            assert "2 processes x 4 cpu devices" in p.stdout and "tensor=2" in p.stdout
    (lm, pm), (ls, ps) = out["multi"], out["single"]
    assert len(lm) == 3 and np.allclose(lm, ls, rtol=1e-6, atol=0)
    assert pm.files == ps.files and len(pm.files) > 0
    for k in pm.files:
        assert_close(pm[k], ps[k], rtol=1e-6, atol=1e-7)


def _two_by_hand(per_process_args, xla_flags=SUBPROCESS_XLA_FLAGS, timeout=180):
    """Processes 0 and 1 started by hand (not through the launcher), each with its own extra flags; returns
    [(returncode, output)] -- bounded by the subprocess timeout."""
    from jaxpipe.cli.launch import free_port

    port = free_port()
    e = dict(env(), XLA_FLAGS=xla_flags)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "experiments.train",
                *ARGS,
                *extra,
                "--num_processes=2",
                f"--process_id={i}",
                f"--coordinator=127.0.0.1:{port}",
                "--init_timeout=60",
            ],
            cwd=ROOT,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, extra in enumerate(per_process_args)
    ]
    try:
        return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_flags_that_differ_across_processes_are_named_on_every_process():
    """Issue #31 item 3: --lr and --seed given differently to the two processes trained inconsistent
    parameters with no warning; now both processes stop before step 1 naming both flags."""
    out = _two_by_hand([["--lr=0.01", "--seed=0"], ["--lr=0.02", "--seed=1"]])
    for i, (rc, text) in enumerate(out):
        assert rc != 0, text[-2000:]
        assert f"process {i}: the processes of this job were started with different flags" in text, text[
            -2000:
        ]
        assert "--lr (this process: " in text and "--seed (this process: " in text, text[-2000:]


def test_a_mesh_that_leaves_a_process_out_is_named():
    """Two processes of 8 emulated devices each asking for 2 stages: process 1 held none of the mesh's devices
    and died in float(loss) with "spans non-addressable devices", then the job hung in gloo."""
    flags_ = SUBPROCESS_XLA_FLAGS + " --xla_force_host_platform_device_count=8"
    out = _two_by_hand([["--stages=2"], ["--stages=2"]], xla_flags=flags_)
    for rc, text in out:
        assert rc != 0, text[-2000:]
        assert "process(es) [1] hold none of them. The job has 2 processes x 8 devices = 16" in text, text[
            -2000:
        ]


def test_a_taken_coordinator_port_is_refused_by_process_0():
    import socket

    with socket.socket() as s:  # "another job" listening on the port
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.train",
                *ARGS,
                "--num_processes=2",
                "--process_id=0",
                f"--coordinator=127.0.0.1:{port}",
                "--init_timeout=5",
            ],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert p.returncode != 0
    assert f"cannot host the coordinator at 127.0.0.1:{port}: the port is taken" in p.stderr, p.stderr[-2000:]


def _two_process_job(script, *args, timeout=90):
    """Both processes of ``tests/<script> PROCESS_ID PORT *args``: [(returncode, output)], a process still
    running after ``timeout`` s killed (returncode None)."""
    from jaxpipe.cli.launch import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", script), str(i), str(port), *args],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
        results.append((p.poll() if p.returncode is not None else None, p.stdout.read()))
    return results


def _cached_collectives_job(cache_dir, timeout=90):
    """Both processes of ``tests/cached_collectives_job.py`` on ``cache_dir`` (:func:`_two_process_job`)."""
    return _two_process_job("cached_collectives_job.py", cache_dir, timeout=timeout)


def test_two_processes_run_the_plan_process_0_timed_faster():
    """Plans too close to rank are timed at the first step on every process, and every process runs the
    plan process 0 timed faster -- process 1's opposite times lose -- or the processes would compile
    different programs and hang in their first exchange."""
    results = _two_process_job("timed_plans_job.py", timeout=240)
    assert all(code == 0 for code, _ in results), [out[-3000:] for _, out in results]
    plans = [ln.split()[1] for _, out in results for ln in out.splitlines() if ln.startswith("placement ")]
    assert plans == ["ordered", "ordered"], plans


@pytest.mark.every_leg
def test_programs_from_the_persistent_cache_run_across_processes(tmp_path):
    """A second run of a two-process CPU job finds its programs in the persistent compilation cache.  With
    jaxlib 0.12 a program loaded from it hung in its first cross-process collective; there jaxpipe turns the
    cache off (and says so), elsewhere it keeps it and the second run loads its programs."""
    from jaxpipe import distributed

    cache = str(tmp_path / "xla")
    deadlocks = distributed._jaxlib_version() >= distributed.CACHED_CPU_PROGRAMS_DEADLOCK_FROM
    runs = [_cached_collectives_job(cache) for _ in range(2)]  # the second finds its programs cached
    for run_index, results in enumerate(runs):
        for i, (code, out) in enumerate(results):
            assert code == 0, f"run {run_index}, process {i} (None: hung, killed):\n{out[-3000:]}"
    for results in runs:
        for i, (code, out) in enumerate(results):
            assert ("persistent compilation cache" in out) == (deadlocks and i == 0), out[-3000:]
            assert f"cache {None if deadlocks else cache}" in out, out[-3000:]
    assert bool(os.listdir(cache) if os.path.isdir(cache) else []) != deadlocks


def test_the_cache_is_turned_off_only_where_its_programs_deadlock(monkeypatch, tmp_path, capsys):
    """The rule itself, in this process: off for a CPU job of several processes on an affected jaxlib, kept
    for one process or an older jaxlib."""
    from jaxpipe import distributed

    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        monkeypatch.setattr(distributed, "_jaxlib_version", lambda: (0, 11))
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        assert distributed.no_cached_programs_where_they_deadlock() is None
        monkeypatch.setattr(distributed, "_jaxlib_version", lambda: (0, 12))
        monkeypatch.setattr(jax, "process_count", lambda: 1)
        assert distributed.no_cached_programs_where_they_deadlock() is None
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        assert distributed.no_cached_programs_where_they_deadlock() == str(tmp_path)
        assert jax.config.jax_compilation_cache_dir is None
        assert f"persistent compilation cache ({tmp_path}) is off" in capsys.readouterr().err
        assert distributed.no_cached_programs_where_they_deadlock() is None  # off already: said once
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
