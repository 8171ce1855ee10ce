"""Periodic (steady-state) schedules of the no-flush methods, as data (pure Python + NumPy, no JAX).

A method that never flushes runs the same pattern forever: on device ``d`` the op ``kind`` of micro-batch
``i`` (counted from the last (re)start) runs at tick ``period * i + offset[kind][d]``.  The no-flush 1F1B
of PipeDream, PipeDream-2BW, SpecTrain, PipeOptim and CDP's pipeline form (PipeOptim Fig. 1(d)-(e)) is
``period = 2``, ``F`` at ``s``, ``B`` at ``2D - 1 - s``: one op per device per tick, F and B ticks of a
device never collide, and every message is consumed the tick after it is sent.

The executor reads :meth:`Periodic.table` (``[period, D, 2]``: at phase ``t mod period`` device ``d`` runs
``kind`` of the micro-batch whose op is due at ``t - offset``); the weight policies take their distances
from :meth:`Periodic.updates_between` (the updates a stage applies between a micro-batch's F and its B);
:meth:`Periodic.expand` gives the finite schedule of ``M`` micro-batches at the ticks that really run, for
pictures and the simulator.  What you see is what runs.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np

from .ir import Action, B, F, Schedule, ScheduleError

KIND_CODE = {F: 1, B: 2}


@dataclasses.dataclass(frozen=True)
class Periodic:
    name: str
    num_devices: int
    period: int
    offsets: Dict[str, Tuple[int, ...]]          # kind -> per-device tick offset

    def tick(self, kind: str, d: int, i: int) -> int:
        return self.period * i + self.offsets[kind][d]

    def validate(self) -> "Periodic":
        """Raise :class:`ScheduleError` unless every dependency holds with one tick per message between
        devices (F(s, i) -> F(s+1, i); F(D-1, i) -> B(D-1, i); B(s+1, i) -> B(s, i)).  F and B of a device may
        share a phase (``two_lanes``): the tick then runs the F lane before the B lane, so the last stage's B
        may run in the tick of its own F."""
        D, P = self.num_devices, self.period
        for d in range(D):
            phases = [self.offsets[k][d] % P for k in (F, B)]
            if len(set(phases)) != len(phases) and not self.two_lanes:
                raise ScheduleError(f"{self.name}: device {d} runs F and B in the same phase of the period")
            late = self.tick(B, d, 0) < self.tick(F, d, 0) + (0 if d == D - 1 and self.two_lanes else 1)
            if late:
                raise ScheduleError(f"{self.name}: device {d}'s backward of a micro-batch precedes its forward")
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
        """``[period, D, 2]`` int32: at phase ``t mod period`` device ``d`` runs F (column 0) / B (column 1) of
        the micro-batch whose op is due at ``t - offset``, with that column holding ``offset`` (-1: none)."""
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
        return max((self.tick(B, d, 0) - self.tick(F, d, 0)) // self.period + 1 for d in range(self.num_devices))

    def expand(self, num_microbatches: int, weight_versions=None) -> Schedule:
        """The finite schedule of ``M`` micro-batches (fill, steady state, drain) at the ticks that run.  With
        two lanes the actions are in lane order and the IR places them itself (``placement="lanes"``: an F
        lane and a B lane per tick, as the executor runs them; tested equal to this pattern's ticks)."""
        D, M = self.num_devices, num_microbatches
        acts = []
        ticks = {}
        for d in range(D):
            ops = sorted((self.tick(k, d, i), k != F, k, i) for k in (F, B) for i in range(M))
            acts.append([Action(k, i, d) for _, _, k, i in ops])
            ticks.update({(k, d, i): t for t, _, k, i in ops})
        s = Schedule(self.name, D, M, acts, weight_versions=weight_versions)
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
