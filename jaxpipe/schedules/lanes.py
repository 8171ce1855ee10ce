"""Lane placement: what the SPMD executor really runs, tick by tick (pure Python + NumPy, no JAX).

A lockstep tick holds *lanes* run one after the other on every device -- an ``F`` lane, a ``B`` lane, a
``W`` lane where the schedule splits the backward, an ``F2`` lane where Chimera pairs forwards (§3.5) --
each followed by a ``ppermute`` of the messages it produced.  A device runs at most one action per lane per
tick, and a device idle in a lane skips it (``lax.cond``): on CPU-emulated devices idle work costs real time,
since the emulated devices share the cores.  The one executor runs a plan as a stream of one call
(:func:`jaxpipe.schedules.periodic.one_call`), routing in the slots allocated here; the *phases* (runs of
ticks using the same lanes) are where Chimera's eager reduction may cut the call's scan.

Three placements of the same :class:`~jaxpipe.schedules.ir.Schedule`:

* ``"lanes"`` (default): every lane takes the device's actions of its kind in the schedule's order, each as
  soon as its inputs are there.  A tick costs ``f + b`` (one F and one B per device in steady state) instead
  of ``2 max(f, b)``; the price is memory -- stage 0 of a 1F1B-like schedule holds up to ``2D - 1``
  micro-batches (an F's message waits for the B lane of its tick before it moves on).  GPipe and 1F1B,
  which differ only in how a device interleaves F and B, become the same lane timeline.
* ``"ordered"``: the schedule's own one-action-per-tick placement (``Schedule.ticks()``), the classic
  memory bound (1F1B: ``D - d`` micro-batches on stage ``d``) at ``max(f, b)`` per tick.
* ``"ordered2"``: the ordered placement with its ticks fused into ticks of two rounds of lanes (``F, B, W``
  then ``F', B', W'``): every device runs its actions in the ordered plan's order and holds what it holds
  there, the lockstep step is no longer, and a tick can carry two of a device's ordered ticks -- a V's
  device its forward down and its forward back up.  On a real link every tick ends in a rendezvous of the
  devices, so fewer ticks is the point (ZB-V at D = 2, M = 8: 26 ticks against the ordered plan's 49 and
  the lanes plan's 21, at the ordered plan's step and memory).

Rules: an input from another device arrives the tick after it was sent; on the same device a later lane of
the same tick may use it (the last stage's F then its own B).  Slots: a stash slot written by F in lane
position ``p`` (``tick * lanes + lane``) is free once every read of its previous content happened before
``p``; a message slot is written at the end of its sender's lane, so a read in that same lane position may
still use the old content.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .ir import (
    B,
    B_,
    F,
    F_,
    W,
    W_,
    Action,
    Schedule,
    ScheduleError,
    _channel,
    _Slots,
    kind_of,
    SEND_KEEP,
    SEND_MINUS,
    SEND_NONE,
    SEND_PLUS,
)

F2 = "F2"
PLACEMENTS = ("auto", "lanes", "ordered", "ordered2")
#: columns of one lane's row: active flag, micro-batch, model stage, local chunk, stash slot (written by F,
#: read by B/W), message slot read (F: input activation, B/W: dL/dy), where the produced message goes
#: (SEND_*), its slot when it stays on the device, receive slots for the two channels, branch index, and
#: a split backward's frontier slot (written by B, read by W).
LCOLS = ("op", "mb", "stage", "chunk", "stash", "in", "send", "keep", "recv_p", "recv_m", "branch", "front")
L = {c: i for i, c in enumerate(LCOLS)}
MAX_PHASES = 5


@dataclasses.dataclass
class LanePlan:
    """The executor's view of a schedule: ``table[tick, device, lane, column]`` (columns :data:`LCOLS`).

    Attributes:
        schedule: the schedule it lowers.
        placement: ``"lanes"``, ``"ordered"`` or ``"ordered2"``.
        lanes: the lanes of a tick (``"F"``, ``"B"``, ``"W"``, ``"F2"``; ``"F'"``, ``"B'"``, ``"W'"``: a
            second lane of the kind).
        where: ``(kind, stage, mb) -> (tick, lane)``.
        table: the lowered table, int32.
        stash_capacity: stash slots on every device.
        mbuf_capacity: message-buffer slots.
        channels: per lane, the channels it sends on.
        keeps: per lane, whether it keeps a message on the device.
        phases: ``(first tick, end tick, lanes compiled)`` of each phase.
        full: per phase, the lanes busy on every device at every tick.
        direct: every B reads the residuals of the F run earlier in its own tick: no stash.
        front_capacity: a split backward's frontier slots (B to W), on every device.
        shared: the channels whose lanes' messages share one ``ppermute`` in the tick's exchange (no device
            sends, nor receives, more than one message on them in any tick).
    """

    schedule: Schedule
    placement: str
    lanes: Tuple[str, ...]
    where: Dict[Tuple[str, int, int], Tuple[int, int]]  # (kind, stage, mb) -> (tick, lane)
    table: np.ndarray
    stash_capacity: int
    mbuf_capacity: int
    channels: Tuple[Tuple[int, ...], ...]  # per lane: channels it sends on
    keeps: Tuple[bool, ...]  # per lane: does it keep a message on-device
    phases: Tuple[Tuple[int, int, Tuple[int, ...]], ...]  # (first tick, end tick, lanes compiled)
    full: Tuple[Tuple[int, ...], ...] = ()  # per phase: lanes busy on every device, every tick
    direct: bool = False  # every B reads the residuals of the F run earlier in its own tick: no stash
    front_capacity: int = 0  # a split backward's frontier slots (B to W), on every device
    #: channels on which no device sends, nor receives, more than one message in any tick: the lanes' messages
    #: on such a channel share one ``ppermute`` in the tick's exchange (the ordered placement: one action a
    #: tick)
    shared: Tuple[int, ...] = ()

    @property
    def num_ticks(self) -> int:
        return self.table.shape[0]

    def op_times(self, f: float = 1.0, b: float = 2.0, w: float = 0.0) -> np.ndarray:
        """The duration of each placed action.

        Args:
            f: a forward's duration.
            b: a backward's duration.
            w: a weight gradient's duration.

        Returns:
            ``float[tick, device, lane]``, 0 where the device is idle.
        """
        dur = np.array([{F: f, B: b, W: w}[kind_of(k)] for k in self.lanes])
        return (self.table[..., L["op"]] > 0) * dur[None, None, :]

    def lockstep_makespan(self, f: float = 1.0, b: float = 2.0, w: float = 0.0) -> float:
        """The plan's step: the sum over ticks of the slowest device's own actions in the tick.

        A device runs its lanes one after the other and the tick's messages move in one exchange at its end,
        so nothing waits for a neighbour between lanes (idle lanes cost nothing).

        Args:
            f: a forward's duration.
            b: a backward's duration.
            w: a weight gradient's duration.

        Returns:
            The step, in the durations' unit.
        """
        return float(self.op_times(f, b, w).sum(axis=2).max(axis=1).sum())

    def peak_inflight(self) -> List[int]:
        """Per device, the most micro-batch stage activations held at once (F until its last B/W read)."""
        nl = len(self.lanes)
        last = W if self.schedule.has_w() else B
        out = []
        for d in range(self.schedule.D):
            ev = []
            for (k, st, m), (t, li) in self.where.items():
                if k == F and self._dev[(k, st, m)] == d:
                    ev.append((t * nl + li, 1))
                    tr, lr = self.where[(last, st, m)]
                    ev.append((tr * nl + lr + 0.5, -1))
            held = peak = 0
            for _, v in sorted(ev):
                held += v
                peak = max(peak, held)
            out.append(peak)
        return out

    def grid(self) -> List[List[List[Optional[Action]]]]:
        """``grid[tick][device][lane]``: the action there or None (for pictures)."""
        acts = {(a.kind, a.stage, a.mb): a for acts in self.schedule.actions for a in acts}
        g = [[[None] * len(self.lanes) for _ in range(self.schedule.D)] for _ in range(self.num_ticks)]
        for key, (t, li) in self.where.items():
            g[t][self._dev[key]][li] = acts[key]
        return g


def lane_kinds(s: Schedule, placement: str = "lanes") -> Tuple[str, ...]:
    """The lanes of a tick.  A second forward lane only for the ordered placement of paired forwards:
    with lanes the F lane already overlaps forwards with backwards, and pairing forwards there would only
    let the F lane run ahead and hold O(N) activations; ``"ordered2"``: two rounds of lanes."""
    if placement == "ordered2":
        return (F, B) + ((W,) if s.has_w() else ()) + (F_, B_) + ((W_,) if s.has_w() else ())
    pairs = s.has_pairs() and placement == "ordered"
    return (F,) + ((F2,) if pairs else ()) + (B,) + ((W,) if s.has_w() else ())


def _place_lanes(s: Schedule, lanes: Sequence[str], dev) -> Dict[tuple, Tuple[int, int]]:
    """Every lane takes its kind's actions in the device's order, each as soon as its inputs are there."""
    li_of = {k: i for i, k in enumerate(lanes)}
    queues = [{k: [] for k in lanes} for _ in range(s.D)]
    for d, acts in enumerate(s.actions):
        for a in acts:
            queues[d][a.kind].append([a])
    where: Dict[tuple, Tuple[int, int]] = {}
    remaining = sum(len(q) for qs in queues for q in qs.values())
    limit = 4 * (remaining + s.D) + 8
    t = 0
    while remaining:
        for d in range(s.D):
            for kind in lanes:
                q = queues[d].get(kind)
                if not q:
                    continue
                li = li_of[kind]
                # the first ready group among the heads of each chunk's queue, in the schedule's order (a
                # chunk stuck on its input does not hold back another chunk's ready action; Chimera §3.5's
                # list scheduling does the same)
                seen = set()
                for gi, grp in enumerate(q):
                    if grp[0].chunk in seen:
                        continue
                    seen.add(grp[0].chunk)
                    if _ready(s, grp, where, dev, d, t, li):
                        q.pop(gi)
                        remaining -= 1
                        for j, a in enumerate(grp):
                            where[(a.kind, a.stage, a.mb)] = (t, li if j == 0 else li_of[F2])
                        break
        t += 1
        if t > limit:
            raise ScheduleError(
                f"{s.name}: lane placement stalled at tick {t}; the schedule's per-kind orders deadlock"
            )
    return where


def _ready(s: Schedule, grp, where, dev, d: int, t: int, li: int) -> bool:
    for a in grp:
        for dep in s.deps(a):
            if dep not in where:
                return False
            td, ld = where[dep]
            if not (td < t or (dev[dep] == d and td == t and ld < li)):
                return False
    return True


def _place_ordered(s: Schedule, lanes: Sequence[str]) -> Dict[tuple, Tuple[int, int]]:
    li_of = {k: i for i, k in enumerate(lanes)}
    ticks = s.ticks()
    where = {}
    for acts in s.actions:
        for a in acts:
            key = (a.kind, a.stage, a.mb)
            where[key] = (ticks[key], li_of[F2 if a.pair else a.kind])
    return where


def _link(D: int, src: int, dst: int) -> int:
    """The channel a message from device ``src`` to ``dst`` moves on (at D = 2 both neighbours are one: the
    messages share the ``+1`` channel); -1 where they are no neighbours."""
    ch = _channel(D, src, dst)
    return SEND_PLUS if ch == SEND_MINUS and D == 2 else ch


def _sends(s: Schedule, key, dev) -> int:
    """The channel the message of action ``key`` leaves on (SEND_NONE where it sends none)."""
    k, st, m = key
    dst = (
        (F, st + 1, m)
        if k == F and st < s.num_model_stages - 1
        else (B, st - 1, m)
        if k == B and st > 0
        else None
    )
    if dst is None or dev[dst] == dev[key]:
        return SEND_NONE
    return _link(s.D, dev[key], dev[dst])


def _lane_after(lanes, kind: str, after: int) -> Optional[int]:
    """The first lane of ``kind`` (not a paired F2) after lane ``after``, or None."""
    for li in range(after + 1, len(lanes)):
        if lanes[li] != F2 and kind_of(lanes[li]) == kind:
            return li
    return None


def _joins(s: Schedule, group: dict, acts, lanes, dev) -> Optional[Dict[tuple, int]]:
    """The lanes the actions ``acts`` of the next ordered tick take in the tick being built (``group``: key
    -> lane of the actions placed in it), or None where they cannot join it: a device's actions keep their
    order (each in a later lane than the device's actions before it: a swap would let an F take a stash slot
    before a B frees one), it sends at most one message per channel in a tick, and no action reads a message
    sent in the tick (it moves only at the tick's end)."""
    out = {}
    for a in acts:
        key, d = (a.kind, a.stage, a.mb), dev[(a.kind, a.stage, a.mb)]
        mine = [k for k in group if dev[k] == d]
        li = _lane_after(lanes, a.kind, max((group[k] for k in mine), default=-1))
        if li is None:  # lane order is the device's order: no swap
            return None
        ch = _sends(s, key, dev)
        if ch != SEND_NONE and any(_sends(s, k, dev) == ch for k in mine):
            return None
        for dep in s.deps(a) + (
            [(B, a.stage + 1, a.mb)] if a.kind == W and a.stage < s.num_model_stages - 1 else []
        ):
            if dep in group and (dev[dep] != d or group[dep] >= li):
                return None
        out[key] = li
    return out


def _fuse_ticks(s: Schedule, where, lanes, dev) -> Dict[tuple, Tuple[int, int]]:
    """The ordered placement with consecutive ticks run as one wherever no message has to move between them
    (a tick ends in one exchange, and on a real link each exchange costs a rendezvous -- ZB-H1 at
    D = 2, M = 4: 13 ticks become 10, 1F1B's lanes have 6); with two lanes of each kind
    (``"ordered2"``) a device may run two actions of a kind in a fused tick.  Every device runs its actions
    in the order the ordered placement gave them, so the result, the slots and the memory are the ordered
    plan's, and a fused tick costs no more than its parts; a no-flush schedule (its own periodic ticks) and
    paired forwards are left as they are; ticks searched for op costs (:mod:`.zb_costed`) are fused like the
    unit-time order's."""
    periodic = getattr(s, "fixed_ticks", None) is not None and not s.options.get("costs")
    if periodic or s.has_pairs():
        return where
    acts = {(a.kind, a.stage, a.mb): a for acts_ in s.actions for a in acts_}
    by_tick: Dict[int, list] = {}
    for key, (t, _) in where.items():
        by_tick.setdefault(t, []).append(acts[key])
    out, group, tick = {}, {}, -1
    for t in sorted(by_tick):
        joined = _joins(s, group, by_tick[t], lanes, dev) if group else None
        if joined is None:
            group, tick = {}, tick + 1
            joined = _joins(s, group, by_tick[t], lanes, dev)
        for key, li in joined.items():
            group[key] = li
            out[key] = (tick, li)
    return out


def _phases(active: np.ndarray):
    """Cut ticks into runs with the same set of used lanes; merge the shortest runs until at most
    :data:`MAX_PHASES` remain (compile time must not grow with the number of micro-batches).  Returns the
    phases ``(t0, t1, used lanes)`` and, per phase, its *full* lanes (busy on every device in every tick:
    at D = 1 the executor runs those without a conditional)."""
    T = active.shape[0]
    used = [set(int(i) for i in np.nonzero(active[t].any(axis=0))[0]) for t in range(T)]
    full = [set(int(i) for i in np.nonzero(active[t].all(axis=0))[0]) for t in range(T)]
    runs: List[list] = []
    for t in range(T):
        if runs and runs[-1][2] == used[t]:
            runs[-1][1] = t + 1
            runs[-1][3] &= full[t]
        else:
            runs.append([t, t + 1, used[t], full[t]])
    while len(runs) > MAX_PHASES:
        i = min(range(len(runs)), key=lambda k: runs[k][1] - runs[k][0])
        j = (
            i - 1
            if i == len(runs) - 1
            or (i > 0 and runs[i - 1][1] - runs[i - 1][0] <= runs[i + 1][1] - runs[i + 1][0])
            else i + 1
        )
        a, b = sorted((i, j))
        runs[a] = [runs[a][0], runs[b][1], runs[a][2] | runs[b][2], runs[a][3] & runs[b][3]]
        del runs[b]
    return (tuple((a, b, tuple(sorted(u))) for a, b, u, _ in runs), tuple(tuple(sorted(f)) for *_, f in runs))


def _route_messages(s: Schedule, where, dev, tab, pos, nl: int, split: bool):
    """Every message's slots in ``tab`` (in place): F(st-1) -> F(st); B(st+1) -> B(st) (and W(st)); the last
    stage's F -> its B (dL/dy).  Returns the channels each lane sends on, whether it keeps a message on the
    device, and the message buffer's capacity."""
    D, S = s.D, s.num_model_stages
    msgs = []
    for st in range(S):
        for m in range(s.M):
            if st > 0:
                msgs.append(((F, st - 1, m), [(F, st, m)]))
            src = (B, st + 1, m) if st < S - 1 else (F, st, m)
            msgs.append((src, [(B, st, m)] + ([(W, st, m)] if split else [])))
    alloc = [_Slots() for _ in range(D)]
    channels = [set() for _ in range(nl)]
    keeps = [False] * nl
    for src, users in sorted(msgs, key=lambda x: pos(x[0])):
        ts, ls = where[src]
        a, b = dev[src], dev[users[0]]
        for u in users:
            if pos(u) <= pos(src) or (dev[u] != a and where[u][0] <= ts):
                raise ScheduleError(
                    f"{s.name}: {u} placed at {where[u]} before its input {src} at {(ts, ls)}"
                )
        ch = _link(D, a, b)
        if ch < 0:
            raise ScheduleError(
                f"{s.name}: a message from device {a} to device {b}; the executor moves messages "
                f"to a neighbouring device (d +- 1 mod {D}) only"
            )
        slot = alloc[b].alloc(pos(src), max(pos(u) for u in users))
        tab[ts, a, ls, L["send"]] = ch
        if ch == SEND_KEEP:
            tab[ts, a, ls, L["keep"]] = slot
            keeps[ls] = True
        else:
            col = L["recv_p" if ch == SEND_PLUS else "recv_m"]
            if tab[ts, b, ls, col] != -1:
                raise ScheduleError(f"{s.name}: two messages reach device {b} on one channel at tick {ts}")
            tab[ts, b, ls, col] = slot
            channels[ls].add(ch)
        for u in users:
            tab[where[u][0], dev[u], where[u][1], L["in"]] = slot
    return channels, keeps, max(len(x.busy_until) for x in alloc)


def _held_slots(D: int, where, dev, tab, pos, writer: str, readers, column: str) -> int:
    """Slots in ``column`` of ``tab`` (in place) for what ``writer`` writes and ``readers`` read of the same
    stage and micro-batch, each held from its write to its last read (a slot is free for a write once every
    read of its previous content came earlier).  The stash: F to B (and W); a split backward's frontier: B to
    W, in slots of its own -- ZB-H1's W follows its B within a tick or two, so at D = 4 one slot where the
    stash needs 2D - 1 (in the stash's slots the frontier was 2.7 GB a device on GPT d1024).
    Returns the capacity (the most slots a device uses)."""
    alloc = [_Slots() for _ in range(D)]
    for key in sorted((k for k in where if k[0] == writer), key=pos):
        _, st, m = key
        d = dev[key]
        slot = alloc[d].alloc(pos(key) - 1, max(pos((r, st, m)) for r in readers))
        for k in [key] + [(r, st, m) for r in readers]:
            tab[where[k][0], d, where[k][1], L[column]] = slot
    return max((len(a.busy_until) for a in alloc), default=0)


def _shared_channels(tab, channels, cap_m: int) -> Tuple[int, ...]:
    """The channels several lanes send on where, in every tick, each device sends at most one message on
    the channel and receives at most one (:attr:`LanePlan.shared`)."""
    out = []
    for ch in sorted(set().union(*channels)):
        lanes = [li for li, c in enumerate(channels) if ch in c]
        if len(lanes) < 2:
            continue
        sends = (tab[:, :, lanes, L["send"]] == ch).sum(axis=2)
        recv = tab[:, :, lanes, L["recv_p" if ch == SEND_PLUS else "recv_m"]]
        if sends.max() <= 1 and ((recv >= 0) & (recv != cap_m)).sum(axis=2).max() <= 1:
            out.append(ch)
    return tuple(out)


def _hands_over(lanes, where) -> bool:
    """Whether the F lane may hand its residuals straight to the B lane of the same tick: every B runs in
    the tick of its F (one stage per device, one chunk: ``D = 1``), and nothing else (a W, a paired F2)
    reads residuals.  Every tick then runs an F and a B on the one device, so both lanes run without a
    conditional (no idle F has to make residuals up).  The executor keeps no stash at all (at D = 1
    the stash's fill and its slot traffic were most of the bytes the pipelined step moved beyond the plain
    one)."""
    if tuple(lanes) != (F, B):
        return False
    return all(where[(F, st, m)][0] == t for (k, st, m), (t, _) in where.items() if k == B)


def unit_costs(s: Schedule) -> Tuple[float, float, float]:
    """``(f, b, w)`` in units of one stage's forward: a backward costs two (split: one for its input part B,
    one for its weight part W), as the papers count."""
    return (1.0, 1.0, 1.0) if s.has_w() else (1.0, 2.0, 0.0)


def check_costs(costs, label: str = "costs") -> Tuple[float, ...]:
    """``(f, b, w)`` or ``(f, b, w, exchange)`` as floats -- one stage's forward, its backward's input part,
    its weight part and a tick's exchange, in any one unit -- or a ScheduleError that says what they are
    (``label``: how the caller's user wrote them, e.g. ``"op_costs"``)."""
    try:
        vals = tuple(float(c) for c in costs)
    except (TypeError, ValueError):
        vals = ()
    if len(vals) not in (3, 4):
        raise ScheduleError(
            f"{label}={costs!r}: give (f, b, w), one stage's forward, its backward's input part and "
            f"its weight part, e.g. (10.0, 10.0, 16.0) in ms, and optionally a tick's exchange as "
            f"a fourth"
        )
    if not (vals[0] > 0 and vals[1] > 0 and min(vals[2:]) >= 0 and np.isfinite(vals).all()):
        raise ScheduleError(
            f"{label}={costs!r}: f and b must be positive, w and the exchange at least 0 (finite)"
        )
    return vals


def lockstep_step(s: Schedule, placement: str, costs: Sequence[float]) -> float:
    """The lockstep step of ``s``'s ``placement`` plan at ``costs`` ``(f, b, w[, exchange])``: the sum over
    ticks of the slowest device's actions (a whole backward costs b + w), plus one exchange a tick."""
    f, b, w, *rest = costs
    plan = s.plan(placement)
    ops = (f, b, w) if s.has_w() else (f, b + w, 0.0)
    return plan.lockstep_makespan(*ops) + (rest[0] if rest else 0.0) * plan.num_ticks


def fastest_placement(s: Schedule, costs: Optional[Sequence[float]] = None) -> str:
    """The placement whose plan has the smaller lockstep step (``Pipeline``'s ``placement="auto"``) at
    ``costs`` -- ``(f, b, w)``: one stage's forward, its backward's input part and its weight part, in any one
    unit (measured: ``Pipeline(op_costs=...)``), and optionally a fourth, the cost of a tick's exchange (each
    tick of a plan pays one) -- or at :func:`unit_costs`.  At unit costs the zero-bubble and V schedules' own
    one-action-per-tick order reaches their bubble now that a tick ends in one exchange, and 1F1B's F and B
    lanes stay the faster for it; where W costs more than F the ordered plan can lose (a tick lasts as long as
    its slowest device, and the ordered steady state puts one device's W beside another's F: ZB-H1 at D = 2,
    M = 8 and costs (10, 10, 16) is 1.05x 1F1B's lanes, its own lanes 1.00x).  A tie goes to the plan with
    fewer stash slots (Chimera: ordered; GPipe: lanes, whose order holds D, not M).  ``"ordered2"`` is not
    weighed: its second round of lanes costs the executor more than the lockstep step prices (on the
    two-process testbed ZB-H1 ran 2-6% slower in it than ordered, ZB-V even, DualPipeV at M = 8 4-8%
    faster); a user who measures a gain asks for it."""
    if s.has_pairs() and not s.options.get("double_batch"):
        # Chimera's forward doubling: the ordered plan pairs forwards, and the executor runs a pair as one
        # double-size forward (``double_batch``), which a context model cannot; asked for, it is ordered
        return "lanes"
    costs = unit_costs(s) if costs is None else check_costs(costs)
    key = {
        p: (round(lockstep_step(s, p, costs), 9), s.plan(p).stash_capacity, p) for p in ("ordered", "lanes")
    }
    return min(key, key=key.get)


def plan(s: Schedule, placement: str = "lanes", cut: Sequence[int] = ()) -> LanePlan:
    """Place ``s`` on lanes and build the executor's tables.  ``cut``: ticks where a phase must begin
    (Chimera's eager reduction runs between two phases).  ``placement="auto"``: :func:`fastest_placement`."""
    if placement not in PLACEMENTS:
        raise ScheduleError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement == "auto":
        placement = fastest_placement(s)
    if placement == "ordered2" and s.has_pairs():
        raise ScheduleError(
            f"{s.name}: placement='ordered2' fuses the ordered plan's ticks, which pairs forwards here "
            f"(Chimera's forward doubling); use placement='ordered' or 'lanes'"
        )
    lanes = lane_kinds(s, placement)
    loc = s.location()
    dev = {k: v[0] for k, v in loc.items()}
    if placement == "lanes":
        where = _place_lanes(s, lanes, dev)
    else:
        where = _fuse_ticks(s, _place_ordered(s, lanes), lanes, dev)
    nl, D, S = len(lanes), s.D, s.num_model_stages
    T = 1 + max(t for t, _ in where.values())
    pos = lambda key: where[key][0] * nl + where[key][1]
    tab = np.full((T, D, nl, len(LCOLS)), -1, np.int64)
    tab[..., L["op"]] = 0
    tab[..., L["send"]] = SEND_NONE
    acts = {(a.kind, a.stage, a.mb): a for acts_ in s.actions for a in acts_}
    for key, (t, li) in where.items():
        a = acts[key]
        row = tab[t, dev[key], li]
        row[L["op"]], row[L["mb"]], row[L["stage"]], row[L["chunk"]] = 1, a.mb, a.stage, a.chunk
    split = s.has_w()
    cap_s = _held_slots(D, where, dev, tab, pos, F, (B, W) if split else (B,), "stash")
    cap_f = _held_slots(D, where, dev, tab, pos, B, (W,), "front") if split else 0
    channels, keeps, cap_m = _route_messages(s, where, dev, tab, pos, nl, split)
    for c in ("keep", "recv_p", "recv_m"):
        tab[..., L[c]][tab[..., L[c]] < 0] = cap_m  # the scratch slot
    for c in ("mb", "stage", "chunk", "stash", "in", "front"):
        tab[..., L[c]][tab[..., L[c]] < 0] = 0
    first = (tab[..., L["stage"]] == 0).astype(np.int64)
    last = (tab[..., L["stage"]] == S - 1).astype(np.int64)
    tab[..., L["branch"]] = np.where(
        tab[..., L["op"]] > 0, 1 + tab[..., L["chunk"]] * 4 + first + 2 * last, 0
    )
    active = tab[..., L["op"]] > 0
    phases, full = map(list, _phases(active))
    for c in sorted(set(cut)):
        for i, (a0, b0, u) in enumerate(phases):
            if a0 < c < b0:
                phases[i : i + 1] = [(a0, c, u), (c, b0, u)]
                full[i : i + 1] = [full[i], full[i]]
                break
    out = LanePlan(
        s,
        placement,
        lanes,
        where,
        tab.astype(np.int32),
        cap_s,
        cap_m,
        tuple(tuple(sorted(c)) for c in channels),
        tuple(keeps),
        tuple(phases),
        tuple(full),
        _hands_over(lanes, where),
        cap_f,
        _shared_channels(tab, channels, cap_m),
    )
    out._dev = dev
    return out
