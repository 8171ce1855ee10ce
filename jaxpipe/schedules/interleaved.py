"""Interleaved 1F1B (virtual pipeline stages; Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21, §2.2.2).  Beyond the papers the project started from.

The model is cut into ``v * D`` stages; device ``d`` holds the ``v`` chunks ``d, d + D, ..., d + (v-1) D``
(round-robin), so a micro-batch loops around the device ring ``v`` times.  Each device runs
``(D - d - 1) * 2 + (v - 1) * D`` warm-up forwards, then alternates one forward and one backward, then drains.
Forwards walk the chunks in groups of ``D`` micro-batches (Megatron's order: micro-batch group, then chunk);
backwards walk the chunks in reverse.  With chunk times ``f/v``, ``b/v`` the bubble is ``(D-1)/(v M)`` of the
ideal step time, ``v`` times less than 1F1B, for ``v``-fold more point-to-point messages.
"""

from __future__ import annotations

from typing import List

from .ir import Action, B, F, Schedule, ScheduleError
from ..checks.values import is_int


def _fwd_unit(k: int, D: int, v: int):
    """The k-th forward on a device: (micro-batch, chunk)."""
    group, r = divmod(k, D * v)
    return group * D + r % D, r // D


def _bwd_unit(k: int, D: int, v: int):
    mb, chunk = _fwd_unit(k, D, v)
    return mb, v - 1 - chunk


def interleaved_order(d: int, D: int, M: int, v: int) -> List[Action]:
    total = M * v
    warm = min((D - d - 1) * 2 + (v - 1) * D, total)
    acts: List[Action] = []

    def f(k):
        mb, c = _fwd_unit(k, D, v)
        acts.append(Action(F, mb, c * D + d, c))

    def b(k):
        mb, c = _bwd_unit(k, D, v)
        acts.append(Action(B, mb, c * D + d, c))

    for k in range(warm):
        f(k)
    nf, nb = warm, 0
    while nb < total:
        if nf < total:
            f(nf)
            nf += 1
        b(nb)
        nb += 1
    return acts


def build_interleaved_1f1b(num_stages: int, num_microbatches: int, virtual: int = 2) -> Schedule:
    D, M, v = num_stages, num_microbatches, virtual
    if not is_int(v, 1):
        raise ScheduleError(
            f"interleaved_1f1b: virtual (model chunks per device) must be a positive integer, got {v!r}"
        )
    if M % D:
        raise ScheduleError(
            f"interleaved_1f1b: {M} micro-batches do not form whole groups of D={D} (the "
            f"schedule sends micro-batches around the ring in groups of D); use a multiple of "
            f"{D}, e.g. {D * max(1, -(-M // D))}"
        )
    return Schedule(
        "interleaved_1f1b", D, M, [interleaved_order(d, D, M, v) for d in range(D)], num_model_stages=v * D
    )
