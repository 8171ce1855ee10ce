"""Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3).  Beyond the papers
the project started from.

The backward splits into ``B`` (gradient with respect to the stage input, on the critical path) and ``W``
(gradient with respect to the weights, needed only by the optimizer).  ZB-H1 keeps 1F1B's activation
memory -- stage ``d`` holds at most ``D - d`` micro-batches, counted from F until W releases them -- and
fills the bubbles with deferred W's.  The order is built by list scheduling in unit time: a device runs a
ready B first, else a forward if its in-flight limit allows, else a pending W.  With ``f = b = w`` the
bubble is about a third of 1F1B's: (D-1)(f+b-w) against (D-1)(f+b+w).
"""

from __future__ import annotations

from typing import List, Optional

from .ir import Action, B, F, W, Schedule, ScheduleError


W_FROM = ("frontier", "recompute")


def build_zb_h1(
    num_stages: int,
    num_microbatches: int,
    max_deferred_w: Optional[int] = None,
    w_from: str = "frontier",
    costs=None,
) -> Schedule:
    """The ZB-H1 order (``max_deferred_w`` below) with ``options["w_from"]``: how the executor computes W --
    ``"frontier"`` (default; the paper's form) from the per-layer output gradients B keeps for it
    (:mod:`jaxpipe.runtime.wsplit`), ``"recompute"`` by back-propagating through the stage again (no
    memory beside the residual stash).  ``costs=(f, b, w)``: measured op costs; the ticks are then chosen for
    them (:mod:`.zb_costed`, at the same memory) instead of the unit-time order."""
    if w_from not in W_FROM:
        raise ScheduleError(
            f"zb_h1: w_from={w_from!r}; choose one of {W_FROM} (W from the per-layer output "
            f"gradients B keeps, or recomputed through the stage)"
        )
    if costs is not None:
        if max_deferred_w is not None:
            raise ScheduleError(
                "zb_h1: costs= chooses the ticks itself at 1F1B's memory; give it or max_deferred_w, not both"
            )
        from .zb_costed import build_costed

        s = build_costed(num_stages, num_microbatches, costs)
        s.options = {**s.options, "w_from": w_from, "costs": tuple(float(c) for c in costs)}
        return s
    s = _build(num_stages, num_microbatches, max_deferred_w)
    s.options = {**s.options, "w_from": w_from}
    return s


def _build(num_stages: int, num_microbatches: int, max_deferred_w: Optional[int] = None) -> Schedule:
    """``max_deferred_w=None``: 1F1B's peak memory (above).  ``max_deferred_w=k``: forwards limited as in
    1F1B (at most D - d micro-batches between F and B on stage d) and up to k + 1 backwards whose W is
    still pending; a W is forced once more are pending.  k = D - 1 gives exactly a third of 1F1B's bubble
    (the paper's (D-1)(f+b-w)), but a pending W keeps its micro-batch's whole residual stash in this
    executor (W of a multi-layer stage back-propagates through the stage again), so stage 0 then holds up
    to 2D - 1 micro-batches against 1F1B's D (the simulator's ``peak_inflight`` shows it: W reads the
    stashed layer inputs, so they stay until W; with ``w_from="frontier"`` the per-layer output gradients
    stay beside them)."""
    D, M = num_stages, num_microbatches
    if max_deferred_w is not None:
        return _deferred(D, M, int(max_deferred_w))
    done = {}  # (kind, stage, mb) -> tick finished (unit time, message arrives next tick)
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


def _deferred(D: int, M: int, cap: int) -> Schedule:
    if cap < 0:
        raise ScheduleError(f"zb_h1: max_deferred_w must be >= 0, got {cap}")
    done = {}
    orders: List[List[Action]] = [[] for _ in range(D)]
    nf, nb, pending = [0] * D, [0] * D, [[] for _ in range(D)]
    t = 0
    while sum(len(o) for o in orders) < 3 * M * D:
        for d in range(D):
            ready = lambda key: key in done and done[key] <= t
            act = None
            if nb[d] < nf[d]:  # B first: it is on the critical path
                m = nb[d]
                dep = (B, d + 1, m) if d < D - 1 else (F, d, m)
                if ready(dep) and ready((F, d, m)):
                    act = Action(B, m, d)
                    nb[d] += 1
                    pending[d].append(m)
            if act is None and len(pending[d]) > cap:  # too many W's deferred
                act = Action(W, pending[d].pop(0), d)
            if act is None and nf[d] < M and nf[d] - nb[d] < D - d and (d == 0 or ready((F, d - 1, nf[d]))):
                act = Action(F, nf[d], d)
                nf[d] += 1
            if act is None and pending[d]:  # fill the bubble with a deferred W
                act = Action(W, pending[d].pop(0), d)
            if act is not None:
                orders[d].append(act)
                done[(act.kind, act.stage, act.mb)] = t + 1
        t += 1
        if t > 10 * 3 * M * D:
            raise RuntimeError("zb_h1 list scheduling did not terminate")
    return Schedule("zb_h1", D, M, orders)
