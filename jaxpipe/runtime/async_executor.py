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

from ..model import microbatch_key
from ..tying import Ties
from .common import cast, full, pmean_over, ppermute_bits, psum_over, read, where, write
from .stage import StageOps
from ..axes import AXES, DATA, DP_AXES, PIPE, STAGE

ALL = AXES


class AsyncCarry(NamedTuple):
    """Per-device in-flight state (leading axis: one entry per device, sharded over all mesh axes)."""
    stash: Any       # list of [D, ...] residual buffers (slot i mod D)
    recv_f: Any      # activation received from the previous stage last tick
    recv_b: Any      # gradient received from the next stage last tick
    dy_own: Any      # last stage: dL/dy of the micro-batch whose F ran last tick
    gpost: Any       # last stage: head gradient of that micro-batch (applied with its B)
    ring: Any        # the recent micro-batches, slot i mod (M + D)
    tie_f: Any = ()  # tied arrays (``jaxpipe.tying``): stage 0's version of them, received with recv_f
    tie_b: Any = ()  # their last-stage gradient, received with recv_b
    gtie: Any = ()   # last stage: that gradient of the micro-batch whose F ran last tick
    cnt_b: Any = 0.0   # (sum, count) losses in accumulating policies: the micro-batch's global count,
    cnt_own: Any = 0.0  # received with recv_b / on the last stage, of the micro-batch whose F ran last tick


def ring_capacity(M: int, periodic) -> int:
    """Recent micro-batches kept (stage 0's B needs its micro-batch for the embedding's backward, ``tick(B, 0,
    0) / period`` micro-batches after its F): M + D for the 2-tick pattern, M + 2D - 1 on lanes."""
    return M + periodic.tick("B", 0, 0) // periodic.period + 1


def op_at(t, me, table, period: int, n_fed, kind: int):
    """(runs, i): whether device ``me`` runs op ``kind`` (0: F, 1: B) at tick ``t`` (relative to the last
    (re)start) and of which micro-batch, read from the periodic schedule's table
    (``jaxpipe.schedules.periodic.Periodic.table``)."""
    off = table[t % period, me, kind]
    i = (t - off) // period
    return (off >= 0) & (t >= off) & (i < n_fed), i


def landing_segments(periodic, M: int, D: int):
    """The call's ticks cut into ``(start, stop, landing)`` scans so that only the ticks where some stage runs
    the B of a batch's last micro-batch compile the landing of an accumulating policy.  A call runs
    ``period * M`` ticks from a tick that is a multiple of that (calls feed M micro-batches each), so stage
    ``s`` lands at offset ``(tick(B, s, M - 1)) mod (period * M)`` of every call."""
    n = periodic.period * M
    offs = sorted({periodic.tick("B", s, M - 1) % n for s in range(D)})
    lo, hi = offs[0], offs[-1] + 1
    if hi - lo > n // 2:        # spread over the call: one scan that may land in every tick
        return [(0, n, True)]
    return [seg for seg in ((0, lo, False), (lo, hi, True), (hi, n, False)) if seg[1] > seg[0]]


