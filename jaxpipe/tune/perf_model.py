"""Step-time model of a schedule (Chimera §3.4, equation (1)), plus the lockstep form jaxpipe's executor pays.

Paper (MPMD, event-driven):  T = (F_t + Comm_p2p) C_f + (B_t + Comm_p2p) C_b + max_i Comm_unoverlapped(i),
with C_f, C_b the forwards and backwards on the critical path (read off the IR by
:func:`critical_path_counts`), Comm_p2p = alpha + beta L (one activation), and the gradient all-reduce of r
stage replicas by Rabenseifner's algorithm, 2 log2(r) alpha + 2 (r-1)/r beta L, of which only what does not
fit in the device's free region after its last backward counts (:func:`unoverlapped_allreduce`).

jaxpipe's SPMD executor runs lockstep ticks (one op per device per tick, every device waits for the tick's
slowest op, one ``ppermute`` per channel each tick) and reduces gradients after the pipeline, so its model is
    T = sum_ticks [ cost(op kind, busy devices) + channels * Comm_p2p ] + ops * c_op
        + Comm_allreduce + T_update,
with ``cost(kind, k)`` the measured time of k devices running that op at once (a flat function of k on a GPU
per device; on CPU-emulated devices sharing cores it grows with k, which is why it is measured per k).
No JAX here: the measured numbers come from :mod:`.microbench`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from ..schedules.ir import B, F, W, Schedule


@dataclasses.dataclass
class Costs:
    """Measured costs, in seconds, of Chimera's performance model (section 3.4).

    Attributes:
        op: ``op[kind][k - 1]``: one op of ``kind`` (``"F"``, ``"B"``, ``"W"``) for one micro-batch on one
            stage while ``k`` devices run it at once.
        p2p_alpha: a ``ppermute``'s latency.
        p2p_beta: a ``ppermute``'s seconds per byte.
        ar_alpha: an all-reduce step's latency (Rabenseifner).
        ar_beta: an all-reduce's seconds per byte.
        update: the optimizer update of the parameters held per device.
        overhead: per step: dispatch and the gather and scatter around the program.
    """

    op: Dict[str, List[float]]
    p2p_alpha: float
    p2p_beta: float
    ar_alpha: float
    ar_beta: float
    update: float = 0.0
    overhead: float = 0.0  # per step: dispatch and the gather/scatter around the program

    def op_time(self, kind: str, k: int) -> float:
        """One op's time.

        Args:
            kind: ``"F"``, ``"B"`` or ``"W"``.
            k: devices running it at once (past the measured ones: the last measured).

        Returns:
            Seconds.
        """
        row = self.op[kind]
        return row[min(k, len(row)) - 1]

    def p2p(self, nbytes: float) -> float:
        """One ``ppermute``'s time.

        Args:
            nbytes: the message's bytes.

        Returns:
            Seconds: ``p2p_alpha + p2p_beta * nbytes``.
        """
        return self.p2p_alpha + self.p2p_beta * nbytes

    def allreduce(self, nbytes: float, r: int) -> float:
        """An all-reduce's time (Rabenseifner).

        Args:
            nbytes: the bytes reduced.
            r: replicas.

        Returns:
            Seconds (0 for one replica).
        """
        if r <= 1:
            return 0.0
        return 2 * math.log2(r) * self.ar_alpha + 2 * (r - 1) / r * self.ar_beta * nbytes


def _deps_graph(s: Schedule):
    """Every action with its predecessors: data dependencies and the previous action on its device."""
    preds = {}
    for d, acts in enumerate(s.actions):
        prev = None
        for a in acts:
            key = (a.kind, a.stage, a.mb)
            preds[key] = list(s.deps(a)) + ([prev] if prev else [])
            prev = key
    return preds


def critical_path_counts(s: Schedule, f: float = 1.0, b: float = 2.0, w: float = 1.0) -> Tuple[int, int]:
    """Forwards and backwards on the critical path of the event-driven placement (Chimera, Figure 6).

    Walks back from the action that finishes last, each time to the predecessor whose finish time equals the
    action's start (the one it waited for).

    Args:
        s: the schedule.
        f: a forward's duration.
        b: a backward's duration.
        w: a weight gradient's duration.

    Returns:
        ``(C_f, C_b)``: the forwards, and the backwards (B and W), on the path.
    """
    place = s.place(f, b, w)
    start, finish = place["start"], place["finish"]
    preds = _deps_graph(s)
    key = max(finish, key=lambda k: finish[k])
    cf = cb = 0
    while key is not None:
        cf += key[0] == F
        cb += key[0] in (B, W)
        nxt = None
        for p in preds[key]:
            if abs(finish[p] - start[key]) < 1e-9:
                nxt = p
                break
        key = nxt
    return cf, cb


def lockstep_profile(s: Schedule) -> Dict[Tuple[str, int], int]:
    """The lockstep grid's ticks by their slowest kind and their busy devices.

    Args:
        s: the schedule.

    Returns:
        ``{(slowest kind, busy devices): ticks}``, with B > W > F in cost order.
    """
    rank = {F: 0, W: 1, B: 2}
    out: Dict[Tuple[str, int], int] = {}
    for row in s.grid():
        busy = [a for a in row if a is not None]
        if not busy:
            continue
        kind = max((a.kind for a in busy), key=lambda k: rank[k])
        out[(kind, len(busy))] = out.get((kind, len(busy)), 0) + 1
    return out


def free_regions(s: Schedule, d: int, after: float, place) -> List[Tuple[float, float]]:
    """Chimera Figure 6's free regions of device ``d`` from time ``after`` on: the intervals where it
    computes nothing before the step ends (bubbles between its ops -- regions (a), (b) -- and the tail after
    its last op -- region (c)), from the event-driven placement ``place``."""
    end = max(place["finish"].values())
    busy = sorted((place["start"][k], place["finish"][k]) for k, dev in place["device"].items() if dev == d)
    out, t = [], after
    for a, b in busy:
        if b <= t:
            continue
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < end:
        out.append((t, end))
    return out


def unoverlapped_allreduce(s: Schedule, costs: Costs, grad_bytes: float, replicas: int) -> float:
    """The paper's max_i Comm_unoverlapped(i) (§3.3, Figure 6): on each device, each stage replica's
    all-reduce may start after the device's last backward of it and runs in the device's free regions
    (:func:`free_regions`: its bubbles, then the tail), one all-reduce after the other, the earliest-finished
    replica first; what does not fit before the step's end is unoverlapped (event-driven times with the
    measured F/B)."""
    f, b = costs.op_time(F, 1), costs.op_time(B, 1)
    place = s.place(f, b, costs.op_time(W, 1) if s.has_w() else 1.0)
    last = W if s.has_w() else B
    worst = 0.0
    for d, acts in enumerate(s.actions):
        chunks = {}
        for a in acts:
            if a.kind == last:
                chunks[a.chunk] = max(chunks.get(a.chunk, 0.0), place["finish"][(a.kind, a.stage, a.mb)])
        left, clock = 0.0, 0.0
        for _, t_done in sorted(chunks.items(), key=lambda x: x[1]):
            need = costs.allreduce(grad_bytes, replicas) + left  # a later replica waits for the earlier
            for a0, a1 in free_regions(s, d, max(t_done, clock), place):
                use = min(need, a1 - a0)
                need, clock = need - use, a0 + use
                if need <= 0:
                    break
            left = max(need, 0.0)
        worst = max(worst, left)
    return worst


def predict(
    s: Schedule,
    costs: Costs,
    act_bytes: float,
    grad_bytes: float,
    replicas: int,
    width: int = 1,
    channels: Optional[int] = None,
    chunk_tick_overhead: float = 0.0,
    op_overhead: float = 0.0,
) -> Dict[str, float]:
    """A step's predicted time: the lockstep executor's and the paper's equation (1) (Chimera, section 3.4).

    Args:
        s: the schedule.
        costs: the measured :class:`Costs`.
        act_bytes: one micro-batch's activation message.
        grad_bytes: one stage's gradients.
        replicas: copies of a stage's gradients reduced (data-parallel width x replicas per pipeline).
        width: pipelines running at once (data-parallel ``W``): a tick with ``k`` busy devices per pipeline
            has ``k x W`` busy devices.
        channels: messages a tick moves at once (default the schedule's).
        chunk_tick_overhead: the extra per tick for each model chunk beyond the first (more weights and
            accumulators carried through the tick), calibrated once.
        op_overhead: the executor's fixed cost of one device's op (F, B or W), times the ops of all ``width``
            pipelines, calibrated once.

    Returns:
        ``{"lockstep": seconds, "paper": seconds, ...}`` with the parts.
    """
    ch = len(set().union(*s.plan("ordered").channels)) if channels is None else channels
    prof = lockstep_profile(s)
    idle_ticks = s.num_ticks - sum(prof.values())
    compute = sum(n * costs.op_time(kind, k * width) for (kind, k), n in prof.items())
    nchunk = int(s.stage_of_chunk().shape[1])
    p2p = (
        s.num_ticks * (ch * costs.p2p(act_bytes) if s.D > 1 else 0.0)
        + s.num_ticks * (nchunk - 1) * chunk_tick_overhead
        + op_overhead * width * sum(len(a) for a in s.actions)
    )
    ar = nchunk * costs.allreduce(grad_bytes, replicas)
    # Chimera: each extra replica is fetched from its owner by one ppermute and its gradient sent back by
    # another; interleaved: the step gathers the device's chunks and scatter-adds their gradients
    soc = s.stage_of_chunk()
    cols = [sorted(int(v) for v in soc[:, c]) == list(range(s.D)) for c in range(nchunk)]
    moved = sum(1 for c in range(nchunk) if any(int(soc[d, c]) != d for d in range(s.D)))
    if s.num_model_stages == s.D and all(cols):
        layout = 2 * moved * costs.p2p(grad_bytes)
    else:
        layout = 2 * nchunk * costs.p2p(grad_bytes)
    lock = compute + p2p + ar + layout + costs.update + costs.overhead
    n = min(s.D * width, len(costs.op[F]))  # the paper's F_t: every device busy
    ft, bt = costs.op_time(F, n), costs.op_time(B, n)
    cf, cb = critical_path_counts(s, ft, bt, costs.op_time(W, n) if s.has_w() else 1.0)
    pp = costs.p2p(act_bytes) if s.D > 1 else 0.0
    paper = (
        (ft + pp) * cf
        + (bt + pp) * cb
        + unoverlapped_allreduce(s, costs, grad_bytes, replicas)
        + costs.update
        + costs.overhead
    )
    return {
        "lockstep": lock,
        "paper": paper,
        "C_f": cf,
        "C_b": cb,
        "ticks": s.num_ticks,
        "idle_ticks": idle_ticks,
        "compute": compute,
        "p2p": p2p,
        "allreduce": ar,
        "layout": layout,
    }
