"""ZB-H1 and ZB-V placed for measured op costs (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3:
the paper's own schedules are built from profiled F, B and W times).

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

The ticks are searched as the executor runs them: consecutive ticks with no message between them run as one
(``lanes._fuse_ticks``), which costs its busiest device's actions, and a fourth cost -- what a tick's
exchange costs -- is paid once per tick run (the testbed's is about 3 ms against a 10 ms forward).

The search keeps the ``width`` cheapest partial plans per tick (by cost so far plus the busiest device's
remaining work), so it is exact for small D and M and a good plan beyond; the schedule carries its ticks
(``fixed_ticks``), which the executor's ordered placement runs as they are.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .ir import Action, B, F, W, Schedule, ScheduleError

from .lanes import check_costs


class SearchTooLarge(ScheduleError):
    """``costs=`` asked of a pipeline past what the search serves (it tries every device's move per tick):
    :class:`jaxpipe.Pipeline`, which adds the costs it measured itself, keeps the unit-time order there."""


#: partial plans kept per tick, by device count (found the exhaustive optimum at D = 2, M <= 8, and 27 units
#: at D = 4, M = 8, unit costs -- the paper's (D - 1)(f + b - w) bubble -- in about two seconds)
WIDTH = {1: 400, 2: 400, 3: 300, 4: 150}
#: the same for two chunks a device (a V: 7 moves a device a tick; the optimum of width 200 at D = 2, M <= 16)
WIDTH_CHUNKED = {1: 100, 2: 100, 3: 30}
#: partial plans kept per state of the counts (they differ in the tick being built)
PER_COUNTS = 2


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


_LANE = {F: 0, B: 1, W: 2}


def _group_step(moves, state, grp, on_dev, S: int):
    """Whether ``moves`` can run in the tick being built (``grp`` = (counts at its start, each device's last
    lane, each device's sent flag)), as :func:`jaxpipe.schedules.lanes._joins` fuses ticks: a device's actions
    in lane order, one message sent per device, nothing read that another device produced in the tick."""
    mark, lanes, sent = grp
    for d, m in enumerate(moves):
        if m is None:
            continue
        kind, s = m
        if _LANE[kind] <= lanes[d]:
            return False
        sends = (kind == F and s < S - 1 and on_dev[s + 1] != d) or (
            kind == B and s > 0 and on_dev[s - 1] != d
        )
        if sends and sent[d]:
            return False
        nf, nb, _ = state[s]
        # a cross-device input produced in this tick moves only at its end
        if kind == F and s > 0 and on_dev[s - 1] != d and not mark[s - 1][0] > nf:
            return False
        if kind == B and s < S - 1 and on_dev[s + 1] != d and not mark[s + 1][1] > nb:
            return False
        if kind == W and s < S - 1 and on_dev[s + 1] != d and not mark[s + 1][1] > state[s][2]:
            return False
    return True


def _grouped(moves, grp, on_dev, S: int):
    """The tick being built after ``moves`` joined it: (mark, lanes, sent)."""
    mark, lanes, sent = grp
    lanes, sent = list(lanes), list(sent)
    for d, m in enumerate(moves):
        if m is not None:
            kind, s = m
            lanes[d] = _LANE[kind]
            sent[d] = (
                sent[d]
                or (kind == F and s < S - 1 and on_dev[s + 1] != d)
                or (kind == B and s > 0 and on_dev[s - 1] != d)
            )
    return mark, tuple(lanes), tuple(sent)


def search(
    D: int,
    M: int,
    costs: Sequence[float],
    width: int = 0,
    devices: Sequence[int] = (),
    cap: int = 0,
    exchange: float = 0.0,
) -> Tuple[float, List[tuple]]:
    """``(predicted step, per-tick moves)`` of the cheapest lockstep plan the search finds (module docstring).
    ``devices``: the device of each model stage (default: stage d on device d); ``cap``: stage activations a
    device may hold between a forward and its W (default: D whole stages).  Consecutive ticks run as one
    where the executor fuses them (``lanes._fuse_ticks``): a fused tick costs its busiest device's actions,
    plus ``exchange`` for the exchange that ends it."""
    f, b, w = costs
    devices = list(devices) or list(range(D))
    S = len(devices)
    on = [[s for s in range(S) if devices[s] == d] for d in range(D)]
    cap = cap or min(D, M) * (S // D)
    width = width or (WIDTH if S == D else WIDTH_CHUNKED)[D]
    price = {F: f, B: b, W: w}
    start = tuple((0, 0, 0) for _ in range(S))
    goal = tuple((M, M, M) for _ in range(S))
    left = lambda st: max(
        sum((M - st[s][0]) * f + (M - st[s][1]) * b + (M - st[s][2]) * w for s in ss) for ss in on
    )
    empty = lambda st: (st, (-1,) * D, (False,) * D)
    # key (counts, the open tick's state, its devices' work so far) -> (cost of the closed ticks, path)
    beam: Dict[tuple, Tuple[float, list]] = {(start, empty(start), (0.0,) * D): (0.0, [])}
    for _ in range(4 * M * S + 4 * D):
        done = [(c + max(acc) + exchange, p) for (st, _, acc), (c, p) in beam.items() if st == goal]
        if done:
            return min(done, key=lambda cp: cp[0])
        nxt: Dict[tuple, Tuple[float, list]] = {}
        for (st, grp, acc), (closed, path) in beam.items():
            for moves in _joint(st, on, cap, M):
                add = [price[m[0]] if m is not None else 0.0 for m in moves]
                if _group_step(moves, st, grp, devices, S):
                    c, g, a = closed, grp, tuple(x + y for x, y in zip(acc, add))
                else:  # the open tick ends in an exchange; the moves open the next
                    c, g, a = closed + max(acc) + exchange, empty(st), tuple(add)
                key = (_advance(st, moves), _grouped(moves, g, devices, S), a)
                if key not in nxt or c < nxt[key][0]:
                    nxt[key] = (c, path + [moves])
        ranked = sorted(nxt.items(), key=lambda kv: (kv[1][0] + max(kv[0][2]) + left(kv[0][0]), kv[1][0]))
        beam, per = {}, {}
        for key, val in ranked:  # at most PER_COUNTS open ticks a state of the counts: a diverse beam
            if per.get(key[0], 0) < PER_COUNTS:
                per[key[0]] = per.get(key[0], 0) + 1
                beam[key] = val
                if len(beam) == width:
                    break
    raise ScheduleError(f"the cost-aware search found no complete plan for D = {D}, M = {M}")


def build_costed(
    num_stages: int,
    num_microbatches: int,
    costs: Sequence[float],
    width: int = 0,
    name: str = "zb_h1",
    devices: Sequence[int] = (),
    chunk_of: Sequence[int] = (),
) -> Schedule:
    """``name``'s actions with ticks chosen for ``costs`` = (f, b, w) of one model stage (module docstring).
    ``devices`` / ``chunk_of``: each model stage's device and chunk there (default: one stage a device)."""
    D, M = num_stages, num_microbatches
    S = len(devices) or D
    if D > (4 if S == D else 3) or M > 32:
        raise SearchTooLarge(
            f"{name}: costs= plans D = {D}, M = {M} by a search over every device's move per "
            f"tick; it serves D <= {4 if S == D else 3} and M <= 32 -- leave costs out for the "
            f"unit-time order"
        )
    vals = check_costs(costs, f"{name}: costs")
    _, path = search(D, M, vals[:3], width, devices, exchange=vals[3] if len(vals) == 4 else 0.0)
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
