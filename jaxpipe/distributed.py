"""Multi-host runs: ``jax.distributed`` set-up and per-process data feeding.

Every process runs the same program (SPMD, multi-controller): it builds the same model, mesh and schedule,
and the mesh spans all processes' devices.  Each process places only the shards of a global batch that its
own devices hold (``global_batch``); logging and files are written by process 0; Orbax checkpoints are
written cooperatively (each process its shards, process 0 the metadata).

Where the three values come from, first match wins: the arguments (``--coordinator``, ``--num_processes``,
``--process_id`` in the runners); the environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``); a cluster JAX detects itself (SLURM, Open MPI, TPU pods, GKE) when ``auto=True``.
See BUILD_NOTES.md "Many processes, stops and faults".
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Optional

from .errors import ConfigError
from .checks.values import is_int


def settings(
    coordinator: Optional[str] = None, num_processes: Optional[int] = None, process_id: Optional[int] = None
):
    """``(coordinator, num_processes, process_id)`` from the arguments, then the environment; validated."""
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = (
        num_processes
        if num_processes is not None
        else (int(env["JAX_NUM_PROCESSES"]) if env.get("JAX_NUM_PROCESSES") else None)
    )
    process_id = (
        process_id
        if process_id is not None
        else (int(env["JAX_PROCESS_ID"]) if env.get("JAX_PROCESS_ID") else None)
    )
    if num_processes is None or num_processes == 1:
        return coordinator, num_processes or 1, process_id or 0
    if not is_int(num_processes, 1):
        raise ConfigError(f"num_processes={num_processes!r}: give the number of processes (>= 1)")
    if coordinator is None:
        raise ConfigError(
            f"num_processes={num_processes} needs the coordinator's address: --coordinator=HOST:PORT "
            f"(or JAX_COORDINATOR_ADDRESS), where HOST is process 0's host and PORT a free port"
        )
    if process_id is None or not 0 <= process_id < num_processes:
        raise ConfigError(
            f"process_id={process_id!r}: give this process's index in [0, {num_processes - 1}] "
            f"(--process_id or JAX_PROCESS_ID)"
        )
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"coordinator={coordinator!r}: give HOST:PORT, e.g. 127.0.0.1:12355")
    return coordinator, num_processes, process_id


def initialize(
    coordinator: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    *,
    timeout_s: int = 60,
    auto: bool = False,
    verbose: bool = False,
    heartbeat_timeout_s: int = 15,
) -> int:
    """Join a multi-process job (a no-op for one process unless ``auto`` finds a cluster); returns the
    number of processes.  Must run before anything touches JAX devices.

    On CPU the cross-process collectives go through gloo (TCP; loopback for local tests).  A process that
    cannot reach the coordinator within ``timeout_s`` raises ``RuntimeError`` naming the address, instead
    of waiting forever.  Gloo's connection chatter ("[Gloo] Rank 0 is connected to ...", printed by C++ on
    the process's standard output) is dropped unless ``verbose`` or ``JAXPIPE_VERBOSE=1`` (see
    :func:`quiet_native_stdout`). A process that dies (SIGKILL, OOM) is detected by the coordination service's
    heartbeats within ``heartbeat_timeout_s`` (JAX's default is 100 s) and the job aborts instead of waiting
    in a collective.
    """
    coordinator, n, pid = settings(coordinator, num_processes, process_id)
    import jax

    if n == 1 and not auto:
        return 1
    if not (verbose or os.environ.get("JAXPIPE_VERBOSE")):
        quiet_native_stdout()
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    t0 = time.monotonic()
    from . import join_gate

    if n > 1 and pid != 0:
        _wait_for_coordinator(coordinator, pid, n, timeout_s)
        join_gate.ask(coordinator, pid, n)  # a running job's coordinator refuses: never abort that job
    if n > 1 and pid == 0:
        _check_port_free(coordinator)
        join_gate.open_gate(coordinator, n)
    if n > 1:
        # XLA aborts the process (it cannot be caught) if the job does not assemble in time; say why first
        print(
            f"jaxpipe: process {pid} of {n} joining the job at {coordinator} (fails after {timeout_s} s if "
            "the "
            f"other processes do not join)",
            file=sys.stderr,
            flush=True,
        )
    try:
        if n == 1:
            jax.distributed.initialize(
                initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s
            )
        else:
            jax.distributed.initialize(
                coordinator_address=coordinator,
                num_processes=n,
                process_id=pid,
                initialization_timeout=timeout_s,
                heartbeat_timeout_seconds=heartbeat_timeout_s,
            )
    except Exception as e:  # XLA raises its own error types (DEADLINE_EXCEEDED, UNAVAILABLE, ...)
        raise RuntimeError(
            f"process {pid} of {n} could not join the job through the coordinator at {coordinator} within "
            f"{time.monotonic() - t0:.0f} s ({type(e).__name__}: {str(e).splitlines()[0][:200]}). Check that "
            "process 0 runs with the same --coordinator and --num_processes, that the port is free on its "
            "host "
            f"and reachable from here, or raise the timeout"
        ) from None
    join_gate.job_started()
    no_cached_programs_where_they_deadlock()
    return jax.process_count()


#: the first jaxlib whose CPU programs, loaded from JAX's persistent compilation cache in a job of several
#: processes, deadlock in their first cross-process collective (gloo): 0.12.1 hangs in every such program
#: (``ppermute`` or ``psum``, in a loop or not) whether the processes share the cache directory or not;
#: 0.10.2 and 0.11.2 run them.  The same programs compiled afresh run on every version.
CACHED_CPU_PROGRAMS_DEADLOCK_FROM = (0, 12)


def _jaxlib_version() -> tuple:
    import jaxlib

    return tuple(int(v) for v in jaxlib.__version__.split(".")[:2] if v.isdigit())


def no_cached_programs_where_they_deadlock() -> Optional[str]:
    """Turn JAX's persistent compilation cache off in this process where a program loaded from it would
    deadlock: a job of several processes on CPU with jaxlib >= :data:`CACHED_CPU_PROGRAMS_DEADLOCK_FROM`.

    Every process then compiles its programs afresh (seconds on CPU) instead of hanging at its first step.
    Called by :func:`initialize` and by :class:`~jaxpipe.Pipeline` (for a job joined with
    ``jax.distributed.initialize`` directly); a no-op elsewhere and when the cache is off.

    Returns:
        The directory the cache was using when this turned it off (process 0 says so on standard error),
        else None.
    """
    import jax

    path = jax.config.jax_compilation_cache_dir
    if (
        not path
        or jax.process_count() < 2
        or jax.default_backend() != "cpu"
        or _jaxlib_version() < CACHED_CPU_PROGRAMS_DEADLOCK_FROM
    ):
        return None
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()  # where a program was compiled already, the cache was opened: close it
    if jax.process_index() == 0:
        import jaxlib

        print(
            f"jaxpipe: the persistent compilation cache ({path}) is off in every process of this job: with "
            f"jaxlib {jaxlib.__version__} a CPU program loaded from it deadlocks in its first collective "
            "across processes; each process compiles its programs afresh",
            file=sys.stderr,
            flush=True,
        )
    return path


_NATIVE_FILTER = None


def quiet_native_stdout(drop: tuple = ("[Gloo] ",)) -> None:
    """Drop lines starting with ``drop`` that native code (C++) prints on file descriptor 1.

    Python's ``sys.stdout`` is moved to a duplicate of the original descriptor first, so what Python prints is
    never delayed or lost; only native writes go through a pipe that a daemon thread filters line by line.
    Idempotent.  (``experiments.launch`` filters its workers' output the same way.)
    """
    global _NATIVE_FILTER
    if _NATIVE_FILTER is not None:
        return
    import threading

    sys.stdout.flush()
    real = os.dup(1)
    r, w = os.pipe()
    os.dup2(w, 1)
    os.close(w)
    sys.stdout = os.fdopen(
        os.dup(real),
        "w",
        buffering=1,
        encoding=getattr(sys.stdout, "encoding", None) or "utf-8",
        errors="backslashreplace",
    )

    def pump():
        with os.fdopen(r, "rb", buffering=0) as src:
            pending = b""
            while True:
                chunk = src.read(65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                keep = b"".join(
                    line + b"\n" for line in lines if not line.startswith(tuple(d.encode() for d in drop))
                )
                if keep:
                    os.write(real, keep)
            if pending:
                os.write(real, pending)

    _NATIVE_FILTER = threading.Thread(target=pump, name="jaxpipe-native-stdout", daemon=True)
    _NATIVE_FILTER.start()


def _check_port_free(coordinator: str) -> None:
    """Process 0 hosts the coordination service on the coordinator's port: if something listens there already
    (another job), joining it would abort that job ("different incarnation"); say so instead."""
    host, _, port = coordinator.rpartition(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if host in ("0.0.0.0", "[::]") else host, int(port)))
        except OSError as e:
            raise RuntimeError(
                f"process 0 cannot host the coordinator at {coordinator}: the port is taken ({e.strerror}), "
                "probably by another running job; choose another --coordinator port (experiments.launch "
                "picks a "
                f"free one)"
            ) from None


def _wait_for_coordinator(coordinator: str, pid: int, n: int, timeout_s: float):
    """Process 0 hosts the coordination service; the others first check, with plain TCP, that it listens --
    so an unreachable coordinator gives a clear error after ``timeout_s`` instead of XLA's abort."""
    host, _, port = coordinator.rpartition(":")
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.25)
    raise RuntimeError(
        f"process {pid} of {n} could not reach the coordinator at {coordinator} within {timeout_s:g} s "
        f"({last}). "
        f"Start process 0 with the same --coordinator and --num_processes (it listens there), check that "
        f"HOST is process 0's address as seen from this host and that the port is open, or raise the timeout "
        f"(--init_timeout)"
    )


def is_primary() -> bool:
    """True on the process that logs and writes files (process 0)."""
    import jax

    return jax.process_index() == 0


def global_batch(batch, sharding):
    """A global ``jax.Array`` from a host batch every process holds in full (same seed, same stream): each
    process copies in only the rows its own devices hold.  One process: ``jax.device_put``."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)

    def put(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x  # already global
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, batch)


def to_host(tree):
    """Every leaf as a full numpy array on every process (gathers the shards other processes hold)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)


