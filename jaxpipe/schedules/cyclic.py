"""Cyclic Data Parallelism's timeline and activation profile (Fournier & Oyallon, Figure 1, §4.1, Table 1).
Pure Python.

N workers, the model cut into N stages, one time step per stage's forward or backward; worker ``i`` runs
its step-``k`` micro-batch's F of stage ``j`` at tick ``2Nk + 2i + j`` and B of stage ``j`` at
``2Nk + 2i + 2N - 1 - j`` (DP: every worker at ``2Nk + j`` and ``2Nk + 2N - 1 - j``).  A stage's
activations live from its F to the end of its B.  Units: one stage's activations of one micro-batch, so
``N`` units are ``B Psi_A`` (the whole model's activations of a micro-batch of size B).

On one device holding all N workers, DP peaks at ``N x N`` units (N B Psi_A) every 2N ticks, while the
cyclic order holds exactly ``N (N + 1) / 2`` units (``(N + 1)/2 B Psi_A``) at every tick: Table 1's
"Single-GPU DP + Cyclic" row, constant in time.
"""

from __future__ import annotations

from typing import Dict, List, Tuple


def op_of(N: int, worker: int, tick: int, cyclic: bool = True) -> Tuple[str, int, int]:
    """``(kind, stage, step)`` worker ``worker`` runs at ``tick`` (kind "" before its first op)."""
    tau = tick - (2 * worker if cyclic else 0)
    if tau < 0:
        return "", -1, -1
    k, p = divmod(tau, 2 * N)
    return ("F", p, k) if p < N else ("B", 2 * N - 1 - p, k)


def live_units(N: int, tick: int, cyclic: bool = True) -> int:
    """Stage activations held on one device running all N workers, during ``tick`` (a B still holds the
    activations it reads)."""
    total = 0
    for i in range(N):
        kind, j, _ = op_of(N, i, tick, cyclic)
        if kind:  # F of stage j holds stages 0..j; B of stage j still reads them too
            total += j + 1
    return total


def activation_profile(N: int, cyclic: bool = True, periods: int = 3) -> List[int]:
    """Live stage-activation units per tick over ``periods`` x 2N ticks, from the steady state on."""
    start = 2 * N if cyclic else 0  # the cyclic order is steady once every worker started
    return [live_units(N, t, cyclic) for t in range(start, start + periods * 2 * N)]


def table1_units(N: int) -> Dict[str, float]:
    """Table 1's activation memory per device in stage units: single-GPU DP N * N; + Cyclic N (N + 1) / 2;
    multi-GPU (one worker per device): N for both."""
    return {"single_dp": N * N, "single_cyclic": N * (N + 1) / 2, "multi_dp": N, "multi_cyclic": N}


def pool_size(N: int) -> int:
    return N * (N + 1) // 2


def pool_slot(N: int, worker, stage, step):
    """Pool slot of the activations of (worker, stage, step) on one device running all N workers.  Stage j's
    activations are created every 2 ticks (worker after worker: creation index c = N step + worker) and
    live 2N - 2j - 1 ticks, so N - j slots taken round-robin suffice: slot = offset_j + c mod (N - j), with
    offset_j = sum over j' < j of (N - j').  In all N (N + 1)/2 slots.  Works on ints or traced ints."""
    offset = stage * N - (stage * (stage - 1)) // 2
    return offset + (N * step + worker) % (N - stage)


def check_pool(N: int, periods: int = 4) -> int:
    """Replay ``periods`` x 2N ticks and return the most slots live at once; raises on a collision."""
    live: Dict[int, Tuple[int, int, int]] = {}
    peak = 0
    for t in range(periods * 2 * N):
        for i in range(N):
            kind, j, k = op_of(N, i, t)
            if kind == "F":
                s = pool_slot(N, i, j, k)
                if s in live:
                    raise AssertionError(f"N={N}: slot {s} of {live[s]} reused by {(i, j, k)} at tick {t}")
                live[s] = (i, j, k)
        peak = max(peak, len(live))
        for i in range(N):
            kind, j, k = op_of(N, i, t)
            if kind == "B":
                del live[pool_slot(N, i, j, k)]
    return peak


def stream(N: int):
    """The DP form as data for the no-flush executor (``runtime/executor.py`` runs it; pictures read
    :func:`op_of`, and a test replays one against the other): every worker holds the N stages as chunks of one
    device, a call is one step of 2N ticks in which the worker's micro-batch runs F down the stages (stage j
    at tick j) and B back up (stage j at 2N - 1 - j), and worker i runs it 2i ticks late
    (``replica_delay``)."""
    from .ir import B, F
    from .periodic import Periodic

    return Periodic(
        "cdp_dp",
        1,
        2 * N,
        {F: (0,), B: (2 * N - 1,)},
        chunks=N,
        units=tuple((j, 0, 0, 0) for j in range(N)),
        unit_offsets={F: tuple((j,) for j in range(N)), B: tuple((2 * N - 1 - j,) for j in range(N))},
        call_length=2 * N,
        replica_delay=2,
    ).validate()
