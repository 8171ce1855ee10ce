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
from typing import Dict, Optional, Tuple

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
        """Raise :class:`ScheduleError` unless every dependency holds with one tick per message and no device
        runs two ops in one tick (F(s, i) -> F(s+1, i); F(D-1, i) -> B(D-1, i); B(s+1, i) -> B(s, i))."""
        D, P = self.num_devices, self.period
        for d in range(D):
            phases = [self.offsets[k][d] % P for k in (F, B)]
            if len(set(phases)) != len(phases):
                raise ScheduleError(f"{self.name}: device {d} runs F and B in the same phase of the period")
            if self.tick(B, d, 0) <= self.tick(F, d, 0):
                raise ScheduleError(f"{self.name}: device {d}'s backward of a micro-batch precedes its forward")
        for d in range(D - 1):
            if self.tick(F, d + 1, 0) < self.tick(F, d, 0) + 1:
                raise ScheduleError(f"{self.name}: F on device {d + 1} before its input from device {d}")
            if self.tick(B, d, 0) < self.tick(B, d + 1, 0) + 1:
                raise ScheduleError(f"{self.name}: B on device {d} before its input from device {d + 1}")
        return self

    def table(self) -> np.ndarray:
        """``[period, D, 2]`` int32: (kind code: 0 none, 1 F, 2 B; its tick offset) by phase ``t mod period``."""
        D, P = self.num_devices, self.period
        out = np.zeros((P, D, 2), np.int32)
        for kind, offs in self.offsets.items():
            for d, off in enumerate(offs):
                out[off % P, d] = (KIND_CODE[kind], off)
        return out

    def op_at(self, t: int, d: int) -> Optional[Tuple[str, int]]:
        """(kind, micro-batch) of device ``d`` at tick ``t`` (None: idle, before the pipeline filled)."""
        code, off = self.table()[t % self.period, d]
        if code == 0 or t < off:
            return None
        return (F if code == 1 else B), (t - off) // self.period

    def updates_between(self, d: int) -> int:
        """Backwards (so updates, for a per-micro-batch updater) device ``d`` runs between a micro-batch's F
        and its B: the staleness its weight policy must account for."""
        f, b = self.tick(F, d, 0), self.tick(B, d, 0)
        return sum(1 for j in range(-b, 1) if f < self.tick(B, d, j) < b)

    def expand(self, num_microbatches: int, weight_versions=None) -> Schedule:
        """The finite schedule of ``M`` micro-batches (fill, steady state, drain) at the ticks that run."""
        D, M = self.num_devices, num_microbatches
        acts = []
        ticks = {}
        for d in range(D):
            ops = sorted((self.tick(k, d, i), k, i) for k in (F, B) for i in range(M))
            acts.append([Action(k, i, d) for _, k, i in ops])
            ticks.update({(k, d, i): t for t, k, i in ops})
        s = Schedule(self.name, D, M, acts, weight_versions=weight_versions)
        s.fixed_ticks = ticks
        s.periodic = self
        return s


def no_flush_1f1b(name: str, num_devices: int) -> Periodic:
    """PipeOptim Fig. 1(d)-(e): F of micro-batch i on stage s at tick 2i + s, its B at 2i + 2D - 1 - s."""
    D = num_devices
    return Periodic(name, D, 2, {F: tuple(range(D)), B: tuple(2 * D - 1 - s for s in range(D))}).validate()
