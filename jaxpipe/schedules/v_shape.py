"""V-shaped schedules: two model chunks per device placed in a V -- device ``d`` holds model stage ``d``
(chunk 0, on the way down) and stage ``2D - 1 - d`` (chunk 1, on the way back up), so a micro-batch enters
and leaves the pipeline on device 0 and turns around on device ``D - 1`` without a message.  Beyond the
papers the project started from.

* ``zb_v`` -- ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §6 / appendix "ZB-V"):
  the backward split into ``B`` (input gradient) and ``W`` (weight gradient); at most ``2D`` chunk activations
  per device (``D`` whole stages: 1F1B's activation memory) and, with ``F = B = W``, no bubble in steady
  state: the paper's bubble is ``(D - 1)(F + B - 2W)`` in whole-stage times.  Built by list scheduling in unit
  time (the paper's own ZB-V heuristic is a search in the same spirit): a device runs a ready ``B`` first,
  else a forward if its activation limit allows (chunk 1 first: it moves a micro-batch toward the loss), else
  a pending ``W``.
* ``dualpipe_v`` -- DualPipeV (DeepSeek-AI, DualPipe's "cut-in-half" V form, github.com/deepseek-ai/DualPipe,
  ``dualpipev.py``): the eight steps of its ``step()`` per rank, written as the action order: warm-up
  forwards, zero-bubble backwards (``B`` now, ``W`` deferred) at the ends, and in the middle
  forward-and-backward pairs of different micro-batches (``F0 B1 F1 B0``) whose backward is whole (``B`` and
  its ``W`` together).  The executor's lane placement runs such a pair in one tick (its F lane and its B
  lane).  Published bubble ``(PP/2 - 1)(F&B + B - 3W)``, activations ``PP + 1`` chunk sets at ``PP = 2D``
  stages; needs ``M >= 2D``.
"""

from __future__ import annotations

from collections import deque
from typing import List

from .ir import Action, B, F, W, Schedule, ScheduleError
from .zero_bubble import W_FROM


def v_stage(d: int, chunk: int, D: int) -> int:
    """The model stage of chunk ``chunk`` on device ``d`` in a V."""
    return d if chunk == 0 else 2 * D - 1 - d


def _check(name: str, D: int, M: int, w_from: str) -> None:
    if w_from not in W_FROM:
        raise ScheduleError(
            f"{name}: w_from={w_from!r}; choose one of {W_FROM} (W from the per-layer output "
            f"gradients B keeps, or recomputed through the stage)"
        )


def _finish(name: str, D: int, M: int, orders, w_from: str) -> Schedule:
    s = Schedule(name, D, M, orders, num_model_stages=2 * D)
    s.options = {"w_from": w_from}
    return s


def build_zb_v(num_stages: int, num_microbatches: int, w_from: str = "frontier", costs=None) -> Schedule:
    """ZB-V for ``num_stages`` devices (``2 D`` model stages) and ``num_microbatches`` micro-batches;
    ``costs=(f, b, w)`` of one chunk: ticks chosen for them (:mod:`.zb_costed`, the same V and memory)."""
    D, M = num_stages, num_microbatches
    _check("zb_v", D, M, w_from)
    if costs is not None:
        from .zb_costed import build_costed

        S = 2 * D
        s = build_costed(
            D,
            M,
            costs,
            name="zb_v",
            devices=[st if st < D else S - 1 - st for st in range(S)],
            chunk_of=[0 if st < D else 1 for st in range(S)],
        )
        s.options = {"w_from": w_from, "costs": tuple(float(c) for c in costs)}
        return s
    S, limit = 2 * D, 2 * D  # chunk activations held per device: D whole stages, as 1F1B's stage 0
    done = {}  # (kind, stage, mb) -> tick its result is usable on another device
    orders: List[List[Action]] = [[] for _ in range(D)]
    nf = [[0, 0] for _ in range(D)]  # next forward micro-batch per (device, chunk)
    nb = [[0, 0] for _ in range(D)]
    pending = [deque() for _ in range(D)]
    held = [0] * D
    ready = lambda key, t: key in done and done[key] <= t
    t, total = 0, 3 * M * S
    while sum(len(o) for o in orders) < total:
        for d in range(D):
            act = None
            for c in (0, 1):  # B first (critical path); chunk 0 finishes micro-batches
                m, st = nb[d][c], v_stage(d, c, D)
                if m < nf[d][c]:
                    dep = (B, st + 1, m) if st < S - 1 else (F, st, m)
                    if ready(dep, t) and ready((F, st, m), t):
                        act = Action(B, m, st, c)
                        break
            if act is None and held[d] < limit:
                for c in (1, 0):
                    m, st = nf[d][c], v_stage(d, c, D)
                    if m < M and (st == 0 or ready((F, st - 1, m), t)):
                        act = Action(F, m, st, c)
                        break
            if act is None and pending[d]:
                act = pending[d].popleft()
            if act is None:
                continue
            orders[d].append(act)
            if act.kind == F:
                nf[d][act.chunk] += 1
                held[d] += 1
            elif act.kind == B:
                nb[d][act.chunk] += 1
                pending[d].append(Action(W, act.mb, act.stage, act.chunk))
            else:
                held[d] -= 1
            # the turn (stage D - 1 -> D) and the loss stay on one device: usable in the next tick too
            done[(act.kind, act.stage, act.mb)] = t + 1
        t += 1
        if t > 10 * total:
            raise RuntimeError("zb_v list scheduling did not terminate")
    return _finish("zb_v", D, M, orders, w_from)


