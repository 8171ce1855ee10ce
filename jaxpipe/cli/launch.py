"""Start a multi-process jaxpipe job on this machine (the local stand-in for a cluster launcher).

    jaxpipe launch --num_processes=2 -- --schedule=pipeoptim --stages=4 --model=mlp

Runs ``python -m <module> <args> --num_processes=N --process_id=i --coordinator=127.0.0.1:PORT`` N times
(a free port unless ``--port``), prefixes each process's output with ``[i]``, and when one process fails
stops the others and exits with its status.  Workers get SIGTERM when the launcher dies, even by SIGKILL
(Linux), and then stop as if preempted; a worker that cannot finish its step (stuck in user code, or in a
collective waiting for a stuck peer) exits by itself ``--stop_timeout`` seconds later: never an orphan.  A
worker paused (SIGSTOP, a debugger, a frozen VM) for half the workers' ``--heartbeat_timeout`` ends the job
with one line naming it (exit 124), before the coordination service would abort every process.  Each process
gets ``stages x data x pipes / N`` CPU devices.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxpipe.cli import common as cli
from absl import app, flags

from jaxpipe.training.stopping import PARENT_DEATH


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_integer("num_processes", 2, "processes to start")
    flags.DEFINE_integer("port", 0, "coordinator port on 127.0.0.1 (0: pick a free one)")
    flags.DEFINE_string("module", "jaxpipe.cli.train", "the runner every process executes")
    flags.DEFINE_integer("timeout", 0, "seconds before the whole job is stopped (0: none)")
    flags.DEFINE_integer(
        "stall_timeout",
        300,
        "seconds a worker may go without finishing a step (its heartbeat, "
        "counted from its first step) before the job is stopped (0: no watchdog)",
    )
    flags.DEFINE_integer(
        "stop_timeout",
        120,
        "seconds the workers get to save and exit after a stop before they "
        "are terminated (then killed min(30, this) s later)",
    )
    flags.DEFINE_boolean(
        "verbose",
        False,
        "also relay the collective library's connection chatter ('[Gloo] Rank i "
        "is connected to ...', printed by its C++ code on every process)",
    )


FLAGS = flags.FLAGS


def free_port() -> int:
    """A free port whose next one is free too (the coordinator's and its join gate's, jaxpipe.join_gate)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    return port


def _die_with_parent() -> None:
    """In the child, before exec (Linux): a signal when the launcher dies, even by SIGKILL
    (``jaxpipe.training.stopping.PARENT_DEATH``, counted once however often the kernel sends it) -- the worker
    then stops as if preempted (checkpoint, exit 143) instead of training headless to the end."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, PARENT_DEATH, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to set
        pass


def _pump(i, stream, out, verbose=False):
    for line in iter(stream.readline, ""):
        if not verbose and line.startswith("[Gloo] "):
            continue
        out.write(f"[{i}] {line}")
        out.flush()


def _stalled(beats, limit: float):
    """``(workers, age)``: the workers whose heartbeat file (touched after every step) is older than ``limit``
    seconds, and the oldest age; None if none is.  A worker that has not finished a step yet has no file and
    is not judged.  Workers waiting in a collective for a stalled peer stall too, from about the same step:
    once one is late, every worker whose heartbeat is older than half the limit is named (the stuck one may
    have finished its last step after a waiting peer did -- a loaded machine -- and be a little younger)."""
    now, ages = time.time(), {}
    for i, path in enumerate(beats):
        try:
            ages[i] = now - os.stat(path).st_mtime
        except FileNotFoundError:
            continue
    if not any(a > limit for a in ages.values()):
        return None
    return sorted(i for i, a in ages.items() if a > limit / 2), max(ages.values())


def _paused(procs, since: dict, now: float) -> None:
    """Update ``since`` (worker -> when it was first seen stopped): a worker in state T (SIGSTOP, a debugger,
    a frozen VM or container) is paused; one that runs again is forgotten."""
    for i, p in enumerate(procs):
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        if state in ("T", "t") and p.poll() is None:
            since.setdefault(i, now)
        else:
            since.pop(i, None)


def _heartbeat_timeout(args) -> float:
    """The workers' ``--heartbeat_timeout`` (jaxpipe train's default 15 s)."""
    for a in args:
        if a.startswith("--heartbeat_timeout="):
            try:
                return float(a.split("=", 1)[1])
            except ValueError:
                break
    return 15.0


#: the status of a worker that stopped cleanly (``jaxpipe.training.loop.STOPPED_EXIT``: checkpoint saved)
STOPPED = 143


class _Job:
    """The running workers and the stop forwarded to them (a signal to the launcher, or a worker's own)."""

    def __init__(self, procs, pumps, beat_dir, beats):
        self.procs, self.pumps, self.beat_dir, self.beats = procs, pumps, beat_dir, beats
        self.got, self.got_at = [], 0.0  # the signals forwarded, and when the last one came

    def forward(self, signum, _frame=None):
        """SIGTERM / Ctrl-C to the launcher: pass it on, so every worker checkpoints and exits together (a
        second one is passed on too: the workers' stop-save gets --stop_grace_s more; a third: exit at
        once)."""
        self.got.append(signum)
        self.got_at = time.monotonic()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)


