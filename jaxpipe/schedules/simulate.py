"""Cost model of a schedule: event-driven (MPMD) and lockstep (what the SPMD executor pays).

Event-driven: every action starts as soon as its device is free and its inputs exist (the papers' figures).
Lockstep: the executor runs one action per device per tick and a tick lasts as long as the slowest action in
it, so a tick mixing an F and a B costs max(f, b).  Bubble ratio = 1 - useful work / (devices x makespan),
the definition of Chimera §2.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple, List, Optional

from .ir import Action, B, F, W, Schedule


@dataclasses.dataclass
class SimReport:
    """What :func:`simulate` finds: the event-driven and the lockstep step, the bubbles, the memory held.

    Attributes:
        schedule: the schedule's name.
        num_devices: pipeline devices.
        num_microbatches: micro-batches a step.
        f: a forward's duration.
        b: the whole backward's duration (a split one: B + W).
        w: a split backward's weight-gradient part W (0: not split).
        makespan: the event-driven step (every action as soon as its inputs are ready).
        bubble_ratio: the event-driven step's idle share.
        lockstep_makespan: the SPMD executor's step with one op per tick: the sum over ticks of the slowest
            op.
        lockstep_bubble_ratio: its idle share.
        num_ticks: lockstep ticks.
        peak_inflight: per device, micro-batches of one stage's activations held at once.
        weight_versions: per device, weight versions held, in units of one stage's weights.
        stash_capacity: stash slots of the one-op-per-tick ("ordered") plan, on every device.
        messages: point-to-point activation and gradient messages a step.
        lane_makespan: the step of the plan the executor runs (its default placement), a tick as long as its
            slowest device's actions.
        lane_bubble_ratio: its idle share.
        lane_ticks: its ticks.
        lane_peak_inflight: its micro-batches in flight per device.
        lane_stash_capacity: its stash slots.
        lane_placement: the placement it uses (``"ordered"`` for the periodic no-flush schedules).
    """

    schedule: str
    num_devices: int
    num_microbatches: int
    f: float
    b: float  # the whole backward (a split one: B + W)
    w: float  # a split backward's weight-gradient part W (0: not split)
    makespan: float  # event-driven
    bubble_ratio: float  # event-driven
    lockstep_makespan: float  # SPMD executor: sum over ticks of the slowest op
    lockstep_bubble_ratio: float
    num_ticks: int
    peak_inflight: List[int]  # per device, micro-batches of one stage's activations held at once
    weight_versions: List[int]  # per device, in units of one stage's weights
    stash_capacity: int  # stash slots of the one-op-per-tick ("ordered") plan, on every device
    messages: int  # point-to-point activation/gradient messages per step
    # what the executor runs with its default placement ("auto": jaxpipe.schedules.lanes.fastest_placement),
    # a tick as long as its slowest device's actions (one exchange at its end); the memory it holds
    lane_makespan: float = 0.0
    lane_bubble_ratio: float = 0.0
    lane_ticks: int = 0
    lane_peak_inflight: Optional[List[int]] = None
    lane_stash_capacity: int = 0
    lane_placement: str = (
        "lanes"  # "ordered" for the periodic no-flush schedules: one op per tick is what runs
    )

    def summary(self) -> str:
        return (
            f"{self.schedule}: D={self.num_devices} M={self.num_microbatches} f={self.f:g} b={self.b:g}"
            f"{'' if not self.w else f' (B {self.b - self.w:g} + W {self.w:g})'} | event-driven makespan "
            f"{self.makespan:g}, bubble "
            f"{self.bubble_ratio:.3f} | lockstep {self.num_ticks} ticks, makespan {self.lockstep_makespan:g},"
            f" bubble {self.lockstep_bubble_ratio:.3f} | peak in-flight {self.peak_inflight} | weight "
            f"versions {self.weight_versions} | executor ({self.lane_placement}): {self.lane_ticks} ticks, "
            "makespan "
            f"{self.lane_makespan:g}, bubble {self.lane_bubble_ratio:.3f}, peak in-flight "
            f"{self.lane_peak_inflight}"
        )


def inflight_profile(s: Schedule, device: int) -> List[int]:
    """Micro-batch activations held on ``device`` after each of its actions (order only, not timing)."""
    release = W if s.has_w() else B
    held, out = 0, []
    for a in s.actions[device]:
        if a.kind == F:
            held += 1
        elif a.kind == release:
            held -= 1
        out.append(held)
    return out


def split_backward(s: Schedule, b: float, w: Optional[float] = None) -> Tuple[float, float]:
    """``(B, W)``: the durations of a stage's backward ``b`` (the whole backward, as for every schedule) as
    ``s`` runs it -- one B of ``b`` (``W = 0``) or, for a split backward (zero-bubble, the V schedules), an
    input-gradient part B of ``b - w`` and a weight-gradient part W of ``w`` (default ``b / 2``, the papers'
    count).  One convention for every schedule, so a split schedule is never drawn with more backward work
    than 1F1B's (Zero Bubble Pipeline Parallelism, §2: B and W share the backward)."""
    b = float(b)
    if not s.has_w():
        return b, 0.0
    w = b / 2 if w is None else float(w)
    if not 0.0 <= w <= b:
        raise ValueError(
            f"w={w:g} is the weight-gradient part of the whole backward b={b:g}: give 0 <= w <= b "
            f"(B, the input-gradient part, then runs b - w)"
        )
    return b - w, w


