"""1F1B with a flush per mini-batch (PipeDream-flush / DAPPLE; Narayanan et al. 2021, Fan et al. 2021).

Chimera §2 / Table 2 and PipeOptim §II-C: stage ``d`` runs ``min(D-1-d, M)`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards.  Same bubble ratio as GPipe,
(D-1)/(N+D-1), but at most ``D-d`` micro-batches in flight on stage ``d`` instead of N.
"""

from __future__ import annotations

from typing import List

from .ir import Action, B, F, Schedule


def one_f_one_b_order(d: int, D: int, M: int, stage: int = None, chunk: int = 0) -> List[Action]:
    """The 1F1B action order of pipeline position ``d`` of ``D`` for ``M`` micro-batches."""
    st = d if stage is None else stage
    warm = min(D - 1 - d, M)
    acts = [Action(F, m, st, chunk) for m in range(warm)]
    nf, nb = warm, 0
    while nb < M:
        if nf < M:
            acts.append(Action(F, nf, st, chunk))
            nf += 1
        acts.append(Action(B, nb, st, chunk))
        nb += 1
    return acts


def build_1f1b(num_stages: int, num_microbatches: int) -> Schedule:
    D, M = num_stages, num_microbatches
    return Schedule("1f1b", D, M, [one_f_one_b_order(d, D, M) for d in range(D)])