class _Rank:
    """One rank's action list as DualPipeV's ``step()`` writes it (per-chunk counters, deferred W's)."""

    def __init__(self, d: int, D: int):
        self.d, self.D, self.acts = d, D, []
        self.nf, self.nb, self.deferred = [0, 0], [0, 0], deque()

    def f(self, c: int):
        self.acts.append(Action(F, self.nf[c], v_stage(self.d, c, self.D), c))
        self.nf[c] += 1

    def b(self, c: int, zb: bool = False):
        """A backward: zero-bubble (``W`` deferred to a later ``w()``) or whole (its ``W`` right after)."""
        m, st = self.nb[c], v_stage(self.d, c, self.D)
        self.nb[c] += 1
        self.acts.append(Action(B, m, st, c))
        (self.deferred.append if zb else self.acts.append)(Action(W, m, st, c))

    def w(self):
        self.acts.append(self.deferred.popleft())


def dualpipe_v_order(d: int, D: int, M: int) -> List[Action]:
    """Rank ``d``'s actions: steps 1-8 of DualPipeV's ``step()`` (``dualpipev.py``)."""
    r = _Rank(d, D)
    for _ in range(2 * (D - d - 1)):  # 1: nF0
        r.f(0)
    for _ in range(d + 1):  # 2: nF0F1
        r.f(0)
        r.f(1)
    for _ in range(D - d - 1):  # 3: nB1W1F1 (zero bubble)
        r.b(1, zb=True)
        r.w()
        r.f(1)
    for _ in range(M - 2 * D + d + 1):  # 4: nF0B1F1B0 (forward-backward pairs)
        r.f(0)
        r.b(1)
        r.f(1)
        r.b(0)
    for _ in range(D - d - 1):  # 5: nB1F1B0
        r.b(1)
        r.f(1)
        r.b(0)
    zb = False
    for i in range(d + 1):  # 6: nB1B0 (the second half zero bubble)
        if i == (d + 1) // 2 and d % 2 == 1:
            zb = True
        r.b(1, zb)
        if i == (d + 1) // 2 and d % 2 == 0:
            zb = True
        r.b(0, zb)
    for _ in range(D - d - 1):  # 7: nWB0
        r.w()
        r.b(0, zb=True)
    for _ in range(d + 1):  # 8: nW
        r.w()
    if r.deferred:
        raise RuntimeError(f"dualpipe_v: rank {d} left {len(r.deferred)} weight gradients undone")
    return r.acts


def build_dualpipe_v(num_stages: int, num_microbatches: int, w_from: str = "frontier") -> Schedule:
    """DualPipeV for ``num_stages`` devices (``2 D`` model stages); ``num_microbatches >= 2 D``."""
    D, M = num_stages, num_microbatches
    _check("dualpipe_v", D, M, w_from)
    if M < 2 * D:
        raise ScheduleError(
            f"dualpipe_v: {M} micro-batches for {D} devices; DualPipeV needs at least 2 x devices "
            f"= {2 * D} (its warm-up fills both chunks of every rank), e.g. num_microbatches="
            f"{2 * D}"
        )
    return _finish("dualpipe_v", D, M, [dualpipe_v_order(d, D, M) for d in range(D)], w_from)
