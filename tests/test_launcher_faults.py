"""The launcher's workers end when it is gone, and a paused worker ends the job with one line (issue #42,
items 1 and 2).  Every wait is bounded and event-driven (a file appearing, a process's exit)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import SUBPROCESS_XLA_FLAGS
from test_faults import BASE, ROOT

# CI's second leg leaves these out (tests/conftest.py): jaxpipe's own process handling
pytestmark = [
    pytest.mark.ci_once,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG are Linux's"),
]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start(tmp_path, extra_launch, extra_train, steps_before=3):
    """A 2-process job of experiments.train; returns (launcher, worker pids) once ``steps_before`` steps are
    logged."""
    env = dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS, JAX_PLATFORMS="cpu")
    out_dir = tmp_path / "run"
    args = [
        *[a for a in BASE if not a.startswith("--stages")],
        "--stages=2",
        "--schedule=1f1b",
        "--steps=2000",
        "--throttle_s=0.05",
        f"--out_dir={out_dir}",
        *extra_train,
    ]
    job = subprocess.Popen(
        [sys.executable, "-m", "experiments.launch", "--num_processes=2", *extra_launch, "--", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (
        log.exists() and len(log.read_text().splitlines()) >= steps_before
    ):
        assert job.poll() is None, job.stdout.read()[-3000:]
        time.sleep(0.1)
    assert log.exists(), "no step was logged"
    workers = subprocess.run(
        ["pgrep", "-f", "--", f"cli.train .*--out_dir={out_dir}"], capture_output=True, text=True
    ).stdout.split()
    workers = [int(w) for w in workers if int(w) != job.pid]
    assert len(workers) == 2, workers
    return job, workers


def test_workers_end_when_the_launcher_is_killed_while_one_is_stuck(tmp_path):
    """Worker 1 stuck in user code after step 3 (worker 0 then waits for it inside a collective), the launcher
    SIGKILLed: both workers were still running minutes later (the parent-death SIGTERM asks for a stop neither
    reaches).  Now each ends within --stop_timeout of the launcher's death: the one stuck in Python and its
    peer blocked in the step's collective.  Every worker is waited for: watching one and then asserting on
    both raced the other's exit by the watch thread's poll (CI, stop 45)."""
    job, workers = _start(
        tmp_path, ["--stall_timeout=600", "--stop_timeout=5"], ["--stall_at_step=3", "--fail_process=1"]
    )
    time.sleep(1.0)  # worker 0 is now inside the next step's collective
    job.kill()
    job.wait(timeout=30)
    t = time.monotonic()
    ended = {}
    while time.monotonic() - t < 60 and len(ended) < len(workers):
        ended.update({w: round(time.monotonic() - t, 1) for w in workers if w not in ended and not _alive(w)})
        time.sleep(0.2)
    alive = [w for w in workers if w not in ended]
    for w in alive:
        os.kill(w, signal.SIGKILL)
    assert not alive, (
        f"workers {alive} still running 60 s after the launcher died (--stop_timeout=5); "
        f"ended: {ended} (s after its death)"
    )


def test_a_paused_worker_ends_the_job_with_one_line(tmp_path):
    """Worker 1 stopped (SIGSTOP) for longer than the job can wait: the launcher aborted with status 250 and
    no reason, process 0 with a native stack, process 1 on FileNotFoundError for its heartbeat file.  Now the
    launcher ends the job at half --heartbeat_timeout with one line naming process 1, status 124, and no
    worker prints a stack."""
    job, workers = _start(tmp_path, ["--stall_timeout=600", "--stop_timeout=5"], ["--heartbeat_timeout=10"])
    w1 = next(w for w in workers if "--process_id=1" in open(f"/proc/{w}/cmdline").read().replace("\0", " "))
    os.kill(w1, signal.SIGSTOP)
    t = time.monotonic()
    try:
        out, _ = job.communicate(timeout=90)
    finally:
        if _alive(w1):
            os.kill(w1, signal.SIGCONT)
    took = time.monotonic() - t
    assert job.returncode == 124, out[-3000:]
    assert "launch: process(es) [1] paused (stopped" in out, out[-3000:]
    for bad in ("Fatal Python error", "FileNotFoundError", "Traceback"):
        assert bad not in out, out[-3000:]
    assert 4 <= took < 40, took
    assert not any(_alive(w) for w in workers)


def test_a_short_pause_is_waited_for(tmp_path):
    """A pause shorter than half --heartbeat_timeout (a swap storm, a debugger's breakpoint) changes nothing:
    the job goes on to its end."""
    env_steps = ["--heartbeat_timeout=20"]
    job, workers = _start(tmp_path, ["--stall_timeout=600"], env_steps)
    w1 = next(w for w in workers if "--process_id=1" in open(f"/proc/{w}/cmdline").read().replace("\0", " "))
    os.kill(w1, signal.SIGSTOP)
    time.sleep(2.0)
    os.kill(w1, signal.SIGCONT)
    log = tmp_path / "run" / "metrics.jsonl"
    n = len(log.read_text().splitlines())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(log.read_text().splitlines()) < n + 5:
        assert job.poll() is None, job.stdout.read()[-3000:]
        time.sleep(0.1)
    assert len(log.read_text().splitlines()) >= n + 5
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    assert "paused" not in out, out[-3000:]


def test_a_second_job_on_a_running_jobs_port_is_refused_without_harm(tmp_path):
    """A second launch on the coordinator port of a running 2-process job: its process 0 finds the port taken,
    and its process 1, which used to connect and abort both processes of the running job ("different
    incarnation"), is now refused by the running job's join gate.  The running job goes on, logging the
    intruder."""
    from jaxpipe.cli.launch import free_port

    port = free_port()
    job, workers = _start(tmp_path / "a", [f"--port={port}", "--stall_timeout=600"], [])
    env = dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS, JAX_PLATFORMS="cpu")
    args = [
        *[a for a in BASE if not a.startswith("--stages")],
        "--stages=2",
        "--schedule=1f1b",
        "--steps=50",
        f"--out_dir={tmp_path / 'b' / 'run'}",
    ]
    second = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "--num_processes=2", f"--port={port}", "--", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out2 = second.stdout + second.stderr
    assert second.returncode != 0, out2[-3000:]
    assert "port is taken" in out2 or "was refused by the coordinator" in out2, out2[-3000:]
    log = tmp_path / "a" / "run" / "metrics.jsonl"
    n = len(log.read_text().splitlines())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(log.read_text().splitlines()) < n + 5:
        assert job.poll() is None, job.stdout.read()[-3000:]
        time.sleep(0.1)
    assert len(log.read_text().splitlines()) >= n + 5, "the running job stopped training"
    assert all(_alive(w) for w in workers)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    assert job.returncode in (0, 143), out[-3000:]
    assert "different incarnation" not in out, out[-3000:]


def test_the_gate_refuses_a_process_of_a_running_job(tmp_path):
    """The gate itself: a process index is admitted once while the job assembles; once it runs, every request
    is refused with the reason, which ask() raises as a ConfigError."""
    import jaxpipe as jp
    from jaxpipe import join_gate
    from jaxpipe.cli.launch import free_port

    coord = f"127.0.0.1:{free_port()}"
    gate = join_gate.Gate(coord, 2)
    try:
        join_gate.ask(coord, 1, 2)  # admitted
        with pytest.raises(
            jp.ConfigError, match="process 1 of the job on this coordinator has joined already"
        ):
            join_gate.ask(coord, 1, 2)
        with pytest.raises(jp.ConfigError, match="has 2 processes"):
            join_gate.ask(coord, 2, 3)
        gate.started()
        with pytest.raises(
            jp.ConfigError, match=r"running since .* all 2 processes joined.*own --coordinator"
        ):
            join_gate.ask(coord, 1, 2)
    finally:
        gate.close()
    join_gate.ask(coord, 1, 2)  # no gate answers: join as before


def test_the_watchdog_names_the_peers_that_stalled_with_the_stuck_worker(tmp_path):
    """Once a heartbeat is older than --stall_timeout, every worker idle for over half of it is named: a stuck
    worker that finished its last step a little after its waiting peer (a loaded machine) is named with it
    (a CI run named only the peer), one still stepping is not."""
    from jaxpipe.cli.launch import _stalled

    now = time.time()
    beats = []
    for i, age in enumerate((6.0, 4.0, 1.0)):
        path = tmp_path / f"beat{i}"
        path.write_text("")
        os.utime(path, (now - age, now - age))
        beats.append(str(path))
    named, oldest = _stalled(beats + [str(tmp_path / "no_step_yet")], 5.0)
    assert named == [0, 1] and oldest >= 6.0
    assert _stalled(beats[1:], 5.0) is None