def simulate(s: Schedule, f: float = 1.0, b: float = 2.0, w: Optional[float] = None) -> SimReport:
    """Simulate a schedule: its event-driven and lockstep steps, bubbles and the memory it holds.

    Args:
        s: the schedule.
        f: a forward's duration, per stage and micro-batch.
        b: the whole backward's duration, for every schedule; a split backward (zero-bubble) runs it as B and
            W.
        w: the weight-gradient part of a split backward (default ``b / 2``; :func:`split_backward`).

    Returns:
        A :class:`SimReport`.
    """
    has_w = s.has_w()
    whole = float(b)
    b, w = split_backward(s, whole, w)
    dur = {F: float(f), B: float(b), W: w}
    placed = s.place(f, b, w if has_w else 1.0)
    makespan = max(placed["finish"].values())
    work = sum(dur[a.kind] for acts in s.actions for a in acts)
    grid = s.grid()
    lanes = s.lanes() if s.has_pairs() else [[None] * s.D for _ in grid]
    # a tick lasts as long as its slowest device; a device with a paired forward runs both in the tick
    lock = sum(
        max(
            (dur[a.kind] + (dur[F] if p is not None else 0.0) for a, p in zip(row, prow) if a is not None),
            default=0.0,
        )
        for row, prow in zip(grid, lanes)
    )
    loc = placed["device"]
    messages = sum(1 for (k, st, m), d in loc.items() for dep in s.deps(Action(k, m, st)) if loc[dep] != d)
    from .lanes import plan
    from .lanes import fastest_placement

    placement = "ordered" if getattr(s, "fixed_ticks", None) is not None else fastest_placement(s)
    lp = plan(s, placement)
    lane_span = lp.lockstep_makespan(f, b, w)
    return SimReport(
        schedule=s.name,
        num_devices=s.D,
        num_microbatches=s.M,
        f=float(f),
        b=whole,
        w=w,
        makespan=makespan,
        bubble_ratio=1.0 - work / (s.D * makespan),
        lockstep_makespan=lock,
        lockstep_bubble_ratio=1.0 - work / (s.D * lock),
        num_ticks=len(grid),
        peak_inflight=[max(inflight_profile(s, d), default=0) for d in range(s.D)],
        weight_versions=list(s.weight_versions),
        stash_capacity=s.plan("ordered").stash_capacity,
        messages=messages,
        lane_makespan=lane_span,
        lane_bubble_ratio=1.0 - work / (s.D * lane_span),
        lane_ticks=lp.num_ticks,
        lane_peak_inflight=lp.peak_inflight(),
        lane_stash_capacity=lp.stash_capacity,
        lane_placement=placement,
    )
