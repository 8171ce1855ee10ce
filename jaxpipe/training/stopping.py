"""One agreed stop per job: SIGTERM (preemption), SIGINT (Ctrl-C) or a stop learned from a peer process.

A cluster scheduler signals the processes of a job one after the other (0.5-2 s apart is common), and a
process may learn of the stop from its peer -- through the per-step agreement in ``jaxpipe.training.loop`` --
before its own signal arrives.  That signal only confirms the stop already agreed on: it must not count as
a second one (it did, and the job lost its checkpoint: process 1 exited while process 0 waited in the
collective save).  So: a process's *first* signal starts the stop or confirms it; its *second* gives the
stop-save ``grace_s`` seconds more, then exits; a third exits at once.  A forced exit says which step the
newest finished checkpoint holds.  Used by :class:`jaxpipe.training.Trainer` (and so by
``experiments.train``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, List, Optional


#: The signal a worker of ``experiments.launch`` gets when its launcher dies (the launcher sets
#: PR_SET_PDEATHSIG to it).  Not SIGTERM: the kernel sends the parent-death signal each time the worker is
#: handed to another of the dying launcher's threads, and once more to init -- three SIGTERMs within a
#: millisecond, which counted as the second and third signal and ended the stop-save at once (the
#: launcher-killed flake of the sixteenth stop: "SIGTERM at +0.0 s (parent pid L), ... (parent pid L), ...
#: (parent pid 1)").  This one counts once.
PARENT_DEATH = signal.SIGUSR1

# Where a process whose output reader died writes instead (set by guard_streams; /dev/null when unset):
# a worker that outlives its launcher keeps its last words -- its stop, its save, or why neither happened.
_ORPHAN_LOG: Optional[str] = None


def _orphan_stream():
    if _ORPHAN_LOG:
        try:
            return open(_ORPHAN_LOG, "a", buffering=1)
        except OSError:
            pass
    return open(os.devnull, "w")


class SafeStream:
    """A text stream whose writes survive the reader's end: once a write fails (the launcher relaying this
    process's output died), everything goes to the orphan log (:func:`guard_streams`; /dev/null without
    one) -- a print must not end the process before its stop-save.  Wraps ``sys.stdout`` / ``sys.stderr``."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError:
            self._stream = _orphan_stream()
            return self._stream.write(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError:
            self._stream = _orphan_stream()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard_streams(orphan_log: Optional[str] = None) -> None:
    """``sys.stdout`` and ``sys.stderr`` as :class:`SafeStream` (idempotent); once the reader is gone, what
    the process writes is appended to ``orphan_log`` (a file path; None: dropped)."""
    global _ORPHAN_LOG
    if orphan_log is not None:
        _ORPHAN_LOG = orphan_log
    for name in ("stdout", "stderr"):
        if not isinstance(getattr(sys, name), SafeStream):
            setattr(sys, name, SafeStream(getattr(sys, name)))


class Stop:
    """The job's stop: ``reason`` (the first cause, None while running), the signals this process got, and
    the bounded exit after a second one.  ``last_checkpoint()``: the newest finished checkpoint's step."""

    def __init__(
        self,
        grace_s: float,
        last_checkpoint: Callable[[], Optional[int]] = lambda: None,
        write: Callable[[str], None] = None,
    ):
        self.reason: Optional[str] = None
        self._received: list = []  # (monotonic time, signal name, parent pid then), one per signal
        self.grace_s = grace_s
        self.last_checkpoint = last_checkpoint
        self.write = write or self._stderr
        self._timer: Optional[threading.Timer] = None
        self.exits = True  # a stop ends the process (False: the loop returns to its caller)

    @property
    def signals(self) -> List[str]:
        """The signals this process got, in order."""
        return [name for _, name, _ in self._received]

    def __bool__(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        """A stop not from a signal (a peer's signal, ``--stop_at_step``); the first cause is kept."""
        if self.reason is None:
            self.reason = reason

    def done(self) -> None:
        """The stop-save finished: later signals are ignored while the process exits (its status stays
        143)."""
        if self._timer is not None:
            self._timer.cancel()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(PARENT_DEATH, signal.SIG_IGN)

    def install(self) -> None:
        """This stop handles SIGTERM and SIGINT (main thread only) until :meth:`uninstall`."""
        self._parent = os.getppid()
        self._before = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def uninstall(self) -> None:
        """The handlers from before :meth:`install` again (a library's loop returned to its caller)."""
        for s, handler in getattr(self, "_before", {}).items():
            signal.signal(s, handler)
        self._before = {}

    def watch_launcher(self, launcher_pid: Optional[int], stop_timeout: float, poll_s: float = 0.5) -> None:
        """A worker of ``experiments.launch`` ends when its launcher is gone, whatever it is doing: the
        launcher's death sends :data:`PARENT_DEATH` (PR_SET_PDEATHSIG), which stops a worker as one SIGTERM
        would, however often the kernel sends it; a worker that cannot reach the end of its step (stuck in
        user code, or waiting in a collective for a stuck peer) is ended by this thread ``stop_timeout``
        seconds later -- never an orphan.  A thread runs while the main thread waits in native code (a
        collective releases the GIL) or loops in Python."""
        if not launcher_pid:
            return
        if threading.current_thread() is threading.main_thread():
            self._before = getattr(self, "_before", {})
            self._before.setdefault(PARENT_DEATH, signal.signal(PARENT_DEATH, self.on_parent_death))

        def watch():
            import time

            while os.getppid() == launcher_pid:
                time.sleep(poll_s)
            time.sleep(stop_timeout)
            self._orphaned()
            self._force_exit(
                "SIGTERM",
                f"the launcher (pid {launcher_pid}) is gone and this process did not "
                f"finish its stop within --stop_timeout={stop_timeout:g} s (a step that "
                f"cannot finish)",
            )

        threading.Thread(target=watch, name="jaxpipe-launcher-watch", daemon=True).start()

    def _stderr(self, text: str) -> None:
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except OSError:  # the reader is gone (a launcher killed): the stop-save must still run
            self._to_orphan_log()

    def _to_orphan_log(self) -> None:
        """Native and Python output to the orphan log (:func:`guard_streams`), or /dev/null without one."""
        stream = _orphan_stream()
        for fd in (1, 2):
            os.dup2(stream.fileno(), fd)
        # Python's own streams may be duplicates of the old descriptors
        # (jaxpipe.distributed.quiet_native_stdout)
        sys.stdout = sys.stderr = stream

    def _orphaned(self) -> None:
        """The parent (a launcher relaying this process's output) is gone: what is written to the pipe would
        fail (BrokenPipeError) and end the process before its stop-save, so the output goes to /dev/null."""
        if getattr(self, "_parent", None) not in (None, os.getppid()):
            self._to_orphan_log()
            self._parent = os.getppid()

    def _exit_code(self, name: str) -> int:
        return 130 if name == "SIGINT" else 143

    def _where(self) -> str:
        step = self.last_checkpoint()
        return (
            f"the newest finished checkpoint holds step {step}"
            if step is not None
            else "no checkpoint was finished"
        )

    def _force_exit(self, name: str, why: str) -> None:
        self.write(f"jaxpipe: {why}: exiting now; {self._where()}")
        os._exit(self._exit_code(name))

    def on_signal(self, signum, _frame=None) -> None:
        import time

        ppid = os.getppid()
        self._orphaned()
        name = signal.Signals(signum).name
        self._received.append((time.monotonic(), name, ppid))
        n = len(self._received)
        if n == 1:
            if self.reason is None:
                self.reason = name
                then = f"exit {self._exit_code(name)}" if self.exits else "return to the caller"
                self.write(
                    f"\njaxpipe: {name}: stopping after this step (checkpoint, then {then}); a second "
                    f"signal allows {self.grace_s:g} s more, a third "
                    f"exits at once"
                )
            else:
                self.write(f"\njaxpipe: {name}: already stopping ({self.reason}); this signal confirms it")
            return
        if n == 2:
            self.write(
                f"\njaxpipe: second {name}: the stop-save gets at most {self.grace_s:g} s more, then this "
                f"process exits; a third signal exits at once"
            )
            self._timer = threading.Timer(
                self.grace_s,
                self._force_exit,
                (name, f"the stop-save did not finish within {self.grace_s:g} s"),
            )
            self._timer.daemon = True
            self._timer.start()
            return
        self._force_exit(name, f"signal {n} ({name}; {self._history()})")

    def on_parent_death(self, _signum=None, _frame=None) -> None:
        """The launcher is gone: a stop as one SIGTERM starts it (checkpoint, exit 143), the first time
        only."""
        if getattr(self, "_parent_died", False):
            return
        self._parent_died = True
        self.on_signal(signal.SIGTERM)

    def _history(self) -> str:
        """When each signal came and who this process's parent was then (a parent that changed between two
        says which came from a launcher and which after it died)."""
        t0 = self._received[0][0]
        return "received: " + ", ".join(
            f"{name} at +{t - t0:.1f} s (parent pid {pp})" for t, name, pp in self._received
        )


class LaggedVote:
    """Every process's stop flag, gathered on the devices and read one vote later, so that the host never
    waits for the step in flight to learn its peers' flags.

    A gather read at once is a collective queued behind the step just dispatched: the host would wait for
    that step before it could dispatch the next, and the devices would idle through the host's work between
    steps.  :meth:`cast` starts this vote's gather and reads the previous one's, which finished with the step
    before.  Every process casts once per step, so every process reads the same votes at the same step.

    Args:
        gather: ``gather(flag) -> array`` of every process's flag, not yet read (default: an identity
            program from one device per process to all of them)."""

    def __init__(self, gather: Optional[Callable] = None):
        self._gather = gather
        self._pending = None

    def cast(self, flag: bool):
        """Start gathering ``flag``; every process's flag of the previous vote (an int32 array, one per
        process), or None at the first."""
        import numpy as np

        if self._gather is None:
            self._gather = _device_gather()
        previous, self._pending = self._pending, self._gather(bool(flag))
        return None if previous is None else np.asarray(previous).reshape(-1)


def _device_gather() -> Callable:
    """``gather(flag)``: this process's flag on its first device, replicated to every process's first device
    by one program (an all-gather XLA runs with the devices' other work, in order)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n = jax.process_count()
    devices = np.array([jax.local_devices(process_index=p)[0] for p in range(n)])
    mesh = Mesh(devices, ("process",))
    spread, everywhere = NamedSharding(mesh, P("process")), NamedSharding(mesh, P())
    replicate = jax.jit(lambda votes: votes, out_shardings=everywhere)
    mine = jax.local_devices()[0]

    def gather(flag: bool):
        local = jax.device_put(np.array([int(flag)], np.int32), mine)
        votes = jax.make_array_from_single_device_arrays((n,), spread, [local])
        return replicate(votes).addressable_data(0)

    return gather
