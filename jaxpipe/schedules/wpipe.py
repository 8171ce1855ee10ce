"""WPipe: double-grouped weight updates, 2GW (Yang et al., WPipe §3.2, Figures 4-5, Table 1).  Pure Python.

The model is cut into 2D partitions: device ``d`` holds partition ``d`` of group G0 (local chunk 0) and
partition ``D + d`` of group G1 (chunk 1); a micro-batch runs G0 down the devices, G1 down again, then G1
and G0 back up.  WPipe's pipeline is two pipelines of "V units" cross-spliced (Figure 4(c), P(P(G0), P(G1))):

* a G1 unit ``(p, j)`` is F1 of micro-batch j of batch p down the devices, then its B1 back up;
* a G0 unit ``(p, j)`` is F0 of micro-batch j of batch **p + 1** down, then B0 of micro-batch j of batch p
  back up -- the G0 forward of the next update period moved in front of the G0 backward of the current one.

jaxpipe streams the units through a no-flush 1F1B pattern: unit ``s`` runs its down op on device ``d`` at
tick ``2s + d`` and its up op at tick ``2s + 2D - 1 - d``; every device does one op per tick (down ops on
one parity, up ops on the other), so the steady state has **no bubble** (Table 1).  Units come in runs of
M: period ``p`` (stream positions ``[2Mp, 2Mp + 2M)``) is the M G0 units ``(p - 1, j)`` and then the M G1
units ``(p, j)``.  Each run separates the other group's batches by M + 1 >= D units, which gives exactly:

* G1: every F1 of batch p + 1 after the last B1 of batch p on each device -- one weight version and the
  update semantics of data parallelism, eq. (1) with i = 1;
* G0: F0 of batch p + 1 after every B0 of batch p - 1 (so it reads version p) and before the B0 of batch
  p (which still reads version p - 1): two versions and one delay, eq. (1) with i = 0;
* the G0 -> G1 activation of micro-batch j waits 2M - D ticks on device 0 and the G1 -> G0 gradient 2M - D
  ticks on device D - 1 (buffered by micro-batch index).

Valid for ``M >= D - 1`` (checked).  ``steady_state(D, M)`` reports the bubble, in-flight activations and
weight versions measured on this timeline; ``build_wpipe`` gives one batch's actions (fill and drain
included) for drawing.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from .ir import B, F, Schedule, ScheduleError


def check(D: int, M: int):
    if M < max(D - 1, 1):
        raise ScheduleError(
            f"wpipe needs num_microbatches >= num_stages - 1 (got M={M}, D={D}): each group's run of M units "
            f"must cover the pipeline's depth so that G1's batches never overlap on a device (its one weight "
            f"version) and G0 keeps two (WPipe §3.2, M >= N); use num_microbatches={max(D - 1, 1)} or more"
        )


def unit(s: int, M: int) -> Tuple[int, int, int]:
    """Stream position ``s`` -> (group, batch p of the unit, micro-batch j)."""
    p, r = divmod(s, 2 * M)
    return (0, p - 1, r) if r < M else (1, p, r - M)


def op_at(t: int, d: int, D: int, M: int) -> Optional[Tuple[str, int, int, int]]:
    """``(kind, group, batch, mb)`` device ``d`` runs at tick ``t`` (None before the stream reaches it).
    Down ops are forwards (G0's forward is of batch p + 1), up ops backwards."""
    if (t - d) % 2 == 0:
        s = (t - d) // 2
        if s < 0:
            return None
        g, p, j = unit(s, M)
        return ("F", g, p + 1 if g == 0 else p, j)
    s = (t - 2 * D + 1 + d) // 2
    if s < 0:
        return None
    g, p, j = unit(s, M)
    return ("B", g, p, j)


def stream(D: int, M: int):
    """The timeline as data for the executor (``runtime/executor.py`` runs it; pictures read
    :func:`op_at`, and a test replays one against the other tick for tick): the no-flush 1F1B of
    :func:`.periodic.no_flush_1f1b` over stream units, two chunks per device, unit ``u`` of a call (one batch,
    2M units) G0's ``(F of batch q, B of batch q - 1, micro-batch u)`` for ``u < M`` and G1's ``(F and B of
    batch q, micro-batch u - M)`` after them."""
    from .periodic import Periodic

    check(D, M)
    units = tuple((0, 0, -1, j) for j in range(M)) + tuple((1, 0, 0, j) for j in range(M))
    return Periodic(
        "wpipe", D, 2, {F: tuple(range(D)), B: tuple(2 * D - 1 - d for d in range(D))}, chunks=2, units=units
    ).validate()


@dataclasses.dataclass
class WPipeSteadyState:
    D: int
    M: int
    period: int  # ticks per batch (4M: each device runs 4M ops per batch)
    bubble: float  # idle fraction of the steady-state ticks
    g0_inflight: List[int]  # per device: most G0 partitions' activations held at once (micro-batches)
    g1_inflight: List[int]  # per device: same for G1
    activations_units: float  # the sum over devices of (G0 + G1) peaks, in S_a / (2D) units
    table1_units: float  # the paper's (4M - N + 1)/4 S_a in the same units: D (4M - D + 1) / 2
    weight_buffer_partitions: int  # G0's two versions on every device (S_m in Table 1's accounting)
    boundary_wait: int  # ticks the G0 -> G1 activation and the G1 -> G0 gradient wait

    def table1(self) -> List[Tuple[str, str, str]]:
        """(quantity, WPipe's Table 1 / §3.2-3.3, this timeline) -- and why they differ where they do."""
        D, M = self.D, self.M
        return [
            (
                "condition",
                "M >= N (N = D stages)",
                "M >= D - 1: each group's run of M units sits M + 1 units from the other group's, which "
                "already "
                "separates G1's batches and keeps G0 at two versions when M = D - 1 (replayed: 0 version "
                "errors)",
            ),
            (
                "bubble",
                "0",
                f"{self.bubble:g} in the steady state (unit ticks; fill and drain only at start/end)",
            ),
            (
                "weight buffers",
                "S_m (G0's second version)",
                f"{self.weight_buffer_partitions} partitions = G0's "
                f"2 x D partitions: S_m as Table 1 counts it",
            ),
            (
                "G0 in flight on stage d",
                f"M = {M}",
                f"min(M + D - d, 2M) = {self.g0_inflight}: a G0 activation lives a whole period plus the V "
                "unit's "
                f"skew (its forward moved one period ahead of its backward, then D - d ticks of the pipe)",
            ),
            (
                "G1 in flight on stage d",
                f"M - d = {[M - d for d in range(D)]}",
                f"min(D - d, M) = {self.g1_inflight}: G1 runs 1F1B-like units, the paper's Figure 5 keeps "
                "G1's "
                f"forwards of a batch before its backwards",
            ),
            (
                "activations, sum over stages",
                f"(4M - N + 1)/4 S_a = {self.table1_units:g} units of S_a / 2N",
                f"{self.activations_units:g} units: smaller when M > D + 1, larger below",
            ),
        ]


def steady_state(D: int, M: int, periods: int = 6) -> WPipeSteadyState:
    """Replay ``periods`` batches of the timeline and measure the middle ones."""
    check(D, M)
    T = 4 * M
    first, last = 2 * T, (periods - 2) * T
    peak = {(d, g): 0 for d in range(D) for g in (0, 1)}
    idle = 0
    held: Dict[Tuple[int, int], set] = {(d, g): set() for d in range(D) for g in (0, 1)}
    for t in range(periods * T):
        for d in range(D):
            op = op_at(t, d, D, M)
            ok = op is not None and 0 <= op[2] < periods
            if first <= t < last and not ok:
                idle += 1
            if not ok:
                continue
            kind, g, p, j = op
            if kind == "F":
                held[(d, g)].add((p, j))
            if first <= t < last:
                peak[(d, g)] = max(peak[(d, g)], len(held[(d, g)]))
            if kind == "B":
                held[(d, g)].discard((p, j))
    g0 = [peak[(d, 0)] for d in range(D)]
    g1 = [peak[(d, 1)] for d in range(D)]
    return WPipeSteadyState(
        D,
        M,
        T,
        idle / (D * (last - first)),
        g0,
        g1,
        float(sum(g0) + sum(g1)),
        D * (4 * M - D + 1) / 2,
        2 * D,
        2 * M - D,
    )


def build_wpipe(num_stages: int, num_microbatches: int, batches: int = 2) -> Schedule:
    """Per-device actions of ``batches`` consecutive batches through the stream, fill and drain included
    (micro-batch index ``p M + j``; stage ``d`` is G0's partition on device d, ``D + d`` G1's), at the ticks
    the executor runs them: the expansion of :func:`stream` (replayed against :func:`op_at` in the tests)."""
    s = stream(num_stages, num_microbatches).expand(
        num_microbatches, weight_versions=[3] * num_stages, batches=batches
    )
    s.options = {"batches": batches}
    return s


def build_wpipe_step(num_stages: int, num_microbatches: int) -> Schedule:
    """The registered builder: one batch's view (what ``jp.Pipeline`` shows); see :func:`build_wpipe`."""
    s = build_wpipe(num_stages, num_microbatches, batches=1)
    s.num_microbatches = num_microbatches
    return s
