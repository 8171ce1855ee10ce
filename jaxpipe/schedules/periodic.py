"""Periodic (steady-state) schedules of the no-flush methods, as data (pure Python + NumPy, no JAX).

A method that never flushes runs the same pattern forever: on device ``d`` the op ``kind`` of micro-batch
``i`` (counted from the last (re)start) runs at tick ``period * i + offset[kind][d]``.  The no-flush 1F1B
of PipeDream, PipeDream-2BW, SpecTrain, PipeOptim and CDP's pipeline form (PipeOptim Fig. 1(d)-(e)) is
``period = 2``, ``F`` at ``s``, ``B`` at ``2D - 1 - s``: one op per device per tick, F and B ticks of a
device never collide, and every message is consumed the tick after it is sent.

The executor reads :meth:`Periodic.table` (``[period, D, 2]``: at phase ``t mod period`` device ``d`` runs
``kind`` of the *unit* whose op is due at ``t - offset``); the weight policies take their distances
from :meth:`Periodic.updates_between` (the updates a stage applies between a micro-batch's F and its B);
:meth:`Periodic.expand` gives the finite schedule of ``M`` micro-batches at the ticks that really run, for
pictures and the simulator.  What you see is what runs.

Units and chunks.  A unit is one slot of the stream: its F runs down the devices, its B back up.  In the
1F1B family unit ``i`` is micro-batch ``i`` on the device's only chunk.  A stream may instead carry ``chunks``
model chunks per device (chunk ``c`` of device ``d`` is model stage ``c D + d``; a micro-batch leaving chunk
``c`` on the last device enters chunk ``c + 1`` on device 0, and its gradient the other way) and map each
unit to ``(chunk, F batch offset, B batch offset, micro-batch j)`` (:meth:`Periodic.unit_table`): WPipe's
cross-spliced V units (``jaxpipe.schedules.wpipe.stream``) run G0's forward of batch ``p + 1`` and G0's
backward of batch ``p`` in one unit.  :meth:`Periodic.events` replays the stream; :meth:`Periodic.buffers`
derives from it every capacity the executor allocates (stash slots per chunk, the ring of recent
micro-batches) and :meth:`Periodic.batch_ticks` when a chunk's batch starts and ends (landing points).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np

from .ir import Action, B, F, W, Schedule, ScheduleError, kind_of

F2 = "F2"  # a paired forward's lane (jaxpipe.schedules.lanes.F2)

KIND_CODE = {F: 1, B: 2}


@dataclasses.dataclass(frozen=True)
class Periodic:
    name: str
    num_devices: int
    period: int
    offsets: Dict[str, Tuple[int, ...]]  # kind -> per-device tick offset
    chunks: int = 1  # model chunks per device (stage c D + d on device d)
    #: per unit of a call: (chunk, F batch offset, B batch offset, micro-batch j); None: unit u of a call is
    #: micro-batch u of the call's batch on chunk 0 (a call feeds one batch of M micro-batches)
    units: Optional[Tuple[Tuple[int, int, int, int], ...]] = None
    #: per-unit timing instead of ``period * i + offsets``: kind -> per unit of a call -> per device, the tick
    #: offset from the call's start (a call lasts ``call_length`` ticks; Cyclic DP's worker runs the N stages
    #: of its micro-batch down and back up in one call)
    unit_offsets: Optional[Dict[str, Tuple[Tuple[int, ...], ...]]] = None
    call_length: Optional[int] = None
    #: data-parallel replica r runs the stream ``r * replica_delay`` ticks late (Cyclic DP: workers 2 apart)
    replica_delay: int = 0
    #: per chunk, per device: the model stage it holds (None: ``c D + d``; Chimera's up pipeline mirrors it)
    stages: Optional[Tuple[Tuple[int, ...], ...]] = None
    #: a stream of one call made from a lane plan (:func:`one_call`): the executor routes messages and stashes
    #: residuals in the slots the plan allocated (its ``table``), instead of the stream's own registers
    plan: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def kinds(self) -> Tuple[str, ...]:
        """The lanes of a tick, in order: F, F2 where a stream of one call pairs forwards (Chimera's forward
        doubling), B, and W where it splits the backward (ZB); a stream of one call: its lane plan's lanes
        (F', B', W': a second lane of the kind)."""
        if self.plan is not None:
            return tuple(self.plan.lanes)
        if self.unit_offsets is None:
            return (F, B)
        return tuple(k for k in (F, F2, B, W) if k in self.unit_offsets)

    def runs(self, kind: str, d: int, u: int) -> bool:
        """Whether unit ``u``'s op ``kind`` runs in that lane on device ``d`` (a paired stream's forward runs
        in the F or the F2 lane: offset -1 in the other)."""
        return self.unit_offsets is None or self.unit_offsets[kind][u][d] >= 0

    def stage_table(self) -> np.ndarray:
        """``[chunks, D]``: the model stage chunk ``c`` of device ``d`` holds."""
        if self.stages is not None:
            return np.asarray(self.stages, np.int32)
        D = self.num_devices
        return np.asarray([[c * D + d for d in range(D)] for c in range(self.chunks)], np.int32)

    @property
    def num_stages(self) -> int:
        return int(self.stage_table().max()) + 1

    def tick(self, kind: str, d: int, i: int) -> int:
        if self.unit_offsets is not None:
            U = len(self.unit_offsets[kind])
            return self.call_length * (i // U) + self.unit_offsets[kind][i % U][d]
        return self.period * i + self.offsets[kind][d]

    def validate(self) -> "Periodic":
        """Raise :class:`ScheduleError` unless every dependency holds with one tick per message between
        devices (F(s, i) -> F(s+1, i); F(D-1, i) -> B(D-1, i); B(s+1, i) -> B(s, i)).  F and B of a device may
        share a phase (``two_lanes``): the tick then runs the F lane before the B lane, so the last stage's B
        may run in the tick of its own F.  A stream with per-unit offsets is checked on its replay instead
        (:meth:`validate_stream`)."""
        if self.unit_offsets is not None:
            return self.validate_stream(1)
        D, P = self.num_devices, self.period
        for d in range(D):
            phases = [self.offsets[k][d] % P for k in (F, B)]
            if len(set(phases)) != len(phases) and not self.two_lanes:
                raise ScheduleError(f"{self.name}: device {d} runs F and B in the same phase of the period")
            late = self.tick(B, d, 0) < self.tick(F, d, 0) + (0 if d == D - 1 and self.two_lanes else 1)
            if late:
                raise ScheduleError(
                    f"{self.name}: device {d}'s backward of a micro-batch precedes its forward"
                )
        for d in range(D - 1):
            if self.tick(F, d + 1, 0) < self.tick(F, d, 0) + 1:
                raise ScheduleError(f"{self.name}: F on device {d + 1} before its input from device {d}")
            if self.tick(B, d, 0) < self.tick(B, d + 1, 0) + 1:
                raise ScheduleError(f"{self.name}: B on device {d} before its input from device {d + 1}")
        return self

    @property
    def two_lanes(self) -> bool:
        """Whether a tick may hold an F and a B on one device (an F lane, then a B lane)."""
        return self.period == 1

    def table(self) -> np.ndarray:
        """``[period, D, 2]`` int32: at phase ``t mod period`` device ``d`` runs F (column 0) / B (column 1)
        of the micro-batch whose op is due at ``t - offset``, with that column holding ``offset`` (-1:
        none)."""
        D, P = self.num_devices, self.period
        out = np.full((P, D, 2), -1, np.int32)
        for kind, offs in self.offsets.items():
            for d, off in enumerate(offs):
                out[off % P, d, KIND_CODE[kind] - 1] = off
        return out

    def ops_at(self, t: int, d: int) -> List[Tuple[str, int]]:
        """The (kind, micro-batch) device ``d`` runs at tick ``t``, in lane order (F before B)."""
        out = []
        for k, kind in enumerate((F, B)):
            off = self.table()[t % self.period, d, k]
            if off >= 0 and t >= off:
                out.append((kind, (t - off) // self.period))
        return out

    def op_at(self, t: int, d: int) -> Optional[Tuple[str, int]]:
        """The one op of device ``d`` at tick ``t`` (None: idle) of a one-op-per-tick schedule."""
        ops = self.ops_at(t, d)
        if len(ops) > 1:
            raise ValueError(f"{self.name}: device {d} runs {ops} at tick {t}; use ops_at")
        return ops[0] if ops else None

    def updates_between(self, d: int) -> int:
        """Backwards (so updates, for a per-micro-batch updater) device ``d`` runs between a micro-batch's F
        and its B -- a B in the F's tick runs after it (lane order): the staleness its policy accounts for."""
        f, b = self.tick(F, d, 0), self.tick(B, d, 0)
        return sum(1 for j in range(-b - 1, 0) if f <= self.tick(B, d, j) < b)

    def max_inflight(self) -> int:
        """Micro-batches a device holds at most (F run, B not yet): the stash slots the executor needs."""
        return max(
            (self.tick(B, d, 0) - self.tick(F, d, 0)) // self.period + 1 for d in range(self.num_devices)
        )

    def unit_table(self, M: int) -> np.ndarray:
        """``[U, 4]`` int32: unit ``u`` of a call (``U`` units, ``period * U`` ticks, one batch of ``M``
        micro-batches fed) runs ``(chunk, F batch offset, B batch offset, micro-batch j)``: its F is of
        micro-batch ``(q + F offset) M + j`` of the stream, its B of ``(q + B offset) M + j``, in call
        ``q``."""
        if self.units is None:
            return np.asarray([(0, 0, 0, u) for u in range(M)], np.int32).reshape(M, 4)
        tab = np.asarray(self.units, np.int32)
        if len(tab) % M or tab[:, 3].max() >= M:
            raise ScheduleError(f"{self.name}: {len(tab)} units per call do not fit M = {M} micro-batches")
        return tab

    def call_ticks(self, M: int) -> int:
        return self.call_length if self.unit_offsets is not None else self.period * len(self.unit_table(M))

    def call_table(self, M: int) -> np.ndarray:
        """``[T, D, lanes, 2]`` int32 (``T`` ticks per call): at tick offset ``tau`` of call ``q`` device
        ``d``'s F (``[..., 0, :]``) / B (``[..., 1, :]``) / W (``[..., 2, :]``, where split) lane runs unit
        ``u`` of call ``q - shift`` as ``(u, shift)``; ``u = -1``: the lane idles.  What the executor
        reads."""
        T, D, U = self.call_ticks(M), self.num_devices, len(self.unit_table(M))
        out = np.full((T, D, len(self.kinds), 2), -1, np.int32)
        for u in range(U):
            for k, kind in enumerate(self.kinds):
                for d in range(D):
                    if not self.runs(kind, d, u):
                        continue
                    t = self.tick(kind, d, u)
                    if out[t % T, d, k, 0] >= 0:
                        raise ScheduleError(
                            f"{self.name}: device {d} runs two {kind} ops at tick offset {t % T}"
                        )
                    out[t % T, d, k] = (u, t // T)
        return out

    def validate_stream(self, M: int) -> "Periodic":
        """Raise :class:`ScheduleError` unless the replayed stream keeps every dependency of each micro-batch:
        model stage k + 1's F after stage k's, B after F on the last stage, stage k's B after stage k + 1's, W
        after its B -- one tick later across devices, a later lane of the same tick on one device."""
        when, st, S = {}, self.stage_table(), self.num_stages
        for t, d, kind, c, g in self.events(M, calls=4):
            when[(kind_of(kind), int(st[c, d]), g)] = (t, self.kinds.index(kind), d)
        for (kind, k, g), (t, lane, d) in when.items():  # kind: the action's (F, B or W)
            prev = (
                [(F, k - 1)]
                if kind == F
                else [(B, k)]
                if kind == W
                else [(B, k + 1)]
                if k + 1 < S
                else [(F, k)]
            )
            for pk, pstage in prev:
                if pstage < 0 or (pk, pstage, g) not in when:
                    continue
                pt, plane, pd = when[(pk, pstage, g)]
                ok = (t, lane) > (pt, plane) if pd == d else t > pt
                if not ok:
                    raise ScheduleError(
                        f"{self.name}: {kind} of stage {k}, micro-batch {g} at tick {t} does "
                        f"not follow {pk} of stage {pstage} (tick {pt})"
                    )
        return self

    def events(self, M: int, calls: int = 12) -> List[Tuple[int, int, str, int, int]]:
        """``(tick, device, kind, chunk, micro-batch)`` of every op of the first ``calls`` calls with a batch
        fed in each, in execution order (tick, then lane: F before B before W)."""
        units, T = self.unit_table(M), self.call_ticks(M)
        tab, out = self.call_table(M), []
        for t in range(calls * T):
            for k, kind in enumerate(self.kinds):
                for d in range(self.num_devices):
                    u, shift = tab[t % T, d, k]
                    q = t // T - shift
                    if u < 0 or q < 0:
                        continue
                    c, fo, bo, j = (int(v) for v in units[u])
                    g = (q + (fo if kind_of(kind) == F else bo)) * M + j
                    if g >= 0:
                        out.append((t, d, kind, c, g))
        return out

    def buffers(self, M: int, span: int = 0) -> Dict[str, object]:
        """What the executor allocates, derived by replaying the stream: ``stash`` -- slots per chunk
        (micro-batch ``g`` of chunk ``c`` in slot ``g mod stash[c]``: a slot is rewritten only after its B
        read it; a B after an F in the same tick counts as later); ``ring`` -- recent micro-batches kept
        (``g`` in slot ``g mod ring``; a call writes its batch before its first tick, so ``g + ring`` must be
        fed after ``g``'s last op); ``done`` -- per call ``q``, the micro-batches whose every op has run by
        its end (steady state: ``done_steady + M q``); ``latency`` -- calls after its feeding call in which a
        micro-batch's last op may run (what ``drain`` runs).  ``span``: ticks the last replica runs behind the
        first (``replica_delay * (replicas - 1)``): its ops count that much later."""
        T, D = self.call_ticks(M), self.num_devices
        ev = self.events(M)
        calls = ev[-1][0] // T + 1
        stash = []
        for c in range(self.chunks):
            live, need = [set() for _ in range(D)], 1  # the most micro-batches held at once: a floor
            for t, d, kind, cc, g in ev:
                if cc == c:
                    (live[d].add if kind_of(kind) == F else live[d].discard)(g)
                    need = max(need, len(live[d]))
            while True:
                live, ok = [set() for _ in range(D)], True
                for t, d, kind, cc, g in ev:
                    if cc != c:
                        continue
                    if kind_of(kind) == F:
                        ok &= all(h % need != g % need for h in live[d])
                        live[d].add(g)
                    else:
                        live[d].discard(g)
                if ok:
                    break
                need += 1
            stash.append(need)
        last: Dict[int, int] = {}
        for t, d, kind, c, g in ev:
            last[g] = max(last.get(g, t), t + span)
        steady = [g for g in last if (calls - 4) * M > g >= 2 * M]  # away from the replay's ends
        ring = M
        while any((g + ring) // M <= last[g] // T for g in steady):
            ring += 1
        done = [sum(1 for g, t in last.items() if t < (q + 1) * T) for q in range(calls - 3)]
        latency = max(last[g] // T - g // M for g in steady)
        return {
            "stash": stash,
            "ring": ring,
            "done": done[:-1],
            "done_steady": done[-1] - M * (len(done) - 1),
            "latency": latency,
        }

    def batch_ticks(self, M: int, chunk: int, b: int = 4) -> Dict[str, List[int]]:
        """Per device, for batch ``b`` (steady state) of ``chunk``: the tick of its first op (``first``) and
        of its last B (``last_b``)."""
        first, last_b = {}, {}
        for t, d, kind, c, g in self.events(M, calls=b + 6):
            if c == chunk and g // M == b:
                first.setdefault(d, t)
                if kind_of(kind) == B:
                    last_b[d] = t
        return {
            "first": [first[d] for d in range(self.num_devices)],
            "last_b": [last_b[d] for d in range(self.num_devices)],
        }

    def expand(self, num_microbatches: int, weight_versions=None, batches: int = 1) -> Schedule:
        """The finite schedule of ``batches`` batches of ``M`` micro-batches (fill, steady state, drain) at
        the ticks that run.  With two lanes the actions are in lane order and the IR places them itself
        (``placement="lanes"``: an F lane and a B lane per tick, as the executor runs them; tested equal to
        this pattern's ticks); otherwise the schedule carries the stream's own ticks (``fixed_ticks``), chunks
        included (stage ``c D + d`` on device ``d``): the simulator and the picture show what runs."""
        D, M = self.num_devices, num_microbatches
        n = batches * M
        ev = [e for e in self.events(M, calls=batches + self.buffers(M)["latency"] + 1) if e[4] < n]
        acts, ticks = [[] for _ in range(D)], {}
        st = self.stage_table()
        for t, d, kind, c, g in ev:  # in execution order: tick, then lane (F before B)
            acts[d].append(Action(kind_of(kind), int(g), int(st[c, d]), c))
            ticks[(kind_of(kind), int(st[c, d]), int(g))] = t
        s = Schedule(self.name, D, n, acts, num_model_stages=self.num_stages, weight_versions=weight_versions)
        if not self.two_lanes:
            s.fixed_ticks = ticks
        s.periodic = self
        return s


def no_flush_1f1b(name: str, num_devices: int) -> Periodic:
    """PipeOptim Fig. 1(d)-(e): F of micro-batch i on stage s at tick 2i + s, its B at 2i + 2D - 1 - s."""
    D = num_devices
    return Periodic(name, D, 2, {F: tuple(range(D)), B: tuple(2 * D - 1 - s for s in range(D))}).validate()


def no_flush_lanes(name: str, num_devices: int) -> Periodic:
    """The no-flush 1F1B on lanes: every tick an F lane and a B lane on every device (period 1): F of
    micro-batch i on stage s at tick i + s, its B at i + 2D - 2 - s (the last stage's B in its F's tick).
    Each tick costs F + B on every device, where the 2-tick pattern alternates F and B across devices (on
    shared cores: 1.25x, BUILD_NOTES); but a hop is a tick both ways, so 2(D - 1 - s) updates fall between a
    micro-batch's F and its B -- only methods whose rule is per batch (2BW, CDP-v1) keep their numbers."""
    D = num_devices
    return Periodic(name, D, 1, {F: tuple(range(D)), B: tuple(2 * D - 2 - s for s in range(D))}).validate()


def one_call(lane_plan) -> Periodic:
    """A flushing schedule's lane plan as a stream of one call: one unit per (micro-batch, chunk it passes
    through), its F and B at the ticks the plan placed them, nothing left in flight when the call ends -- what
    the one executor runs (with the ``gradient`` policy: the step's gradient, applied by the runner).  The
    stream carries the plan: the executor stashes residuals and routes messages (both directions, waiting
    where the plan makes them wait, the last stage's dL/dy kept on the device) in the slots the plan
    allocated.  Raises :class:`ScheduleError` where the plan has a lane a stream does not run."""
    s = lane_plan.schedule
    D, M = s.D, s.M
    where = lane_plan.where
    kinds = tuple(lane_plan.lanes)
    if kinds not in ((F, B), (F, B, W), (F, F2, B)) and F2 in kinds:
        raise ScheduleError(
            f"{s.name}: lanes {lane_plan.lanes}; a stream pairs forwards in F, F2, B lanes only"
        )
    soc = s.stage_of_chunk()  # [D, chunks]
    K = soc.shape[1]
    if (soc < 0).any():
        raise ScheduleError(f"{s.name}: a device leaves a chunk unused; a stream's chunks hold a stage each")
    units, offs = [], {F: [], B: []}
    for c in range(K):
        for j in range(M):
            ticks = {kind: [None] * D for kind in kinds}
            for d in range(D):
                k = int(soc[d, c])
                for li, kind in enumerate(kinds):
                    key = (kind_of(kind), k, j)
                    if key in where and lane_plan._dev[key] == d:
                        t, lane = where[key]
                        # an action runs in one of its kind's lanes (F or a paired F2; X or a second X'):
                        # -1 in the others
                        ticks[kind][d] = int(t) if lane == li else -1
            every = sum((ticks[k] for k in kinds), [])
            if any(t is None for t in every):
                if any(t is not None for t in every):
                    raise ScheduleError(f"{s.name}: micro-batch {j} visits chunk {c} on some devices only")
                continue
            units.append((c, 0, 0, j))
            for kind in kinds:
                offs.setdefault(kind, []).append(tuple(ticks[kind]))
    if len(units) % M or len(units) != sum(1 for k in where if k[0] == F) // D:
        raise ScheduleError(f"{s.name}: its micro-batches do not each pass every device once per chunk")
    return Periodic(
        s.name,
        D,
        1,
        {},
        chunks=K,
        units=tuple(units),
        unit_offsets={k: tuple(v) for k, v in offs.items()},
        call_length=lane_plan.num_ticks,
        stages=tuple(tuple(int(soc[d, c]) for d in range(D)) for c in range(K)),
        plan=lane_plan,
    ).validate_stream(M)
