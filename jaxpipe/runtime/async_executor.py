"""The no-flush executor of the asynchronous 1F1B family (PipeDream, PipeDream-2BW, SpecTrain, PipeOptim).

One ``shard_map`` program per call, a ``lax.scan`` over lockstep ticks.  The schedule is the steady-state
1F1B of PipeOptim Fig. 1(d)-(e) with one op per device per tick: stage ``s`` runs F of micro-batch ``i``
(counted from the last (re)start) at tick ``2i + s`` and B of it at tick ``2i + 2D - 1 - s``; F and B ticks
never collide (opposite parity) and every message is consumed the tick after it is sent, so the wire is one
activation each way.  Nothing flushes between calls: the train state carries the stashed residuals, the
messages on the wire, the last stage's dL/dy, the recent micro-batches (stage 0 and D-1 need them for the
embedding's backward and the loss) and each stage's weights, optimizer state and policy state.
``step`` feeds M micro-batches and runs 2M ticks; ``drain`` runs the 2D - 1 ticks that finish everything
in flight.  Each stage updates its own weights with the wrapped optax optimizer when its policy says so
(``jaxpipe.optim.policies``), after averaging the micro-batch gradient over ``pipe`` x ``data``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from .executor import DP_AXES, rebuild_pullback, read, residual_mask, split_residuals, write

ALL = ("pipe", "data", "stage")


class AsyncCarry(NamedTuple):
    """Per-device in-flight state (leading axis: one entry per device, sharded over all mesh axes)."""
    stash: Any       # list of [D, ...] residual buffers (slot i mod D)
    recv_f: Any      # activation received from the previous stage last tick
    recv_b: Any      # gradient received from the next stage last tick
    dy_own: Any      # last stage: dL/dy of the micro-batch whose F ran last tick
    gpost: Any       # last stage: head gradient of that micro-batch (applied with its B)
    ring: Any        # the recent micro-batches, slot i mod (M + D)


def ring_capacity(M: int, D: int) -> int:
    return M + D


def op_at(t, me, D: int, n_fed):
    """(is_f, is_b, i) of device ``me`` at tick ``t`` (relative to the last (re)start)."""
    i_f = (t - me) // 2
    i_b = (t - 2 * D + 1 + me) // 2
    even = (t - me) % 2 == 0
    is_f = even & (i_f >= 0) & (i_f < n_fed)
    is_b = ~even & (i_b >= 0) & (i_b < n_fed)
    return is_f, is_b, jnp.where(even, i_f, i_b)


def make_async_fn(model, policy, opt, D: int, M: int, mesh, mb_example):
    """``fn(params, opt_state, policy_state, carry, counters, batch, feed) -> (same..., metrics)``: 2M ticks.

    ``feed`` (traced bool): whether ``batch``'s M micro-batches enter the pipeline; ``drain`` calls the same
    program with ``feed=False`` (the batch is then written to ring slots no micro-batch in flight uses), so
    one compiled program serves both.

    ``params = (w [D..], pre [D..], post [D..])`` per stage (pre/post: each stage's copy); ``counters =
    (t, base, n_fed)`` int32 scalars: tick since the last (re)start, global index of the first micro-batch
    since then, micro-batches fed since then.  ``mb_example``: one micro-batch per data replica.
    """
    stage_fn, pre, post_loss = model.stage_fn, model.pre, model.post_loss
    C = ring_capacity(M, D)
    w_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), model.stage_params)
    x_aval = jax.eval_shape(pre, model.pre_params, mb_example)
    model.check_activation(x_aval, jax.eval_shape(stage_fn, w_example, x_aval))
    positions = {(me == 0, me == D - 1) for me in range(D)}
    flags = [(False, False), (True, False), (False, True), (True, True)]
    used = [0] + [1 + k for k, f in enumerate(flags) if f in positions] + \
        [5 + k for k, f in enumerate(flags) if f in positions]
    remap = np.zeros(9, np.int32)
    remap[used] = np.arange(len(used))

    num_ticks = 2 * M

    def body(params, opt_state, pstate, carry, counters, batch, feed):
        sq = lambda t: jax.tree.map(lambda a: a[0], t)
        lp, opt_state, pstate, carry = sq(params), sq(opt_state), sq(pstate), sq(carry)
        t0, base, n_fed = counters
        me = lax.axis_index("stage")
        mask, avals = residual_mask(stage_fn, lp[0], jnp.zeros(x_aval.shape, x_aval.dtype))
        if len(avals) != len(carry.stash):
            raise RuntimeError(f"stage_fn's pullback stashes {len(avals)} residuals inside the program but "
                               f"{len(carry.stash)} were allocated; stage_fn must trace the same way every time")
        # this call's micro-batches go to ring slots (base + n_fed + j) mod C; counted only when fed
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        ring = lax.fori_loop(0, M, lambda j, r: jax.tree.map(
            lambda rb, b: write(rb, (base + n_fed + j) % C, b[j]), r, batch), carry.ring)
        n_fed = n_fed + M * feed.astype(jnp.int32)
        carry = carry._replace(ring=ring)
        zero_like = lambda t: jax.tree.map(jnp.zeros_like, t)

        def mb_of(i):
            return jax.tree.map(lambda a: read(a, (base + i) % C), carry.ring)

        def fwd(first, last):
            def op(i, st):
                lp, opt_state, pstate, c, loss = st
                gi = base + i
                wF, pstate = policy.forward_weights(lp, pstate, gi, me)
                w, pre_p, post_p = wF
                mb = mb_of(i) if (first or last) else None
                x = pre(pre_p, mb) if first else c.recv_f
                y, res, _, _ = split_residuals(stage_fn, w, x, mask)
                stash = [write(a, gi % D, r) for a, r in zip(c.stash, res)]
                send = y.astype(x_aval.dtype)
                c = c._replace(stash=stash)
                if last:
                    l, (gq, dy) = jax.value_and_grad(post_loss, argnums=(0, 1))(post_p, y, mb)
                    c = c._replace(dy_own=dy.astype(x_aval.dtype), gpost=gq)
                    loss = (loss[0] + l.astype(jnp.float32), loss[1] + 1)
                    send = jnp.zeros_like(send)
                return (lp, opt_state, pstate, c, loss), send, jnp.zeros_like(send)
            return op

        def bwd(first, last):
            def op(i, st):
                lp, opt_state, pstate, c, loss = st
                gi = base + i
                w, pre_p, _ = policy.backward_weights(lp, pstate, gi, me)
                res = [read(a, gi % D) for a in c.stash]
                dy = c.dy_own if last else c.recv_b
                dw, dx = rebuild_pullback(stage_fn, w, jnp.zeros(x_aval.shape, x_aval.dtype), res, mask)(dy)
                dx = dx.astype(x_aval.dtype)
                dpre = zero_like(lp[1])
                if first:
                    mb = mb_of(i)
                    dpre = jax.vjp(lambda q: pre(q, mb), pre_p)[1](dx)[0]
                dpost = c.gpost if last else zero_like(lp[2])
                g = lax.pmean((dw, dpre, dpost), DP_AXES)
                lp, opt_state, pstate = policy.update(g, lp, opt_state, pstate, gi, me)
                send = jnp.zeros_like(dx) if first else dx
                return (lp, opt_state, pstate, c, loss), jnp.zeros_like(dx), send
            return op

        def idle(i, st):
            z = jnp.zeros(x_aval.shape, x_aval.dtype)
            return st, z, z

        branches = [idle] + [fwd(*f) for f in flags] + [bwd(*f) for f in flags]
        branches = [branches[k] for k in used]
        pos = (me == 0).astype(jnp.int32) + 2 * (me == D - 1).astype(jnp.int32)
        remap_j = jnp.asarray(remap)

        def tick(st, t):
            is_f, is_b, i = op_at(t, me, D, n_fed)
            br = jnp.where(is_f, 1 + pos, jnp.where(is_b, 5 + pos, 0))
            st, send_f, send_b = lax.switch(remap_j[br], branches, i, st)
            if D > 1:
                lp, opt_state, pstate, c, loss = st
                c = c._replace(recv_f=lax.ppermute(send_f, "stage", [(d, (d + 1) % D) for d in range(D)]),
                               recv_b=lax.ppermute(send_b, "stage", [(d, (d - 1) % D) for d in range(D)]))
                st = (lp, opt_state, pstate, c, loss)
            return st, None

        loss0 = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        st = (lp, opt_state, pstate, carry, loss0)
        st, _ = lax.scan(tick, st, t0 + jnp.arange(num_ticks, dtype=jnp.int32))
        lp, opt_state, pstate, carry, (lsum, lcount) = st
        lsum, lcount = lax.psum((lsum, lcount), "stage")
        lsum = lax.pmean(lsum, DP_AXES)
        lcount = lax.pmax(lcount, DP_AXES)
        ex = lambda t: jax.tree.map(lambda a: a[None], t)
        t1 = t0 + num_ticks
        done = jnp.clip((t1 - 2 * D + 1 + 1) // 2, 0, n_fed)   # B on stage 0 finished: micro-batch complete
        counters = (t1, base, n_fed)
        return ex(lp), ex(opt_state), ex(pstate), ex(carry), counters, (lsum, lcount, base + done)

    stage = lambda t: jax.tree.map(lambda _: P("stage"), t)
    dev = lambda t: jax.tree.map(lambda _: P(ALL), t)
    rep = lambda t: jax.tree.map(lambda _: P(), t)

    def fn(params, opt_state, pstate, carry, counters, batch, feed):
        in_specs = (stage(params), stage(opt_state), stage(pstate), dev(carry), rep(counters),
                    jax.tree.map(lambda _: P(DP_AXES), batch), P())
        out_specs = (stage(params), stage(opt_state), stage(pstate), dev(carry), rep(counters), (P(), P(), P()))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
            params, opt_state, pstate, carry, counters, batch, feed)

    return fn, x_aval


def empty_carry(model, D: int, M: int, n_devices: int, mb_example, x_aval, mask_avals):
    """The in-flight state of an empty pipeline, with a leading axis of one entry per device."""
    C = ring_capacity(M, D)
    per = lambda shape, dtype: jnp.zeros((n_devices,) + tuple(shape), dtype)
    return AsyncCarry(
        stash=[per((D,) + tuple(a.shape), a.dtype) for a in mask_avals],
        recv_f=per(x_aval.shape, x_aval.dtype), recv_b=per(x_aval.shape, x_aval.dtype),
        dy_own=per(x_aval.shape, x_aval.dtype),
        gpost=jax.tree.map(lambda a: per(jnp.shape(a), jnp.asarray(a).dtype), model.post_params),
        ring=jax.tree.map(lambda a: per((C,) + tuple(a.shape), a.dtype), mb_example))
