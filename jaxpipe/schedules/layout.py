"""Where a schedule puts things, as data (pure Python + NumPy, no JAX): which device-local chunk holds which
model stage (:func:`layout_index`, :func:`exchange_perms`), the lane plan the executor runs
(:func:`lane_plan`), the plan columns its slot routing reads (:data:`ROUTE_COLUMNS`) and Chimera's
eager-reduction points (:func:`eager_points`)."""

from __future__ import annotations

import numpy as np

from .ir import Schedule
from .lanes import plan


#: a lane plan's columns the executor's slot routing reads: stash slot, input slot, kept-message slot,
#: arrival slots (``ROUTE[name]``: the column's index in a device's route row)
ROUTE_COLUMNS = ("stash", "in", "keep", "recv_p", "recv_m", "send", "front")
ROUTE = {k: i for i, k in enumerate(ROUTE_COLUMNS)}


def layout_index(sched: Schedule) -> np.ndarray:
    """``[D * chunks]``: the model stage each device-local chunk holds (device-major), the order in which
    the executor wants the stage parameters (a chunk a device does not use holds a copy of stage 0)."""
    soc = sched.stage_of_chunk()
    return np.where(soc < 0, 0, soc).reshape(-1).astype(np.int32)


def exchange_perms(sched: Schedule):
    """Where every chunk column is a permutation of the model's D stages (GPipe/1F1B/ZB: identity; Chimera:
    each device's second replica lives as the first on its mirror device), the executor takes the stage
    parameters in the model's own order, one stage per device, and fetches chunk c with one ``ppermute``
    (source device ``stage_of_chunk[d, c]`` -> d); its gradients go back the same way and are summed with
    the owner's: the paper's all-reduce between a stage's replicas.  Returns the per-chunk permutations
    (None for the identity), or None where the layout is not of that form (interleaved: a gather)."""
    soc = sched.stage_of_chunk()
    D = sched.D
    if sched.num_model_stages != D:
        return None
    perms = []
    for c in range(soc.shape[1]):
        col = [int(v) for v in soc[:, c]]
        if sorted(col) != list(range(D)):
            return None
        perms.append(None if col == list(range(D)) else [(col[d], d) for d in range(D)])
    return perms


def eager_point(sched: Schedule, where=None):
    """For Chimera's eager reduction of the last stage alone: (tick after which its replica gradient is
    final, the device holding that replica, its chunk, the owner device) -- its entry in
    :func:`eager_points`."""
    owner = sched.D - 1
    for t, pairs in eager_points(sched, where):
        for src, dst in pairs:
            if dst == owner:
                return t, src, 1, dst
    raise ValueError(f"{sched.name}: the last stage's replica gradient is only final at the pipeline's end")


def eager_points(sched: Schedule, where=None):
    """Chimera §3.2's eager gradient synchronisation for every stage: ``[(tick, pairs)]`` -- after ``tick``
    the replica gradients of some stages are final (every backward of the stage has run, on both its
    devices), and ``pairs`` ``[(replica device, owner device)]`` send them home (chunk 1 -> chunk 0).  Grouped
    by tick, in order; a stage whose last backward is the pipeline's last tick has nothing to gain and is
    left to the final exchange."""
    soc = sched.stage_of_chunk()
    perms = exchange_perms(sched)
    if perms is None or soc.shape[1] != 2 or perms[1] is None:
        raise ValueError(f"{sched.name}: eager reduction needs two replicas of each stage (2 pipelines)")
    ticks = sched.ticks() if where is None else {k: v[0] for k, v in where.items()}
    last = "W" if sched.has_w() else "B"
    end = 1 + max(ticks.values())
    groups = {}
    for d in range(sched.D):
        st = int(soc[d, 1])
        t_s = 1 + max(t for (k, s_, m), t in ticks.items() if k == last and s_ == st)
        if t_s < end:
            groups.setdefault(t_s, []).append((d, int(np.nonzero(soc[:, 0] == st)[0][0])))
    return sorted((t, tuple(sorted(p))) for t, p in groups.items())


def stream_options(sched: Schedule) -> dict:
    """The schedule's choices the executor takes as fields (``make_stream_program``'s keywords): how ZB's W
    is computed (``w_from``), Chimera's eager reduction (``eager_reduce``) and one forward of a doubled batch
    (``double_batch``).  Read here, from the schedule's own options, so the runtime never reads them by
    key."""
    o = sched.options
    return {
        "w_from": o.get("w_from", "frontier"),
        "eager_reduce": bool(o.get("eager_reduce")),
        "double_batch": bool(o.get("double_batch")),
    }


def lane_plan(sched: Schedule, placement: str = "lanes"):
    """The lane plan the executor runs (:func:`jaxpipe.schedules.lanes.plan`), with a phase cut at each of
    Chimera's eager-reduction points (the executor exchanges the finished replica gradients between its scans
    there)."""
    p = plan(sched, placement)
    if sched.options.get("eager_reduce"):
        p = plan(sched, placement, cut=tuple(t for t, _ in eager_points(sched, p.where)))
    return p
