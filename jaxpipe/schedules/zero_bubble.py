"""Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3).  Beyond the papers
in ``shared/papers``.

The backward splits into ``B`` (gradient with respect to the stage input, on the critical path) and ``W``
(gradient with respect to the weights, needed only by the optimizer).  ZB-H1 keeps 1F1B's activation
memory -- stage ``d`` holds at most ``D - d`` micro-batches, counted from F until W releases them -- and
fills the bubbles with deferred W's.  The order is built by list scheduling in unit time: a device runs a
ready B first, else a forward if its in-flight limit allows, else a pending W.  With ``f = b = w`` the
bubble is about a third of 1F1B's: (D-1)(f+b-w) against (D-1)(f+b+w).
"""
from __future__ import annotations

from typing import List

from .ir import Action, B, F, W, Schedule


def build_zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    D, M = num_stages, num_microbatches
    done = {}                     # (kind, stage, mb) -> tick finished (unit time, message arrives next tick)
    orders: List[List[Action]] = [[] for _ in range(D)]
    nf, nb, pending_w = [0] * D, [0] * D, [[] for _ in range(D)]
    held = [0] * D
    limit = [min(D, M)] * D
    t = 0
    total = 3 * M * D
    while sum(len(o) for o in orders) < total:
        for d in range(D):
            ready = lambda key: key in done and done[key] <= t
            act = None
            if nb[d] < nf[d]:
                m = nb[d]
                dep = (B, d + 1, m) if d < D - 1 else (F, d, m)
                if ready(dep) and ready((F, d, m)):
                    act = Action(B, m, d)
                    nb[d] += 1
                    pending_w[d].append(m)
            if act is None and nf[d] < M and held[d] < limit[d] and (d == 0 or ready((F, d - 1, nf[d]))):
                act = Action(F, nf[d], d)
                nf[d] += 1
                held[d] += 1
            if act is None and pending_w[d]:
                act = Action(W, pending_w[d].pop(0), d)
                held[d] -= 1
            if act is not None:
                orders[d].append(act)
                done[(act.kind, act.stage, act.mb)] = t + 1
        t += 1
        if t > 10 * total:
            raise RuntimeError("zb_h1 list scheduling did not terminate")
    return Schedule("zb_h1", D, M, orders)