def check_agree(values: dict, what: str = "flags") -> None:
    """Every process of the job must run with the same ``values`` (learning rate, seed, steps, batch,
    schedule, mesh, ...): processes started by hand with different ones trained inconsistent parameters with
    no warning, or aborted in a collective whose error named none of them.  Each process hashes each value;
    the hashes are gathered (one small collective) and a ``ConfigError`` on every process names the keys that
    differ, with this process's values.  A no-op for one process."""
    import hashlib
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    keys = sorted(values)
    code = lambda v: int.from_bytes(hashlib.sha256(repr(v).encode()).digest()[:4], "little") & 0x7FFFFFFF
    mine = np.array([len(keys)] + [code(values[k]) for k in keys], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    if np.all(every == every[0]):
        return
    if np.any(every[:, 0] != every[0, 0]):
        raise ConfigError(
            f"the processes of this job disagree on which {what} they check ({len(keys)} here); "
            f"start every process with the same jaxpipe version"
        )
    differ = [k for i, k in enumerate(keys) if np.any(every[:, i + 1] != every[0, i + 1])]
    groups = {
        k: sorted({int(p) for p in np.nonzero(every[:, keys.index(k) + 1] != every[0, keys.index(k) + 1])[0]})
        for k in differ
    }
    raise ConfigError(
        f"process {jax.process_index()}: the processes of this job were started with different {what}: "
        + "; ".join(
            f"{k} (this process: {values[k]!r}; processes {groups[k]} differ from process 0)" for k in differ
        )
        + ". Every process must run with the same values: start them from one command (experiments.launch) "
        "or "
        "check each process's command line"
    )


def check_mesh_covers_processes(mesh) -> None:
    """Every process must hold devices of ``mesh``: a process without any has nothing to compute and fails
    later in a collective or reading a result ("spans non-addressable devices"), far from the cause."""
    import jax

    n = jax.process_count()
    held = {d.process_index for d in mesh.devices.flat}
    left_out = sorted(set(range(n)) - held)
    if left_out and n > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxpipe mesh check")  # every process says it, then exits
    if left_out:
        per = jax.local_device_count()
        raise ConfigError(
            f"the mesh {dict(mesh.shape)} uses {mesh.devices.size} device(s), all on process(es) "
            f"{sorted(held)}; "
            f"process(es) {left_out} hold none of them. The job has {n} processes x {per} devices = "
            f"{n * per}: "
            f"give a mesh of {n * per} devices (e.g. more data-parallel replicas), or start each process "
            "with "
            f"{mesh.devices.size // n or 1} device(s) (XLA_FLAGS=--xla_force_host_platform_device_count on "
            "CPU, "
            f"CUDA_VISIBLE_DEVICES on GPU)"
        )
