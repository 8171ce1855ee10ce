"""AvgPipe's schedule: 1F1B with advance forward propagation (Xu et al., AvgPipe §4.2, Algorithm 1).

Every one of the N parallel pipelines runs the same per-device order.  Algorithm 1 starts as 1F1B (the first
GPU issues K - 1 forwards before it alternates) and raises ``advance_num`` while steps get faster and memory
allows.  Here ``advance`` counts the forwards issued *beyond* 1F1B's warm-up on every device: device ``d``
runs ``min(D - 1 - d + advance, M)`` forwards, then alternates one forward and one backward, then drains.
``advance = 0`` is 1F1B; ``advance >= M - 1`` is all-forward-all-backward (AFAB, GPipe's order) -- the
two ends the paper says it degenerates to.  Advance forwards let communication overlap computation (Fig. 7c)
at the price of ``advance`` more micro-batches' activations on the upstream devices.
"""

from __future__ import annotations

from typing import List

from .ir import Action, B, F, Schedule, ScheduleError
from ..checks.values import is_int


def advance_order(d: int, D: int, M: int, advance: int) -> List[Action]:
    warm = min(D - 1 - d + advance, M)
    acts = [Action(F, m, d) for m in range(warm)]
    nf, nb = warm, 0
    while nb < M:
        if nf < M:
            acts.append(Action(F, nf, d))
            nf += 1
        acts.append(Action(B, nb, d))
        nb += 1
    return acts


def max_advance(D: int, M: int) -> int:
    """The advance at which every device runs all forwards first (AFAB); more changes nothing."""
    return max(M - 1, 0)


def build_avgpipe(num_stages: int, num_microbatches: int, advance: int = 0) -> Schedule:
    D, M = num_stages, num_microbatches
    if not is_int(advance, 0):
        raise ScheduleError(
            f"avgpipe: advance must be a non-negative integer (forwards issued beyond 1F1B's "
            f"warm-up; 0 = 1F1B, {max_advance(D, M)} = all forwards first), got {advance!r}"
        )
    advance = min(advance, max_advance(D, M))
    s = Schedule("avgpipe", D, M, [advance_order(d, D, M, advance) for d in range(D)])
    s.options = {"advance": advance}
    return s
