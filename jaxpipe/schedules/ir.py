"""Schedule IR: a pipeline schedule as plain data (no JAX here).

A schedule is, for every device, the ordered list of actions it runs (like torch.distributed.pipelining's
per-rank action lists).  An action is ``F`` (forward of one micro-batch through one model stage), ``B``
(backward of it) or ``W`` (weight-gradient only, for zero-bubble schedules).  From the per-device orders
and the data dependencies between actions the IR derives everything else:

* ``place(durations)``  -- start/finish of every action when each runs as soon as its inputs are there
  (event-driven, what an MPMD runtime pays); with unit durations this is the *tick* of every action, the
  lockstep timeline the SPMD executor runs (one action per device per tick, messages arrive next tick);
* ``validate()``         -- dependencies satisfiable, one action per device per tick, every (stage,
  micro-batch) computed exactly once, slots never collide;
* ``plan(placement)``    -- the lowered table the executor runs (:mod:`.lanes`: per tick, device and lane,
  the op, its micro-batch, stash slot and message slots);
* ``simulate()`` / ``render*()`` live in :mod:`.simulate` and :mod:`.render` and use the same object, so what
  you see is what runs.

Dependencies (docs/design.md §1): F(s, m) after F(s-1, m); B(s, m) after F(s, m) and after B(s+1, m);
W(s, m) after B(s, m).  Messages between different devices cost one tick in lockstep (``ppermute`` at the
end of a tick); in the event-driven placement they are free (the papers' figures ignore communication).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ConfigError

F, B, W = "F", "B", "W"
KINDS = (F, B, W)
#: a second lane of each kind, run after the first round of lanes in the same tick (the ``"ordered2"``
#: placement: a device runs up to two actions of a kind a tick, e.g. both chunks' forwards of a V)
F_, B_, W_ = "F'", "B'", "W'"


def kind_of(lane: str) -> str:
    """The action kind a lane runs: ``"F"`` for the lanes F, F' and F2, ``"B"`` for B and B', ``"W"`` for W
    and W'."""
    return lane[0]