def _start(args, num_processes: int, module: str, port: int, verbose: bool, stop_timeout: float) -> _Job:
    """Start the workers, each in its own session (a Ctrl-C in the terminal reaches the launcher only, which
    forwards it once), with its output relayed under ``[i]``."""
    import tempfile

    job_id = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"  # the join gate's identity of the job
    beat_dir = tempfile.mkdtemp(prefix="jaxpipe-heartbeat-")
    beats = [os.path.join(beat_dir, str(i)) for i in range(num_processes)]
    procs, pumps = [], []
    for i in range(num_processes):
        cmd = [
            sys.executable,
            "-m",
            module,
            *args,
            f"--num_processes={num_processes}",
            f"--process_id={i}",
            f"--coordinator=127.0.0.1:{port}",
        ]
        env = dict(
            os.environ,
            JAXPIPE_HEARTBEAT=beats[i],
            JAXPIPE_LAUNCHER_PID=str(os.getpid()),
            JAXPIPE_JOB_ID=job_id,
            JAXPIPE_STOP_TIMEOUT=str(stop_timeout),
            **({"JAXPIPE_VERBOSE": "1"} if verbose else {}),
        )
        p = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        t = threading.Thread(target=_pump, args=(i, p.stdout, sys.stdout, verbose), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)
    return _Job(procs, pumps, beat_dir, beats)


def _end_paused(job: _Job, paused: dict, pause_limit: float, args) -> bool:
    """A paused worker (SIGSTOP, a debugger, a VM freeze) stalls every other in its collectives, and past
    --heartbeat_timeout the coordination service aborts them all with native stacks: the job is ended first,
    at half that time, with one line saying which process and why.  True where it was ended."""
    _paused(job.procs, paused, time.monotonic())
    long_paused = sorted(i for i, t in paused.items() if time.monotonic() - t >= pause_limit)
    if not long_paused:
        return False
    print(
        f"launch: process(es) {long_paused} paused (stopped: SIGSTOP, a debugger, a frozen VM) for "
        f"{pause_limit:g} s; the other processes wait for them in their collectives and the coordination "
        f"service would abort every process after --heartbeat_timeout={_heartbeat_timeout(args):g} s: ending "
        f"the job now (exit 124); resume it from its last checkpoint",
        file=sys.stderr,
        flush=True,
    )
    for p in job.procs:
        if p.poll() is None:
            p.kill()  # a stopped process takes no SIGTERM until it runs again
    return True


