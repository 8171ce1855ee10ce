"""The no-flush executor's in-flight state (``runtime/executor.py``): what a pipeline carries between
calls -- stashed residuals, messages on the wire, the last stage's dL/dy, recent micro-batches, wrap-around
buffers between chunks, a ring reduction's partial sums -- and its empty form, sized from the replayed stream
(:meth:`jaxpipe.schedules.periodic.Periodic.buffers`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..tying import Ties
from .buffers import fill_value, full


class AsyncCarry(NamedTuple):
    """Per-device in-flight state (leading axis: one entry per device, sharded over all mesh axes)."""

    stash: Any  # list of residual buffers: micro-batch g of chunk c in slot stash_offset[c] + g mod S[c]
    recv_f: Any  # activation received from the previous device last tick
    recv_b: Any  # gradient received from the next device last tick
    dy_own: Any  # last stage: dL/dy of the micro-batch whose F ran last
    gpost: Any  # last stage: head gradient of that micro-batch (applied with its B)
    ring: Any  # the recent micro-batches, slot g mod C
    tie_f: Any = ()  # tied arrays (``jaxpipe.tying``): stage 0's version of them, received with recv_f
    tie_b: Any = ()  # their last-stage gradient, received with recv_b
    gtie: Any = ()  # last stage: that gradient of the micro-batch whose F ran last
    cnt_b: Any = 0.0  # (sum, count) losses in accumulating policies: the micro-batch's global count,
    cnt_own: Any = 0.0  # received with recv_b / on the last stage, of the micro-batch whose F ran last
    wrap_f: Any = ()  # chunks > 1, device 0: (activation, tied arrays) from the last device, slot g mod C
    wrap_b: Any = ()  # chunks > 1, last device: (gradient, tie gradient, count) from device 0, slot g mod C
    errors: Any = 0  # reads of a weight version the policy no longer held (metric version_errors; stays 0)
    reduce: Any = ()  # a ring reduction's buffers (RingState): Cyclic DP's partial sums and broadcast
    #: a lane plan's stream: (messages, tied arrays, counts) in the plan's slots (last: scratch)
    mbuf: Any = ()
    front: Any = ()  # a split backward's frontiers during a call (beside the residuals; not carried)


class RingState(NamedTuple):
    """The ring reduction's buffers on one worker (each a chunk's local parameter set in shape)."""

    partial: Any  # [K + 1, ...]: the partial sum of chunk c from the previous worker (slot K: scratch)
    pcnt: Any  # [K + 1]: its count ((sum, count) losses)
    gbuf: Any  # the last sum this worker sent on (idle backward lanes resend it)
    gcnt: Any
    bnew: Any  # the stage the last worker sent last tick, to land now
    bchunk: Any  # its chunk
    bok: Any  # whether it is one (only the last worker's completed sums are)


def own_buffers(tree):
    """The arrays of ``tree``, built so XLA does not merge equal ones: identical broadcasts are merged (CSE)
    into one, and each loop-carried buffer then starts as a copy of it (a copy per stash leaf per call;
    BUILD_NOTES).  Empty and non-numeric leaves (typed PRNG keys) are left as they are."""
    arrays, treedef = jax.tree.flatten(tree)
    mine = [i for i, a in enumerate(arrays) if a.size and jnp.issubdtype(a.dtype, jnp.number)]
    fills = jax.lax.optimization_barrier([arrays[i].reshape(-1)[:1] for i in mine])
    out = list(arrays)
    for i, f in zip(mine, fills):
        out[i] = jnp.broadcast_to(f.reshape((1,) * out[i].ndim), out[i].shape)
    return jax.tree.unflatten(treedef, out)


def empty_carry(
    model,
    periodic,
    M: int,
    n_devices: int,
    mb_example,
    x_aval,
    mask_avals,
    nan_bubbles: bool = False,
    ring_lp=None,
    replicas: int = 1,
):
    """The in-flight state of an empty pipeline, with a leading axis of one entry per device (``nan_bubbles``:
    residual and message buffers start NaN, so a test shows nothing unwritten reaches a result).  ``ring_lp``:
    one chunk's local parameters (shapes), for a ring reduction's buffers; ``replicas``: data-parallel
    replicas (a delayed stream's last one finishes later)."""
    buf = periodic.buffers(M, periodic.replica_delay * (replicas - 1))
    C, S = buf["ring"], sum(buf["stash"])
    plan = periodic.plan
    if plan is not None:  # the plan's slots (an idle lane writes none: no scratch slot); the call
        S = max(plan.stash_capacity, 1)  # reads its own batch (one ring slot: the micro-batch's shapes)
        C = 1
        if plan.direct:  # F hands its residuals to the B of its tick: no stash
            mask_avals = []
    per = lambda shape, dtype: jnp.zeros((n_devices,) + tuple(shape), dtype)
    nan = lambda shape, dtype: jnp.full(
        (n_devices,) + tuple(shape), fill_value(jnp.nan if nan_bubbles else 0, dtype), dtype
    )
    msg = lambda lead=(): full(x_aval, jnp.nan if nan_bubbles else 0, (n_devices,) + tuple(lead))
    ties = Ties(model)
    tie_msg = lambda lead=(): full(
        ties.pre_leaves(model.pre_params), jnp.nan if nan_bubbles else 0, (n_devices,) + tuple(lead)
    )
    wrap_f = wrap_b = ()
    if periodic.chunks > 1:  # slot C: scratch (written where nothing arrives for the buffer)
        wrap_f = (msg((C + 1,)), tie_msg((C + 1,)))
        wrap_b = (msg((C + 1,)), tie_msg((C + 1,)), nan((C + 1,), jnp.float32))
    mbuf, sums = (), lambda dt: dt
    if plan is not None:  # post's gradient: a float32 sum over the call
        cap = plan.mbuf_capacity + 1
        mbuf = (msg((cap,)), tie_msg((cap,)), nan((cap,), jnp.float32))
        sums = lambda dt: jnp.promote_types(dt, jnp.float32)
    return AsyncCarry(
        stash=own_buffers([nan((S,) + tuple(a.shape), a.dtype) for a in mask_avals]),
        recv_f=msg(),
        recv_b=msg(),
        dy_own=msg(),
        mbuf=mbuf,
        gpost=jax.tree.map(
            lambda leaf: per(jnp.shape(leaf), sums(getattr(leaf, "dtype", None) or jnp.asarray(leaf).dtype)),
            ties.strip(model.params)[2],
        ),
        # the recent micro-batches: NaN-filled too (float fields), so an op reading a slot no feed wrote shows
        ring=jax.tree.map(lambda leaf: nan((C,) + tuple(leaf.shape), leaf.dtype), mb_example),
        tie_f=tie_msg(),
        tie_b=tie_msg(),
        gtie=tie_msg(),
        cnt_b=nan((), jnp.float32),
        cnt_own=nan((), jnp.float32),
        wrap_f=wrap_f,
        wrap_b=wrap_b,
        errors=jnp.zeros((n_devices,), jnp.int32),
        reduce=() if ring_lp is None else ring_buffers(ring_lp, periodic.chunks, n_devices, nan_bubbles),
    )


def ring_buffers(params, num_chunks: int, n_devices: int, nan_bubbles: bool = False) -> RingState:
    """A ring reduction's buffers, one per device (float buffers NaN in the NaN mode)."""
    fill = lambda shape, dtype: jnp.full(
        (n_devices,) + tuple(shape), fill_value(jnp.nan if nan_bubbles else 0, dtype), dtype
    )
    like = lambda lead: jax.tree.map(
        lambda leaf: fill(tuple(lead) + tuple(np.shape(leaf)), leaf.dtype), params
    )
    return RingState(
        partial=like((num_chunks + 1,)),
        pcnt=fill((num_chunks + 1,), jnp.float32),
        gbuf=like(()),
        gcnt=fill((), jnp.float32),
        bnew=like(()),
        bchunk=fill((), jnp.int32),
        bok=jnp.zeros((n_devices,), jnp.bool_),
    )