def make_async_fn(model, policy, opt, D: int, M: int, mesh, mb_example, nan_bubbles: bool = False,
                  periodic=None, seed: int = 0):
    """``fn(params, opt_state, policy_state, carry, counters, batch, feed) -> (same..., metrics)``: 2M ticks.

    ``feed`` (traced bool): whether ``batch``'s M micro-batches enter the pipeline; ``drain`` calls the same
    program with ``feed=False`` (the batch is then written to ring slots no micro-batch in flight uses), so
    one compiled program serves both.

    ``params = (w [D..], pre [D..], post [D..])`` per stage (pre/post: each stage's copy); ``counters =
    (t, base, n_fed)`` int32 scalars: tick since the last (re)start, global index of the first micro-batch
    since then, micro-batches fed since then.  ``mb_example``: one micro-batch per data replica.
    """
    pre = model.pre
    if periodic is None:
        from ..schedules.periodic import no_flush_1f1b
        periodic = no_flush_1f1b(policy.name, D)
    C = ring_capacity(M, periodic)
    S = periodic.max_inflight()                 # stash slots: micro-batch i in slot i mod S
    w_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), model.stage_params)
    x_aval = jax.eval_shape(pre, model.pre_params, mb_example)
    y_aval = model.stage_output_aval(w_example, x_aval, mb_example)
    model.check_activation(x_aval, y_aval)
    summed = model.reduction(y_aval, mb_example) == "sum"
    n_dp = mesh.shape[PIPE] * mesh.shape[DATA]
    model_key = lambda step, mb: microbatch_key(seed, step, mb)
    # (sum, count) losses: per-micro-batch updaters scale each micro-batch at the loss by replicas / its global
    # count; accumulating policies (2BW, CDP) get unscaled sums, and each micro-batch's global count travels
    # back with dL/dy so that every stage divides its step's summed gradient by the step's count
    counting = summed and not policy.per_microbatch
    # forward variants by position (first, last); only the positions some device has are compiled
    ties = Ties(model)
    tie_avals = ties.pre_leaves(model.pre_params)
    flags = [(False, False), (True, False), (False, True), (True, True)]
    used_pos = sorted({int(d == 0) + 2 * int(d == D - 1) for d in range(D)})
    remap = np.zeros(4, np.int32)
    remap[used_pos] = np.arange(len(used_pos))

    period = periodic.period
    num_ticks = period * M
    b_first = periodic.tick("B", 0, 0)         # stage 0's backward of micro-batch 0: the pipeline's latency
    in_scan = policy.land is not None and not policy.land_at_call_end
    segments = landing_segments(periodic, M, D) if in_scan else [(0, num_ticks, False)]
    # calls after a batch's call in which every stage runs that batch's last backward (1 for D > 1, 0 at D = 1)
    lags = {(periodic.tick("B", s, M - 1)) // num_ticks for s in range(D)}
    if policy.land is not None and policy.land_at_call_end and len(lags) != 1:
        raise ValueError(f"{policy.name}: stages finish a batch in different calls ({sorted(lags)}); "
                         f"land in the scan instead")
    lag = lags.pop()

    def body(params, opt_state, pstate, carry, counters, batch, feed):
        sq = lambda t: jax.tree.map(lambda a: a[0], t)
        lp, opt_state, pstate, carry = sq(params), sq(opt_state), sq(pstate), sq(carry)
        t0, base, n_fed = counters
        me = lax.axis_index(STAGE)
        sop, avals = StageOps.build(model, lp[0], full(x_aval, 0),
                                    jax.tree.map(lambda a: a[0], carry.ring))
        replica = lax.axis_index(PIPE) * mesh.shape[DATA] + lax.axis_index(DATA)
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

        pos = (me == 0).astype(jnp.int32) + 2 * (me == D - 1).astype(jnp.int32)
        blank = lambda: full(x_aval, jnp.nan if nan_bubbles else 0)
        blank_tie = lambda: full(tie_avals, jnp.nan if nan_bubbles else 0)
        x_like = lambda: full(x_aval, 0)

        def forward_at(first, last):
            # one position's forward on the weights the policy chose: small outputs only (message,
            # residuals, dL/dy and head gradient of the last stage, its loss)
            def op(wF, x_in, t_in, mb, ctx):
                w, pre_p, post_p = wF
                # tied arrays: the version stage 0 reads for this micro-batch, carried to the last stage
                t_mine = ties.pre_leaves(pre_p) if first else t_in
                y, res, head = sop.forward(w, x_in, mb, pre_p, ties.post_with(post_p, t_mine), first, last, ctx)
                if not last:
                    return (cast(y, x_aval), res, x_like(), zero_like(post_p), jnp.zeros((), jnp.float32),
                            cast(t_mine, tie_avals), zero_like(tie_avals), jnp.zeros((), jnp.float32))
                l, n, gq, dy = head
                gq, gt = ties.take_post(gq)
                n_glob = psum_over(n, mesh, DP_AXES).astype(jnp.float32) if summed else jnp.zeros((), jnp.float32)
                if counting:
                    l = psum_over(l, mesh, DP_AXES) / n_glob          # the metric: this micro-batch's exact mean
                elif summed:
                    # (sum, count): this micro-batch's loss over every replica's real tokens -- scaled here so
                    # that the pmean over replicas in B gives sum over replicas / global count
                    scale = n_dp / n_glob
                    l, gq, gt, dy = l * scale, *jax.tree.map(lambda g: g * scale.astype(g.dtype), (gq, gt, dy))
                return blank(), res, cast(dy, x_aval), gq, l.astype(jnp.float32), blank_tie(), gt, n_glob
            return op

        fwd_variants = [forward_at(*flags[k]) for k in used_pos]

        def f_lane(i, ops):
            # F lane (docs/design.md §2 lanes): a predicate cond around the position switch, so that nothing
            # big passes through a multi-way conditional (XLA copies such pass-throughs every tick)
            lp, pstate, c, loss = ops
            gi = base + i
            mb = mb_of(i)
            # global micro-batch gi is micro-batch gi mod M of step gi // M: the synchronous schedules' keys
            ctx = sop.context(mb, model_key(gi // M, replica * M + gi % M), me)
            if policy.choose is None:
                def fwd(wF):
                    return lax.switch(pos_j, fwd_variants, wF, c.recv_f, c.tie_f, mb, ctx)
                wF, pstate = policy.forward_weights(lp, pstate, gi, me)
                if policy.forward_is_current is None:
                    msg, res, dy, gq, l, t_out, gt, cnt = fwd(wF)
                else:        # stages predicting by 0 read lp itself: no weight-sized axpy
                    msg, res, dy, gq, l, t_out, gt, cnt = lax.cond(
                        policy.forward_is_current(me), lambda: fwd(lp),
                        lambda: fwd(policy.forward_weights(lp, pstate, gi, me)[0]))
            else:     # one branch per stored version and position: the chosen version is never copied
                k, cands = policy.choose(lp, pstate, gi, me)
                n = len(fwd_variants)
                brs = [(lambda w, v=v: (lambda cs, x, tx, m, cx: fwd_variants[v](cs[w], x, tx, m, cx)))(w)
                       for w in range(len(cands)) for v in range(n)]
                msg, res, dy, gq, l, t_out, gt, cnt = lax.switch(k * n + pos_j, brs, cands, c.recv_f, c.tie_f, mb,
                                                                 ctx)
            c = c._replace(stash=[write(a, gi % S, r) for a, r in zip(c.stash, res)],
                           dy_own=where(me == D - 1, dy, c.dy_own),
                           gpost=jax.tree.map(lambda n, o: jnp.where(me == D - 1, n, o), gq, c.gpost),
                           gtie=where(me == D - 1, gt, c.gtie), cnt_own=jnp.where(me == D - 1, cnt, c.cnt_own))
            last = (me == D - 1)
            loss = (loss[0] + jnp.where(last, l, 0.0), loss[1] + last.astype(jnp.int32))
            return (pstate, c, loss), (msg, t_out)

        def f_idle(i, ops):
            lp, pstate, c, loss = ops
            return (pstate, c, loss), (blank(), blank_tie())

        def b_lane(i, ops):
            lp, opt_state, pstate, c = ops
            gi = base + i
            res = [read(a, gi % S) for a in c.stash]
            dy = where(me == D - 1, c.dy_own, c.recv_b)
            pre_p = lp[1]
            if policy.choose is None and policy.backward_is_current is not None:
                pre_p = None         # stages predicting by 0 read lp itself: no weight-sized axpy
                dw, dx = lax.cond(policy.backward_is_current(me), lambda: sop.backward(lp[0], res, dy),
                                  lambda: sop.backward(policy.backward_weights(lp, pstate, gi, me)[0], res, dy))
            elif policy.choose is None:
                w, pre_p, _ = policy.backward_weights(lp, pstate, gi, me)
                dw, dx = sop.backward(w, res, dy)
            else:
                k, cands = policy.choose(lp, pstate, gi, me)
                pre_p = None
                brs = [(lambda v: (lambda cs, r, d: sop.backward(cs[v][0], r, d)))(v) for v in range(len(cands))]
                dw, dx = lax.switch(k, brs, cands, res, dy)
            dx = cast(dx, x_aval)
            dpre = zero_like(lp[1])
            # the tied arrays' last-stage gradient of this micro-batch, on its way to stage 0
            t_grad = where(me == D - 1, c.gtie, c.tie_b)
            if jax.tree.leaves(lp[1]):
                def pre_grad():
                    q0 = pre_p if pre_p is not None else policy.backward_weights(lp, pstate, gi, me)[1]
                    return ties.add_to_pre(sop.pre_grad(q0, mb_of(i), dx), t_grad)
                dpre = lax.cond(me == 0, pre_grad, lambda: zero_like(lp[1]))
            dpost = jax.tree.map(lambda g: jnp.where(me == D - 1, g, jnp.zeros_like(g)), c.gpost)
            cnt = jnp.where(me == D - 1, c.cnt_own, c.cnt_b)
            return (dw, dpre, dpost), (where(me == 0, blank(), dx), where(me == 0, blank_tie(), t_grad), cnt)

        def b_idle(i, ops):
            lp, opt_state, pstate, c = ops
            return zero_like((lp[0], lp[1], c.gpost)), (blank(), blank_tie(), jnp.full((), jnp.nan if nan_bubbles
                                                                                        else 0, jnp.float32))

        def b_apply(i, g, cnt, lp, opt_state, pstate):
            # the update, in a conditional of its own: one that also ran the backward (reading the weights
            # it then updates) made XLA copy the weights twice per tick (HLO-checked, BUILD_NOTES)
            gi = base + i
            if counting:        # sums over replicas; the policy divides the step's sum by the step's count
                return policy.update(psum_over(g, mesh, DP_AXES), lp, opt_state, pstate, gi, me, count=cnt)
            return policy.update(pmean_over(g, mesh, DP_AXES), lp, opt_state, pstate, gi, me)

        pos_j = jnp.asarray(remap)[pos]
        table = jnp.asarray(periodic.table())
        ring_f = [(d, (d + 1) % D) for d in range(D)]
        ring_b = [(d, (d - 1) % D) for d in range(D)]

        def tick(st, t, landing=True):
            is_f, i_f = op_at(t, me, table, period, n_fed, 0)
            is_b, i = op_at(t, me, table, period, n_fed, 1)
            lp, opt_state, pstate, c, loss = st
            (pstate, c, loss), send_f = lax.cond(is_f, f_lane, f_idle, i_f, (lp, pstate, c, loss))
            if D > 1:
                recv_f, tie_f = ppermute_bits(send_f, STAGE, ring_f)
                c = c._replace(recv_f=recv_f, tie_f=tie_f)
            g, send_b = lax.cond(is_b, b_lane, b_idle, i, (lp, opt_state, pstate, c))
            lp, opt_state, pstate = lax.cond(is_b, b_apply, lambda i, g, cnt, *a: a, i, g, send_b[2], lp,
                                             opt_state, pstate)
            if policy.apply_pending is not None:
                lp = lax.cond(is_b, policy.apply_pending, lambda lp, ps: lp, lp, pstate)
            if policy.land is not None and landing:
                lp, opt_state, pstate = lax.cond(is_b & policy.lands(base + i),
                                                 lambda *a: policy.land(*a, counting=counting, b=(base + i) // M),
                                                 lambda *a: a, lp, opt_state, pstate)
            if D > 1:
                recv_b, tie_b, cnt_b = ppermute_bits(send_b, STAGE, ring_b)
                c = c._replace(recv_b=recv_b, tie_b=tie_b, cnt_b=cnt_b)
            return (lp, opt_state, pstate, c, loss), None

        loss0 = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        st = (lp, opt_state, pstate, carry, loss0)
        for a, b, landing in segments:
            st, _ = lax.scan(lambda s_, t: tick(s_, t, landing), st, t0 + jnp.arange(a, b, dtype=jnp.int32))
        if policy.land is not None and policy.land_at_call_end:
            # the batch whose last backward ran in this call (``lag`` calls after it was fed) lands once
            lp, opt_state, pstate, c_, loss_ = st
            bk = t0 // num_ticks - lag
            lp, opt_state, pstate = lax.cond(
                (bk >= 0) & (bk * M < n_fed), lambda *a: policy.land(*a, counting=counting, b=base // M + bk),
                lambda *a: a, lp, opt_state, pstate)
            st = (lp, opt_state, pstate, c_, loss_)
        lp, opt_state, pstate, carry, (lsum, lcount) = st
        lsum, lcount = lax.psum((lsum, lcount), STAGE)
        lsum = pmean_over(lsum, mesh, DP_AXES)
        lcount = lax.pmax(lcount, DP_AXES)
        ex = lambda t: jax.tree.map(lambda a: a[None], t)
        t1 = t0 + num_ticks
        done = jnp.clip((t1 - b_first + period - 1) // period, 0, n_fed)   # B on stage 0 finished: micro-batch complete
        counters = (t1, base, n_fed)
        return ex(lp), ex(opt_state), ex(pstate), ex(carry), counters, (lsum, lcount, base + done)

    stage = lambda t: jax.tree.map(lambda _: P(STAGE), t)
    dev = lambda t: jax.tree.map(lambda _: P(ALL), t)
    rep = lambda t: jax.tree.map(lambda _: P(), t)

    def fn(params, opt_state, pstate, carry, counters, batch, feed):
        in_specs = (stage(params), stage(opt_state), stage(pstate), dev(carry), rep(counters),
                    jax.tree.map(lambda _: P(DP_AXES), batch), P())
        out_specs = (stage(params), stage(opt_state), stage(pstate), dev(carry), rep(counters), (P(), P(), P()))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
            params, opt_state, pstate, carry, counters, batch, feed)

    return fn, x_aval


def empty_carry(model, periodic, M: int, n_devices: int, mb_example, x_aval, mask_avals,
                nan_bubbles: bool = False):
    """The in-flight state of an empty pipeline, with a leading axis of one entry per device (``nan_bubbles``:
    residual and message buffers start NaN, so a test shows nothing unwritten reaches a result)."""
    C = ring_capacity(M, periodic)
    S = periodic.max_inflight()
    per = lambda shape, dtype: jnp.zeros((n_devices,) + tuple(shape), dtype)
    nan = lambda shape, dtype: jnp.full((n_devices,) + tuple(shape), jnp.nan if nan_bubbles else 0, dtype)
    msg = lambda: full(x_aval, jnp.nan if nan_bubbles else 0, (n_devices,))
    ties = Ties(model)
    tie_msg = lambda: full(ties.pre_leaves(model.pre_params), jnp.nan if nan_bubbles else 0, (n_devices,))
    return AsyncCarry(
        stash=[nan((S,) + tuple(a.shape), a.dtype) for a in mask_avals],
        recv_f=msg(), recv_b=msg(), dy_own=msg(),
        gpost=jax.tree.map(lambda a: per(jnp.shape(a), jnp.asarray(a).dtype), ties.strip(model.params)[2]),
        ring=jax.tree.map(lambda a: per((C,) + tuple(a.shape), a.dtype), mb_example),
        tie_f=tie_msg(), tie_b=tie_msg(), gtie=tie_msg(),
        cnt_b=jnp.full((n_devices,), jnp.nan if nan_bubbles else 0, jnp.float32),
        cnt_own=jnp.full((n_devices,), jnp.nan if nan_bubbles else 0, jnp.float32))