def _watch(job: _Job, args, timeout: float, stall_timeout: float, stop_timeout: float) -> int:
    """Wait for the job to end: every worker done, one failed, a stop finished (bounded by
    ``stop_timeout``), a paused or stalled worker, or ``timeout``; returns the job's status so far."""
    t0, stall = time.monotonic(), None
    paused, pause_limit = {}, max(1.0, _heartbeat_timeout(args) / 2)
    while True:
        codes = [p.poll() for p in job.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if _end_paused(job, paused, pause_limit, args):
            return 124
        if not job.got and stall_timeout and (stall := _stalled(job.beats, stall_timeout)) is not None:
            print(
                f"launch: process(es) {stall[0]} finished no step for {stall[1]:.0f} s (--stall_timeout="
                f"{stall_timeout:g}; a process waiting in a collective for a stuck peer stalls with it): "
                f"stopping the job",
                file=sys.stderr,
                flush=True,
            )
            job.forward(signal.SIGTERM)
        if not job.got and STOPPED in codes:
            # a worker stopped on its own (a stop its processes agreed on: --stop_at_step, a signal sent to
            # the workers, not to the launcher): the others are saving their share too -- wait for them as for
            # a forwarded stop, not end them as after a failure
            job.got.append(None)
            job.got_at = time.monotonic()
        if job.got:
            # stopping: every worker saves its share of the checkpoint and exits; wait for all (bounded)
            if all(c is not None for c in codes) or time.monotonic() - job.got_at > stop_timeout:
                late = [i for i, c in enumerate(codes) if c is None]
                if late:  # a step that cannot finish (a stuck peer, user code): the stop-save never came
                    print(
                        f"launch: process(es) {late} did not finish the stop within --stop_timeout="
                        f"{stop_timeout:g} s (a step that cannot finish); ending them without their save",
                        file=sys.stderr,
                        flush=True,
                    )
                return 124 if stall is not None or late else failed[0] if failed else 0
        elif failed or all(c == 0 for c in codes):
            return failed[0] if failed else 0
        if timeout and time.monotonic() - t0 > timeout:
            print(f"launch: the job ran past --timeout={timeout} s; stopping it", file=sys.stderr)
            return 124
        time.sleep(0.2)


def _shut_down(job: _Job, stop_timeout: float) -> None:
    """Every worker still running gets SIGTERM, then is killed ``min(30, stop_timeout)`` s later (at least
    5 s); the heartbeat files go and the output relays are joined."""
    import shutil

    shutil.rmtree(job.beat_dir, ignore_errors=True)
    grace = max(5.0, min(30.0, stop_timeout))
    for p in job.procs:
        if p.poll() is None:
            p.terminate()
    for i, p in enumerate(job.procs):
        try:
            p.wait(timeout=grace)  # bounded shutdown: then killed
        except subprocess.TimeoutExpired:
            print(f"launch: process {i} did not exit {grace:g} s after SIGTERM; killing it", file=sys.stderr)
            p.kill()
    for t in job.pumps:
        t.join(timeout=5)


def launch(
    args,
    num_processes: int,
    module: str = "jaxpipe.cli.train",
    port: int = 0,
    timeout: float = 0,
    verbose: bool = False,
    stall_timeout: float = 0,
    stop_timeout: float = 120,
) -> int:
    """Run the job; returns 0 if every process succeeded, else the first failing process's status (124: the
    job ran past ``timeout``, or a worker stalled past ``stall_timeout``; 143: every process stopped cleanly,
    its checkpoint saved)."""
    if num_processes < 1:
        raise app.UsageError(f"--num_processes={num_processes}: give at least 1")
    job = _start(args, num_processes, module, port or free_port(), verbose, stop_timeout)
    old = {s: signal.signal(s, job.forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = _watch(job, args, timeout, stall_timeout, stop_timeout)
        if job.got and not rc:
            rc = next((c for c in (p.returncode for p in job.procs) if c), 0)
        _shut_down(job, stop_timeout)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    codes = [p.returncode for p in job.procs]
    if codes and all(c == STOPPED for c in codes):
        # every worker saved its share of the checkpoint and exited as a stopped job does: a preemption, not a
        # failure -- the launcher's own status says the same
        print(
            f"launch: the job stopped (every process saved its checkpoint and exited {STOPPED}): run the "
            "same "
            f"command again to resume",
            file=sys.stderr,
        )
        return STOPPED
    if rc:
        print(f"launch: process {codes} exit statuses; job failed", file=sys.stderr)
    return rc


def main(argv):
    sys.exit(
        launch(
            argv[1:],
            FLAGS.num_processes,
            FLAGS.module,
            FLAGS.port,
            FLAGS.timeout,
            FLAGS.verbose,
            FLAGS.stall_timeout,
            FLAGS.stop_timeout,
        )
    )


if __name__ == "__main__":
    define_flags()
    cli.run(main, __doc__)