class ScheduleError(ConfigError):
    """A schedule that cannot run: broken dependency, deadlock, colliding slots, options that do not fit (a
    :class:`~jaxpipe.errors.ConfigError`, as every configuration error)."""


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work on one device.

    Attributes:
        kind: ``"F"`` (forward), ``"B"`` (backward; a split backward's input gradient) or ``"W"`` (a split
            backward's weight gradient).
        mb: the micro-batch index.
        stage: the model stage it computes (0 .. num_model_stages - 1).
        chunk: which of the device's local model chunks holds that stage (0 for GPipe and 1F1B; interleaved
            and bidirectional pipelines use more).
        pair: a forward that runs in the same tick as the forward before it (Chimera, section 3.5).
    """

    kind: str
    mb: int
    stage: int
    chunk: int = 0
    pair: bool = False  # a forward that runs in the same tick as the forward before it (Chimera §3.5)

    def __str__(self) -> str:
        return ("+" if self.pair else "") + f"{self.kind}{self.mb}" + (f"s{self.stage}" if self.chunk else "")


Key = Tuple[str, int, int]  # (kind, stage, mb)


@dataclasses.dataclass
class Schedule:
    """Per-device action lists plus the facts needed to run and cost them.

    Built by :func:`jaxpipe.schedules.build` and validated (:meth:`validate`); ``Pipeline`` runs its lane plan
    (:meth:`plan`).

    Attributes:
        name: the method's name (``"1f1b"``, ...).
        num_devices: pipeline devices (``D``).
        num_microbatches: micro-batches a step (``M``).
        actions: per device, its actions in the order it runs them.
        num_model_stages: model stages (default ``num_devices``; more where a device holds several chunks).
        weight_versions: per device, the weight versions it holds, in units of one stage's weights.
        options: the builder options it was built with.
    """

    name: str
    num_devices: int
    num_microbatches: int
    actions: List[List[Action]]
    num_model_stages: Optional[int] = None
    weight_versions: Optional[Sequence[int]] = None  # per device, in units of one stage's weights
    options: dict = dataclasses.field(default_factory=dict)  # the builder options it was built with

    def __post_init__(self):
        if self.num_model_stages is None:
            self.num_model_stages = self.num_devices
        if self.weight_versions is None:
            self.weight_versions = [1] * self.num_devices
        self._placed: Dict[Tuple[float, float, float], dict] = {}

    # ------------------------------------------------------------------ structure
    @property
    def D(self) -> int:
        return self.num_devices

    @property
    def M(self) -> int:
        return self.num_microbatches

    def location(self) -> Dict[Key, Tuple[int, int]]:
        """(kind, stage, mb) -> (device, index in that device's list)."""
        loc = {}
        for d, acts in enumerate(self.actions):
            for i, a in enumerate(acts):
                key = (a.kind, a.stage, a.mb)
                if key in loc:
                    raise ScheduleError(
                        f"{self.name}: {a.kind}{a.mb} of stage {a.stage} appears twice "
                        f"(devices {loc[key][0]} and {d})"
                    )
                loc[key] = (d, i)
        return loc

    def has_w(self) -> bool:
        return any(a.kind == W for acts in self.actions for a in acts)

    def deps(self, a: Action) -> List[Key]:
        """What an action waits for.

        Args:
            a: the action.

        Returns:
            The ``(kind, stage, micro-batch)`` keys it depends on: a forward on the previous stage's forward,
            a backward on its own forward and the next stage's backward, a weight gradient on its backward.
        """
        S = self.num_model_stages
        if a.kind == F:
            return [(F, a.stage - 1, a.mb)] if a.stage > 0 else []
        if a.kind == B:
            d = [(F, a.stage, a.mb)]
            if a.stage < S - 1:
                d.append((B, a.stage + 1, a.mb))
            return d
        return [(B, a.stage, a.mb)]

    # ------------------------------------------------------------------ placement
    def place(self, f: float = 1.0, b: float = 1.0, w: float = 1.0, comm: float = 0.0) -> dict:
        """As-soon-as-possible start and finish of every action, each device's order kept (event-driven).

        With ``f = b = w = 1`` and ``comm = 0`` the start times are the lockstep ticks.

        Args:
            f: a forward's duration.
            b: a backward's duration.
            w: a weight gradient's duration.
            comm: what a message between two devices adds.

        Returns:
            ``{"start": {key: t}, "finish": {key: t}, "device": {key: d}}`` over ``(kind, stage, mb)`` keys.
        """
        cache_key = (f, b, w, comm)
        if cache_key in self._placed:
            return self._placed[cache_key]
        dur = {F: f, B: b, W: w}
        loc = self.location()
        start: Dict[Key, float] = {}
        finish: Dict[Key, float] = {}
        nxt = [0] * self.D
        free = [0.0] * self.D
        remaining = sum(len(a) for a in self.actions)
        while remaining:
            progressed = False
            for d in range(self.D):
                while nxt[d] < len(self.actions[d]):
                    a = self.actions[d][nxt[d]]
                    ready = free[d]
                    ok = True
                    for dep in self.deps(a):
                        if dep not in loc:
                            raise ScheduleError(
                                f"{self.name}: {a.kind}{a.mb} on stage {a.stage} needs "
                                f"{dep[0]}{dep[2]} of stage {dep[1]}, which no device runs"
                            )
                        if dep not in finish:
                            ok = False
                            break
                        ready = max(ready, finish[dep] + (comm if loc[dep][0] != d else 0.0))
                    if not ok:
                        break
                    key = (a.kind, a.stage, a.mb)
                    start[key], finish[key] = ready, ready + dur[a.kind]
                    free[d] = finish[key]
                    nxt[d] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = {
                    d: str(self.actions[d][nxt[d]]) for d in range(self.D) if nxt[d] < len(self.actions[d])
                }
                raise ScheduleError(f"{self.name}: deadlock, each device waits on another: {stuck}")
        out = {"start": start, "finish": finish, "device": {k: v[0] for k, v in loc.items()}}
        self._placed[cache_key] = out
        return out

    def has_pairs(self) -> bool:
        return any(a.pair for acts in self.actions for a in acts)

    def ticks(self) -> Dict[Key, int]:
        """Lockstep tick of every action: unit-time ops, a message to another device arrives one tick
        later (it is sent by the ppermute that ends the tick).  A paired forward shares the tick of the
        forward before it (the executor's second lane)."""
        if getattr(self, "_ticks", None) is not None:
            return self._ticks
        if getattr(self, "fixed_ticks", None) is not None:  # a periodic (no-flush) schedule's own ticks
            self._ticks = dict(self.fixed_ticks)
            return self._ticks
        if not self.has_pairs():
            p = self.place(1.0, 1.0, 1.0, comm=0.0)
            self._ticks = {k: int(v) for k, v in p["start"].items()}
            return self._ticks
        loc = self.location()
        groups = []
        for d, acts in enumerate(self.actions):
            g = []
            for a in acts:
                if a.pair:
                    if (
                        not g
                        or len(g[-1]) > 1
                        or g[-1][-1].kind != F
                        or a.kind != F
                        or g[-1][-1].stage != a.stage
                    ):
                        raise ScheduleError(
                            f"{self.name}: device {d}: a paired action must be a forward of "
                            f"the same stage following an unpaired forward ({a})"
                        )
                    g[-1].append(a)
                else:
                    g.append([a])
            groups.append(g)
        tick: Dict[Key, int] = {}
        nxt, free = [0] * self.D, [0] * self.D
        remaining = sum(len(g) for g in groups)
        while remaining:
            progressed = False
            for d in range(self.D):
                while nxt[d] < len(groups[d]):
                    grp = groups[d][nxt[d]]
                    ready = free[d]
                    keys = [(a.kind, a.stage, a.mb) for a in grp]
                    ok = True
                    for a in grp:
                        for dep in self.deps(a):
                            if dep not in loc:
                                raise ScheduleError(f"{self.name}: {a} needs {dep}, which no device runs")
                            if dep in keys:
                                continue
                            if dep not in tick:
                                ok = False
                                break
                            ready = max(ready, tick[dep] + 1)
                        if not ok:
                            break
                    if not ok:
                        break
                    for k in keys:
                        tick[k] = ready
                    free[d] = ready + 1
                    nxt[d] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                raise ScheduleError(f"{self.name}: deadlock in the lockstep placement")
        self._ticks = tick
        return tick

    @property
    def num_ticks(self) -> int:
        t = self.ticks()
        return max(t.values()) + 1 if t else 0

    def grid(self) -> List[List[Optional[Action]]]:
        """``grid[tick][device]``: the action run there (the first, where a paired forward shares the
        tick), or None (idle).  :meth:`lanes` gives the paired ones."""
        t = self.ticks()
        g: List[List[Optional[Action]]] = [[None] * self.D for _ in range(self.num_ticks)]
        for d, acts in enumerate(self.actions):
            for a in acts:
                if not a.pair:
                    g[t[(a.kind, a.stage, a.mb)]][d] = a
        return g

    def lanes(self) -> List[List[Optional[Action]]]:
        """``lanes[tick][device]``: the paired forward run in the second lane, or None."""
        t = self.ticks()
        g: List[List[Optional[Action]]] = [[None] * self.D for _ in range(self.num_ticks)]
        for d, acts in enumerate(self.actions):
            for a in acts:
                if a.pair:
                    g[t[(a.kind, a.stage, a.mb)]][d] = a
        return g

    # ------------------------------------------------------------------ validation
    def validate(self) -> "Schedule":
        """Raise :class:`ScheduleError` unless the schedule is complete and runnable."""
        S, M = self.num_model_stages, self.M
        loc = self.location()
        kinds = (F, B, W) if self.has_w() else (F, B)
        for k in kinds:
            for s in range(S):
                for m in range(M):
                    if (k, s, m) not in loc:
                        raise ScheduleError(f"{self.name}: {k}{m} of stage {s} is never run")
        extra = [k for k in loc if not (0 <= k[1] < S and 0 <= k[2] < M)]
        if extra:
            raise ScheduleError(f"{self.name}: actions outside {S} stages x {M} micro-batches: {extra[:5]}")
        for d, acts in enumerate(self.actions):
            chunks = {a.chunk: a.stage for a in acts}
            for a in acts:
                if chunks[a.chunk] != a.stage:
                    raise ScheduleError(f"{self.name}: device {d} chunk {a.chunk} holds two stages")
        t = self.ticks()  # raises on deadlock
        for d, acts in enumerate(self.actions):
            seen = [t[(a.kind, a.stage, a.mb)] for a in acts if not a.pair]
            if len(set(seen)) != len(seen):
                raise ScheduleError(f"{self.name}: device {d} runs two actions in one tick")
        for key in loc:
            a = Action(key[0], key[2], key[1])
            for dep in self.deps(a):
                if t[key] < t[dep] + 1:
                    raise ScheduleError(f"{self.name}: {key} at tick {t[key]} before its input {dep}")
        self.plan("ordered")  # slot allocation must succeed
        return self

    # ------------------------------------------------------------------ the lowered table
    def plan(self, placement: str = "lanes"):
        """The lane plan of this schedule (:func:`jaxpipe.schedules.lanes.plan`): the one lowered table the
        executor runs, the simulator costs and the renderer draws.

        Args:
            placement: ``"ordered"``: one op per device per tick (the schedule's own order); ``"lanes"``: an F
                and a B lane (and W) in every tick; ``"ordered2"``: the ordered order in ticks of two rounds
                of lanes.

        Returns:
            The :class:`~jaxpipe.schedules.LanePlan` (built once, then kept).
        """
        cache = self.__dict__.setdefault("_plans", {})
        if placement not in cache:
            from .lanes import plan

            cache[placement] = plan(self, placement)
        return cache[placement]

    def stage_of_chunk(self) -> np.ndarray:
        """``[device, chunk] -> model stage`` (-1 where unused)."""
        nchunk = 1 + max((a.chunk for acts in self.actions for a in acts), default=0)
        out = -np.ones((self.D, nchunk), np.int32)
        for d, acts in enumerate(self.actions):
            for a in acts:
                out[d, a.chunk] = a.stage
        return out

    def simulate(self, f: float = 1.0, b: float = 2.0, w: Optional[float] = None):
        """Simulate this schedule (:func:`jaxpipe.schedules.simulate`).

        Args:
            f: a forward's duration, per stage and micro-batch.
            b: the whole backward's duration.
            w: a split backward's weight-gradient part (default ``b / 2``).

        Returns:
            A :class:`~jaxpipe.schedules.SimReport`.
        """
        from .simulate import simulate

        return simulate(self, f=f, b=b, w=w)

    def render(self, path: Optional[str] = None, **kw):
        """A PNG timeline, devices as rows (:func:`jaxpipe.schedules.render.render_png`).

        Args:
            path: where to write the PNG (None: not written).
            **kw: ``f``, ``b``, ``w`` (durations), ``mode`` (``"event"``, ``"lockstep"``, ``"lanes"``,
                ``"ordered"`` or ``"ordered2"``) and ``title``.

        Returns:
            The matplotlib figure.
        """
        from .render import render_png

        return render_png(self, path, **kw)

    def render_text(self, **kw) -> str:
        """The lockstep grid as text: one row per device, one column per tick (``F3``: the forward of
        micro-batch 3; ``.``: idle).

        Args:
            **kw: ``width``: the columns' width (default: the widest label plus a space).

        Returns:
            The text, a line per device under a title line.
        """
        from .render import render_text

        return render_text(self, **kw)

    def to_chrome_trace(self, path: Optional[str] = None, **kw) -> dict:
        """The timeline as Chrome / Perfetto trace-event JSON (open in ui.perfetto.dev); one time unit is 1
        ms.

        Args:
            path: where to write the JSON (None: not written).
            **kw: ``f``, ``b``, ``w`` and ``mode``, as for :meth:`render`.

        Returns:
            The trace as a dict.
        """
        from .render import chrome_trace

        return chrome_trace(self, path, **kw)


# ---------------------------------------------------------------------- slots and channels
SEND_NONE, SEND_PLUS, SEND_MINUS, SEND_KEEP = 0, 1, 2, 3


class _Slots:
    """Lowest-free-slot allocator over tick intervals [write_tick, last_read_tick]."""

    def __init__(self):
        self.busy_until: List[int] = []

    def alloc(self, write_tick: int, last_read: int) -> int:
        for i, until in enumerate(self.busy_until):
            if until <= write_tick:  # last read happened at or before this write
                self.busy_until[i] = last_read
                return i
        self.busy_until.append(last_read)
        return len(self.busy_until) - 1


def _channel(D: int, src: int, dst: int) -> int:
    if src == dst:
        return SEND_KEEP
    if dst == (src + 1) % D:
        return SEND_PLUS
    if dst == (src - 1) % D:
        return SEND_MINUS
    return -1
