"""Configuration search (Chimera §3.4): every (W, D, B, N, schedule) that fits a memory budget, ranked by
predicted step time.  W data-parallel replicas x D stages = P devices, B micro-batch size, N = batch / (W B)
micro-batches per replica.  No JAX here."""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional

from .. import schedules

SCHEDULES = tuple(name for name, m in schedules.METHODS.items() if m.tunable)  # declared: Method.tunable


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration of the Chimera-style search: a schedule on ``W`` pipelines of ``D`` stages.

    Attributes:
        schedule: the method's name.
        W: data-parallel width (pipelines).
        D: pipeline stages (devices per pipeline).
        B: micro-batch size.
        N: micro-batches per replica per step.
    """

    schedule: str
    W: int  # data-parallel width
    D: int  # pipeline stages (devices per pipeline)
    B: int  # micro-batch size
    N: int  # micro-batches per replica per step

    def options(self) -> dict:
        """The method's options as the search uses them: its defaults, two model chunks per device where the
        method stacks chunks (interleaved's ``virtual``)."""
        m = schedules.method(self.schedule)
        return m.resolve({"virtual": 2} if "virtual" in m.options else {}, 2 * self.D, self.D)

    def build(self) -> "schedules.Schedule":
        m = schedules.method(self.schedule)
        return schedules.build(self.schedule, self.D, self.N, **m.builder_options(self.options()))

    @property
    def model_stages(self) -> int:
        return self.D * schedules.method(self.schedule).stages_per_device(self.options())

    def label(self) -> str:
        return f"{self.schedule} W={self.W} D={self.D} B={self.B} N={self.N}"


def enumerate_candidates(
    devices: int,
    batch: int,
    num_layers: int,
    schedule_names: Iterable[str] = SCHEDULES,
    micro_batch_sizes: Optional[Iterable[int]] = None,
    max_n: int = 64,
) -> List[Candidate]:
    """Every configuration the devices, batch and layers allow (Chimera, section 3.4): ``D`` divides the
    devices, the micro-batch size divides the batch per replica, the layers divide into the model stages, and
    the schedule builds.

    Args:
        devices: the devices to split into ``W x D``.
        batch: the global batch.
        num_layers: the model's layers.
        schedule_names: the methods considered.
        micro_batch_sizes: the sizes tried (default every divisor of the batch per replica).
        max_n: the most micro-batches a step.

    Returns:
        The :class:`Candidate` list.
    """
    out = []
    for D in range(1, devices + 1):
        if devices % D:
            continue
        W = devices // D
        if batch % W:
            continue
        per = batch // W
        for B in micro_batch_sizes or [b for b in range(1, per + 1) if per % b == 0]:
            if per % B or per // B > max_n:
                continue
            N = per // B
            for name in schedule_names:
                c = Candidate(name, W, D, B, N)
                if num_layers % c.model_stages:
                    continue
                try:
                    c.build()
                except (schedules.ScheduleError, ValueError):
                    continue  # e.g. chimera with odd D, interleaved with N not a multiple of D
                out.append(c)
    return out


def memory_estimate(
    c: Candidate,
    stage_param_bytes: float,
    stash_bytes_per_mb: float,
    optimizer_copies: float = 2.0,
    message_bytes: float = 0.0,
) -> float:
    """Bytes per device of a candidate.

    Weights times the copies the schedule holds (Chimera's 2f replicas), optimizer state and a gradient
    accumulator per copy, the stash (the executor's slot capacity, at least the peak of micro-batches in
    flight) and the message buffer; Chimera's equation: weights ``2f M_theta``, activations ``[(D/2+1), D]
    M_a``.

    Args:
        c: the candidate.
        stage_param_bytes: one stage's parameters, for the D-stage cut.
        stash_bytes_per_mb: one micro-batch's residuals on one stage, at micro-batch size ``B``.
        optimizer_copies: the optimizer state's copies of the parameters (Adam: 2).
        message_bytes: the message buffer.

    Returns:
        Bytes.
    """
    s = c.build()
    t = s.plan("ordered")  # the one-op-per-tick plan's slots (the memory bound the paper formulas state)
    copies = int(s.stage_of_chunk().shape[1])
    per = schedules.method(c.schedule).stages_per_device(c.options())
    if per > 1 and copies == per:  # the D-stage cut's stage split in chunks: each chunk holds 1/per of it
        stage_param_bytes = stage_param_bytes / per
        stash_bytes_per_mb = stash_bytes_per_mb / per
    weights = copies * stage_param_bytes * (2 + optimizer_copies)  # params, grads, optimizer state
    return weights + (t.stash_capacity + 1) * stash_bytes_per_mb + (t.mbuf_capacity + 1) * message_bytes
