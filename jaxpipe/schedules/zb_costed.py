"""ZB-H1 placed for measured op costs (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3: the
paper's own schedules are built from profiled F, B and W times; issue #49).

The unit-time ZB-H1 order (:mod:`.zero_bubble`) assumes f = b = w.  Run in lockstep -- a tick lasts as long
as its slowest device's action, and ends in one exchange -- it loses where W costs more than F: on the
two-process CPU testbed (f, b, w = 10, 10, 16 ms) its steady state puts one device's W beside the other's F,
and at D = 2, M = 8 it is predicted 1.05x 1F1B's step.  Here the ticks themselves are chosen for the costs: a
search over lockstep ticks, each device running at most one action per tick (F, B, W or nothing) under
ZB-H1's rules -- B as soon as its gradient arrived, F within 1F1B's memory (at most D micro-batches between a
forward and its W on every stage), W any time after its B -- minimising the sum over ticks of the slowest
device's action.  Measured optimum at D = 2 and those costs (exhaustive over the same tick model): M = 4
160 against 1F1B's 180 (0.89x; the unit-time order 172), M = 8 304 against 324 (0.94x; unit-time 340).

The search keeps the ``width`` cheapest partial plans per tick (by cost so far plus the busiest device's
remaining work), so it is exact for small D and M and a good plan beyond; the schedule carries its ticks
(``fixed_ticks``), which the executor's ordered placement runs as they are.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .ir import Action, B, F, W, Schedule, ScheduleError

#: partial plans kept per tick, by device count (found the exhaustive optimum at D = 2, M <= 8, and 27 units at
#: D = 4, M = 8, unit costs -- the paper's (D - 1)(f + b - w) bubble -- in about a second)
WIDTH = {1: 400, 2: 400, 3: 150, 4: 50}


def check_costs(costs) -> Tuple[float, float, float]:
    try:
        f, b, w = (float(c) for c in costs)
    except (TypeError, ValueError):
        raise ScheduleError(f"zb_h1: costs={costs!r}: give (f, b, w), one stage's forward, its backward's input "
                            f"part and its weight part, measured in any one unit") from None
    if not (f > 0 and b > 0 and w > 0):
        raise ScheduleError(f"zb_h1: costs={costs!r}: every cost must be positive")
    return f, b, w


def _moves(state, d: int, D: int, M: int, cap: int):
    """Device ``d``'s possible actions this tick (kind or None), given every device's counts at its start."""
    nf, nb, nw = state[d]
    out = [None]
    if nf < M and nf - nw < cap and (d == 0 or state[d - 1][0] > nf):
        out.append(F)
    if nb < nf and (d == D - 1 or state[d + 1][1] > nb):
        out.append(B)
    if nw < nb:
        out.append(W)
    return out


def _joint(state, D: int, M: int, cap: int):
    """Every combination of the devices' moves (not all idle)."""
    combos = [()]
    for d in range(D):
        combos = [c + (m,) for c in combos for m in _moves(state, d, D, M, cap)]
    return [c for c in combos if any(m is not None for m in c)]


def _advance(state, moves):
    nxt = []
    for (nf, nb, nw), m in zip(state, moves):
        nxt.append((nf + (m == F), nb + (m == B), nw + (m == W)))
    return tuple(nxt)


def search(D: int, M: int, costs: Sequence[float], width: int = 0) -> Tuple[float, List[tuple]]:
    """``(predicted step, per-tick moves)`` of the cheapest lockstep plan the search finds (module docstring)."""
    f, b, w = costs
    width = width or WIDTH[D]
    price = {None: 0.0, F: f, B: b, W: w}
    cap = min(D, M)
    start = tuple((0, 0, 0) for _ in range(D))
    goal = tuple((M, M, M) for _ in range(D))
    left = lambda s: max((M - nf) * f + (M - nb) * b + (M - nw) * w for nf, nb, nw in s)
    beam: Dict[tuple, Tuple[float, list]] = {start: (0.0, [])}
    for _ in range(4 * M * D + 4 * D):
        if goal in beam:
            return beam[goal]
        nxt: Dict[tuple, Tuple[float, list]] = {}
        for s, (cost, path) in beam.items():
            for moves in _joint(s, D, M, cap):
                n = _advance(s, moves)
                c = cost + max(price[m] for m in moves)
                if n not in nxt or c < nxt[n][0]:
                    nxt[n] = (c, path + [moves])
        ranked = sorted(nxt.items(), key=lambda kv: (kv[1][0] + left(kv[0]), kv[1][0]))
        beam = dict(ranked[:width])
    if goal in beam:
        return beam[goal]
    raise ScheduleError(f"zb_h1: the cost-aware search found no complete plan for D = {D}, M = {M}")


def build_costed(num_stages: int, num_microbatches: int, costs: Sequence[float], width: int = 0) -> Schedule:
    """ZB-H1 with ticks chosen for ``costs`` = (f, b, w) (module docstring)."""
    D, M = num_stages, num_microbatches
    if D > 4 or M > 32:
        raise ScheduleError(f"zb_h1: costs= plans D = {D}, M = {M} by a search over every device's move per tick "
                            f"(4^D combinations a tick); it serves D <= 4 and M <= 32 -- leave costs out for the "
                            f"unit-time order")
    _, path = search(D, M, check_costs(costs), width)
    orders: List[List[Action]] = [[] for _ in range(D)]
    ticks, counts = {}, [[0, 0, 0] for _ in range(D)]
    for t, moves in enumerate(path):
        for d, m in enumerate(moves):
            if m is None:
                continue
            i = {F: 0, B: 1, W: 2}[m]
            a = Action(m, counts[d][i], d)
            counts[d][i] += 1
            orders[d].append(a)
            ticks[(m, d, a.mb)] = t
    s = Schedule("zb_h1", D, M, orders)
    s.fixed_ticks = ticks
    return s
