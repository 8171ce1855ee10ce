"""ZB-H1 and ZB-V placed for measured op costs (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3: the
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

ZB-V (two chunks a device in a V, :mod:`.v_shape`) is searched the same way over its 2D model stages, at its
memory (2D chunk activations a device): at D = 2 and chunk costs (10, 10, 16), 304 / 592 at M = 4 / 8 against
1F1B's 360 / 648 for whole stages (0.84x / 0.91x; its unit-time order 0.94x / 1.04x).

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
#: the same for two chunks a device (a V: 7 moves a device a tick; the optimum of width 200 at D = 2, M <= 16)
WIDTH_CHUNKED = {1: 100, 2: 100, 3: 30}


def check_costs(costs, name: str = "zb_h1") -> Tuple[float, float, float]:
    try:
        f, b, w = (float(c) for c in costs)
    except (TypeError, ValueError):
        raise ScheduleError(f"{name}: costs={costs!r}: give (f, b, w), one stage's forward, its backward's input "
                            f"part and its weight part, measured in any one unit") from None
    if not (f > 0 and b > 0 and w > 0):
        raise ScheduleError(f"{name}: costs={costs!r}: every cost must be positive")
    return f, b, w


def _moves(state, d: int, on, cap: int, M: int):
    """Device ``d``'s possible actions this tick ((kind, stage) or None), given every stage's counts at its
    start; ``on[d]``: the model stages it holds."""
    S = len(state)
    held = sum(state[s][0] - state[s][2] for s in on[d])
    out = [None]
    for s in on[d]:
        nf, nb, nw = state[s]
        if nf < M and held < cap and (s == 0 or state[s - 1][0] > nf):
            out.append((F, s))
        if nb < nf and (s == S - 1 or state[s + 1][1] > nb):
            out.append((B, s))
        if nw < nb:
            out.append((W, s))
    return out


def _joint(state, on, cap: int, M: int):
    """Every combination of the devices' moves (not all idle)."""
    combos = [()]
    for d in range(len(on)):
        combos = [c + (m,) for c in combos for m in _moves(state, d, on, cap, M)]
    return [c for c in combos if any(m is not None for m in c)]


def _advance(state, moves):
    nxt = list(state)
    for m in moves:
        if m is not None:
            kind, s = m
            nf, nb, nw = nxt[s]
            nxt[s] = (nf + (kind == F), nb + (kind == B), nw + (kind == W))
    return tuple(nxt)


def search(D: int, M: int, costs: Sequence[float], width: int = 0, devices: Sequence[int] = (),
           cap: int = 0) -> Tuple[float, List[tuple]]:
    """``(predicted step, per-tick moves)`` of the cheapest lockstep plan the search finds (module docstring).
    ``devices``: the device of each model stage (default: stage d on device d); ``cap``: stage activations a
    device may hold between a forward and its W (default: D whole stages)."""
    f, b, w = costs
    devices = list(devices) or list(range(D))
    S = len(devices)
    on = [[s for s in range(S) if devices[s] == d] for d in range(D)]
    cap = cap or min(D, M) * (S // D)
    width = width or (WIDTH if S == D else WIDTH_CHUNKED)[D]
    price = {F: f, B: b, W: w}
    start = tuple((0, 0, 0) for _ in range(S))
    goal = tuple((M, M, M) for _ in range(S))
    left = lambda st: max(sum((M - st[s][0]) * f + (M - st[s][1]) * b + (M - st[s][2]) * w for s in ss) for ss in on)
    beam: Dict[tuple, Tuple[float, list]] = {start: (0.0, [])}
    for _ in range(4 * M * S + 4 * D):
        if goal in beam:
            return beam[goal]
        nxt: Dict[tuple, Tuple[float, list]] = {}
        for st, (cost, path) in beam.items():
            for moves in _joint(st, on, cap, M):
                n = _advance(st, moves)
                c = cost + max(price[m[0]] for m in moves if m is not None)
                if n not in nxt or c < nxt[n][0]:
                    nxt[n] = (c, path + [moves])
        ranked = sorted(nxt.items(), key=lambda kv: (kv[1][0] + left(kv[0]), kv[1][0]))
        beam = dict(ranked[:width])
    if goal in beam:
        return beam[goal]
    raise ScheduleError(f"the cost-aware search found no complete plan for D = {D}, M = {M}")


def build_costed(num_stages: int, num_microbatches: int, costs: Sequence[float], width: int = 0,
                 name: str = "zb_h1", devices: Sequence[int] = (), chunk_of: Sequence[int] = ()) -> Schedule:
    """``name``'s actions with ticks chosen for ``costs`` = (f, b, w) of one model stage (module docstring).
    ``devices`` / ``chunk_of``: each model stage's device and chunk there (default: one stage a device)."""
    D, M = num_stages, num_microbatches
    S = len(devices) or D
    if D > (4 if S == D else 3) or M > 32:
        raise ScheduleError(f"{name}: costs= plans D = {D}, M = {M} by a search over every device's move per "
                            f"tick; it serves D <= {4 if S == D else 3} and M <= 32 -- leave costs out for the "
                            f"unit-time order")
    _, path = search(D, M, check_costs(costs, name), width, devices)
    devices, chunk_of = list(devices) or list(range(D)), list(chunk_of) or [0] * D
    orders: List[List[Action]] = [[] for _ in range(D)]
    ticks, counts = {}, [[0, 0, 0] for _ in range(S)]
    for t, moves in enumerate(path):
        for m in moves:
            if m is None:
                continue
            kind, s = m
            i = {F: 0, B: 1, W: 2}[kind]
            a = Action(kind, counts[s][i], s, chunk_of[s])
            counts[s][i] += 1
            orders[devices[s]].append(a)
            ticks[(kind, s, a.mb)] = t
    out = Schedule(name, D, M, orders, num_model_stages=S)
    out.fixed_ticks = ticks
    return out
