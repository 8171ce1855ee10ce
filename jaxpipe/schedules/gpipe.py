"""GPipe (Huang et al., 2019): all forwards, then all backwards, one flush per mini-batch.

Chimera §2 / Table 2: bubble ratio (D-1)/(N+D-1), weights M_theta, activations N*M_a (every micro-batch is
in flight on every stage before the first backward).
"""

from __future__ import annotations

from .ir import Action, B, F, Schedule


def build_gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    D, M = num_stages, num_microbatches
    actions = [[Action(F, m, d) for m in range(M)] + [Action(B, m, d) for m in range(M)] for d in range(D)]
    return Schedule("gpipe", D, M, actions)
