"""Chimera: bidirectional pipelines (Li & Hoefler, SC'21, the paper's section numbers below).

§3.1: a *down* pipeline maps stage s to device s, an *up* pipeline maps it to device D-1-s; every device
holds the two stage replicas the pipelines need (chunk 0: stage d, chunk 1: stage D-1-d).  The N micro-batches
of a step are split between the directions as evenly as possible (down to N = 1); each direction runs 1F1B;
the two are merged per device by their unit-time ticks, which never conflict for even D.  The replicas'
gradients are summed before the update (the executor scatter-adds them into one copy per stage, so the two
replicas stay bit-identical).

§3.6: ``pipelines = 2f`` (f dividing D/2): down pipeline i maps stage s to device (s + i D/f) mod D, up
pipeline i is its reverse; each device holds 2f replicas.  Table 3: bubble (D-2f)/(2fN+D-2f) with f = b,
weights 2f M_theta, activations [(D - D/2f + 1) M_a, D M_a].

§3.5: for N > D the schedule of one basic unit (D micro-batches) is repeated.  ``concat="direct"``: the
units' orders are concatenated and list-scheduled in unit time, so the first unit's trailing bubbles take
the next unit's forwards.  Bubble ratios equal Table 2/3 for every (D, N, f) tested (tests/test_chimera).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from .ir import Action, B, F, Schedule, ScheduleError
from .one_f_one_b import build_1f1b

CONCATS = ("direct", "forward_doubling", "backward_halving")


def pipeline_maps(D: int, pipelines: int) -> List[List[int]]:
    """``maps[j][s]``: the device that runs stage s in pipeline j (down pipelines first, then up)."""
    f = pipelines // 2
    down = [[(s + i * (D // f)) % D for s in range(D)] for i in range(f)]
    up = [[m[D - 1 - s] for s in range(D)] for m in down]
    return down + up


def check(D: int, M: int, pipelines: int, concat: str) -> None:
    if D % 2:
        raise ScheduleError(
            f"chimera needs an even number of stages (it pairs stage d with stage D-1-d on "
            f"one device), got D={D}; use D={D - 1 if D > 1 else 2} or {D + 1}"
        )
    if pipelines < 2 or pipelines % 2 or (D // 2) % (pipelines // 2):
        ok = [2 * f for f in range(1, D // 2 + 1) if (D // 2) % f == 0]
        raise ScheduleError(
            f"chimera: pipelines={pipelines} is not 2f with f dividing D/2={D // 2}; for D={D} "
            f"use one of {ok}"
        )
    if concat not in CONCATS:
        raise ScheduleError(f"chimera: unknown concat {concat!r}; use one of {', '.join(CONCATS)}")


def unit_ticks(D: int, mbs_per_pipe: List[List[int]], pipelines: int) -> List[Tuple[int, int, Action, int]]:
    """One basic unit: every pipeline's 1F1B, as (tick, device, action, index of the micro-batch within its
    pipeline) in unit time."""
    out = []
    for j, (mp, mbs) in enumerate(zip(pipeline_maps(D, pipelines), mbs_per_pipe)):
        if not mbs:
            continue
        one = build_1f1b(D, len(mbs))
        ticks = one.ticks()
        for pos, acts in enumerate(one.actions):
            for a in acts:
                out.append(
                    (ticks[(a.kind, a.stage, a.mb)], mp[a.stage], Action(a.kind, mbs[a.mb], a.stage, j), a.mb)
                )
    return out


def split_microbatches(mbs: List[int], pipelines: int) -> List[List[int]]:
    """As evenly as possible, contiguous (Figure 3: down gets 0, 1; up gets 2, 3)."""
    n, out, start = len(mbs), [], 0
    for j in range(pipelines):
        k = n // pipelines + (1 if j < n % pipelines else 0)
        out.append(mbs[start : start + k])
        start += k
    # with fewer micro-batches than pipelines, alternate down / up so N = 2 uses both directions
    if n < pipelines:
        f = pipelines // 2
        order = [i for pair in zip(range(f), range(f, pipelines)) for i in pair]
        out = [[] for _ in range(pipelines)]
        for m, j in zip(mbs, order):
            out[j].append(m)
    return out


def merge(unit: list, D: int) -> List[List[Action]]:
    """One unit's per-device orders: actions by planned tick; where two pipelines want one device in the
    same tick (the middle devices in the forward phase), the older micro-batch of its pipeline first."""
    orders: List[List[Action]] = [[] for _ in range(D)]
    for t, d, a, k in sorted(unit, key=lambda x: (x[0], x[3], x[2].kind != B)):
        orders[d].append(a)
    return orders


def list_schedule(priority: List[List[Action]], D: int, M: int) -> List[List[Action]]:
    """Unit-time list scheduling: every tick each device runs the first action of its priority list whose
    inputs are there, keeping the list's order among the actions of one (replica, kind).  With the units'
    orders concatenated this is direct concatenation (§3.5, Figure 7(b)): the next unit's forwards move up
    into the trailing bubbles of the one before."""
    probe = Schedule("chimera", D, M, priority)
    done: Dict[Tuple[str, int, int], int] = {}
    rest = [list(p) for p in priority]
    out: List[List[Action]] = [[] for _ in range(D)]
    t = 0
    while any(rest):
        for d in range(D):
            seen = set()
            for i, a in enumerate(rest[d]):
                if a.pair or (a.chunk, a.kind) in seen:
                    continue
                seen.add((a.chunk, a.kind))
                group = [a] + ([rest[d][i + 1]] if i + 1 < len(rest[d]) and rest[d][i + 1].pair else [])
                if all(k in done and done[k] <= t for g in group for k in probe.deps(g)):
                    for g in group:
                        out[d].append(rest[d].pop(i))
                        done[(g.kind, g.stage, g.mb)] = t + 1
                    break
        t += 1
        if t > 4 * M * D + 4 * D:
            raise ScheduleError(f"chimera: list scheduling stalled (D={D}, N={M}); please report this")
    return out


def build_chimera(
    num_stages: int,
    num_microbatches: int,
    pipelines: int = 2,
    concat: str = "direct",
    eager_reduce: bool = False,
    double_batch: bool = False,
) -> Schedule:
    """``double_batch`` (forward doubling only): the executor runs each forward pair as one micro-batch of
    twice the size (§3.5: the point is the arithmetic intensity), not as two forwards in one tick."""
    D, M = num_stages, num_microbatches
    check(D, M, pipelines, concat)
    if eager_reduce and pipelines != 2:
        raise ScheduleError(
            f"chimera: eager_reduce=True is implemented for 2 pipelines (the last stage's two "
            f"replicas); got pipelines={pipelines}: use eager_reduce=False"
        )
    if double_batch and concat != "forward_doubling":
        raise ScheduleError(
            f"chimera: double_batch=True runs forward doubling's pairs as one double-size "
            f"micro-batch; it needs concat='forward_doubling' (got concat={concat!r})"
        )
    if concat != "direct":
        s = build_doubled(D, M, pipelines, concat)
        s.options["eager_reduce"] = eager_reduce
        s.options["double_batch"] = bool(double_batch)
        return s
    units = [
        merge(unit_ticks(D, split_microbatches(list(range(m0, min(m0 + D, M))), pipelines), pipelines), D)
        for m0 in range(0, M, D)
    ]
    priority = [[a for u in units for a in u[d]] for d in range(D)]
    s = Schedule("chimera", D, M, list_schedule(priority, D, M), weight_versions=[pipelines] * D)
    s.options = {"pipelines": pipelines, "concat": concat, "eager_reduce": eager_reduce}
    return s


def build_doubled(D: int, N: int, pipelines: int, concat: str) -> Schedule:
    """Forward doubling and backward halving (§3.5, Figure 7(c)-(d)): every forward op carries two units
    (a paired forward: the executor's second lane, same tick), every backward one, so with b = 2f a forward
    tick and a backward tick cost the same and the intermediate bubbles of direct concatenation vanish.
    The basic block is 2D units: the Chimera basic unit over D *double* micro-batches, each forward of a
    double split into a forward pair and each backward into two consecutive backwards; blocks are
    concatenated by list scheduling, a residual D units (K odd) as a plain basic unit.

    forward_doubling: a unit is one micro-batch (N units; pair it with recomputation -- jaxpipe's Pipeline
    wraps the stage in ``jax.checkpoint`` -- to keep activation memory).  backward_halving: a unit is half a
    micro-batch (2N units, the schedule's ``num_microbatches``), no recomputation."""
    units = N if concat == "forward_doubling" else 2 * N
    if units < 2 * D or units % D:
        need = (
            f"N >= {2 * D} and a multiple of {D}"
            if concat == "forward_doubling"
            else f"N >= {D} and a multiple of {D // 2}"
        )
        raise ScheduleError(
            f"chimera: concat={concat!r} works on blocks of 2D = {2 * D} units; with D={D} it "
            f"needs {need}, got N={N}; use concat='direct' or a larger N"
        )
    blocks = []
    start = 0
    while units - start >= 2 * D:
        base = start
        doubles = split_microbatches(list(range(D)), pipelines)
        order = merge(unit_ticks(D, doubles, pipelines), D)
        block = []
        for acts in order:
            out = []
            for a in acts:
                u0, u1 = base + 2 * a.mb, base + 2 * a.mb + 1
                if a.kind == F:
                    out += [Action(F, u0, a.stage, a.chunk), Action(F, u1, a.stage, a.chunk, pair=True)]
                else:
                    out += [Action(a.kind, u0, a.stage, a.chunk), Action(a.kind, u1, a.stage, a.chunk)]
            block.append(out)
        blocks.append(block)
        start += 2 * D
    if start < units:  # K odd: the residual D units as a plain basic unit
        blocks.append(
            merge(unit_ticks(D, split_microbatches(list(range(start, units)), pipelines), pipelines), D)
        )
    priority = [[a for blk in blocks for a in blk[d]] for d in range(D)]
    s = Schedule("chimera", D, units, list_schedule(priority, D, units), weight_versions=[pipelines] * D)
    s.options = {"pipelines": pipelines, "concat": concat, "eager_reduce": False, "units": units}
    return s
