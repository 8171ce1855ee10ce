"""A gate in front of a job's coordinator: a process of another job cannot join it by mistake (item
3).

JAX's coordination service (process 0, on the coordinator's port) takes a process that connects as task ``k``
of a running job for task ``k`` restarted, and aborts every process of the job ("unexpectedly tried to connect
with a different incarnation").  A second job started by hand on the port of a running one killed it so: its
process 0 found the port taken, but its process 1 connected.

So process 0 also listens on the next port (coordinator port + 1: the *gate*), and every other process asks
there before it connects: ``JOIN <process_id> <num_processes> <job>``.  The gate admits each process index
once, while the job assembles and only with the same number of processes and job identity (``JAXPIPE_JOB_ID``,
which ``experiments.launch`` sets per launch); once the job runs, it refuses everyone, says so to the asker --
which raises a :class:`~jaxpipe.errors.ConfigError` naming the running job -- and logs the intruder on process
0.  Where the gate's port is taken or a gate does not answer (a job without one), processes join as before.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Optional

from .errors import ConfigError

_GATE = None  # process 0's gate (one per process)


def gate_address(coordinator: str):
    host, _, port = coordinator.rpartition(":")
    return host, int(port) + 1


def job_identity() -> str:
    return os.environ.get("JAXPIPE_JOB_ID", "-").replace(" ", "_") or "-"


class Gate:
    """Process 0's side: a daemon thread answering ``JOIN`` requests on the gate port."""

    def __init__(self, coordinator: str, num_processes: int):
        host, port = gate_address(coordinator)
        self.n, self.job, self.claimed, self.running = num_processes, job_identity(), {0}, False
        self.since = None
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("" if host in ("0.0.0.0", "[::]") else host, port))
        self.sock.listen(16)
        threading.Thread(target=self._serve, name="jaxpipe-join-gate", daemon=True).start()

    def close(self):
        """Stop answering (a blocked ``accept`` is woken by the shutdown)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def started(self):
        """The job has assembled: from now on every request is an intruder."""
        self.running, self.since = True, time.strftime("%H:%M:%S")

    def _serve(self):
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    words = conn.recv(256).decode(errors="replace").split()
                    conn.sendall((self._answer(words, peer) + "\n").encode())
                except OSError:
                    pass

    def _answer(self, words, peer) -> str:
        if len(words) != 4 or words[0] != "JOIN" or not words[1].isdigit() or not words[2].isdigit():
            return "REFUSE this port is a jaxpipe job's join gate; the request was not understood"
        k, n, job = int(words[1]), int(words[2]), words[3]
        why = None
        if self.running:
            why = (
                f"the job on this coordinator is running since {self.since} with all {self.n} processes "
                "joined "
                f"(process 0: pid {os.getpid()} on {socket.gethostname()})"
            )
        elif n != self.n or job != self.job:
            why = (
                f"the job on this coordinator has {self.n} processes and identity {self.job!r}; this process "
                f"asks to join one of {n} with identity {job!r}"
            )
        elif k in self.claimed:
            why = f"process {k} of the job on this coordinator has joined already"
        if why is None:
            self.claimed.add(k)
            return "OK"
        try:
            sys.stderr.write(
                f"jaxpipe: refused a process at {peer[0]}:{peer[1]} asking to join as process {k} of "
                f"{n} (identity {job!r}): {why}. This job goes on\n"
            )
            sys.stderr.flush()
        except OSError:
            pass
        return "REFUSE " + why


def open_gate(coordinator: str, num_processes: int) -> Optional[Gate]:
    """Process 0: the gate, or None where its port is taken (the job then runs without one)."""
    global _GATE
    try:
        _GATE = Gate(coordinator, num_processes)
    except OSError as e:
        host, port = gate_address(coordinator)
        sys.stderr.write(
            f"jaxpipe: port {port} (the coordinator's + 1) is taken ({e.strerror}): this job runs "
            f"without a join gate, so a process of another job started on its coordinator would "
            f"abort it; a coordinator port whose next port is free avoids that\n"
        )
        _GATE = None
    return _GATE


def job_started() -> None:
    if _GATE is not None:
        _GATE.started()


def ask(coordinator: str, process_id: int, num_processes: int, timeout_s: float = 5.0) -> None:
    """A process other than 0, before it connects to the coordination service: ConfigError where the gate
    refuses it; nothing where no gate answers (a job without one)."""
    try:
        with socket.create_connection(gate_address(coordinator), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(f"JOIN {process_id} {num_processes} {job_identity()}\n".encode())
            reply = s.recv(4096).decode(errors="replace").strip()
    except OSError:
        return
    if reply.startswith("REFUSE"):
        raise ConfigError(
            f"process {process_id} of {num_processes} was refused by the coordinator at "
            f"{coordinator}: {reply[len('REFUSE ') :]}. Joining would abort that job; give this job "
            f"its own --coordinator port (experiments.launch picks a free one)"
        )
