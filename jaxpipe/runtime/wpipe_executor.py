"""The no-flush executor of WPipe / 2GW (timeline: :mod:`jaxpipe.schedules.wpipe`).

One ``shard_map`` program per call, a ``lax.scan`` over 4M ticks (one batch).  Device ``d`` holds two
chunks: G0's partition ``d`` (chunk 0, with two versions: current and shadow) and G1's partition ``D + d``
(chunk 1, one version), each with its own optimizer state and gradient accumulator (``lp_c = (w_c, pre,
post)``; only device 0's ``pre`` and device D-1's ``post`` are trained, as in the asynchronous executor).
At tick ``t`` device ``d`` runs the down op (a forward) of stream unit ``(t - d) / 2`` or the up op (a
backward) of unit ``(t - 2D + 1 + d) / 2`` (read from :func:`jaxpipe.schedules.wpipe.period_table`, the
timeline the pictures draw); forwards go to ``d + 1`` and backwards to ``d - 1`` the next
tick, except the two wrap-around messages (G0 -> G1 activation on device 0, G1 -> G0 gradient on device
D - 1), which wait 2M - D ticks in a buffer indexed by micro-batch.  A group's update lands on a device after
its backward of the batch's last micro-batch there: G1's is read by the next batch's forwards, G0's only by
the batch after next (the shadow keeps the previous version for the backwards in between).

Tied arrays (``jaxpipe.tying``) are held once, in device 0's G0 ``pre``, and follow G0's rule: a batch reads
the G0 version of them that device 0's forwards read, carried with G0's forward messages to device D - 1
(kept there per batch parity for its G1 forwards), and their head gradient, summed over the batch on device
D - 1, travels back with G0's backward message of the batch's last micro-batch into device 0's G0
accumulator before G0's update lands.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from ..model import microbatch_key
from ..schedules import wpipe as wpipe_schedule
from ..tying import Ties
from .common import cast, full, pmean_over, ppermute_bits, psum_over, read, where, write
from .stage import StageOps
from ..axes import AXES, DATA, DP_AXES, PIPE, STAGE

ALL = AXES


class WPipeCarry(NamedTuple):
    stash0: Any     # G0 residuals, slot (batch mod 2) * M + j (slot 2M: scratch)
    stash1: Any     # G1 residuals, slot j (slot M: scratch)
    recv_f: Any     # forward message from d - 1 (consumed the next tick)
    recv_b: Any     # backward message from d + 1
    bnd_f: Any      # device 0: G0 -> G1 activations from device D - 1, slot j
    bnd_b: Any      # device D - 1: G1 -> G0 gradients from device 0, slot j
    dy_own: Any     # device D - 1: dL/dy of the last F1 (its B1 is the next tick)
    gpost: Any      # device D - 1: the head's gradient of that micro-batch
    ring: Any       # the device's micro-batches of the last two batches, [2, M, ...]
    tie_f: Any = ()  # tied arrays: G0's version, received with recv_f
    tie_b: Any = ()  # their head gradient summed over a batch, received with recv_b
    tie_v: Any = ()  # device D - 1: G0's version of batch b, slot b mod 2 (read by its G1 forwards)
    gtie: Any = ()   # device D - 1: the head gradient of batch b so far, slot b mod 2
    cnt_b: Any = 0.0     # (sum, count) losses: a micro-batch's global count, received with recv_b
    cnt_own: Any = 0.0   # device D - 1: the count of the last F1's micro-batch
    bnd_cnt: Any = 0.0   # device D - 1: counts of the G1 -> G0 wrap-around, slot j (slot M: scratch)
    cnt_acc: Any = 0.0   # [2]: each group's count of the batch it accumulates


def apc_pack(x):
    """WPipe's automatic precision compression (appendix A.3, Figure 12), for one message: every floating leaf
    divided by a power-of-2 scaler and sent as float16 with it.  The scaler 2^e is chosen from the leaf's
    largest magnitude so that the quotient stays below 2^14: the conversion cannot overflow, so the paper's
    full-precision fallback never triggers for finite values (a non-finite leaf stays non-finite, as in
    float32).  What is lost: the float16 mantissa (11 bits) and values below 2^(e - 24)."""
    def one(a):
        if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype.itemsize <= 2:
            return a, jnp.zeros((), jnp.float32)
        m = jnp.max(jnp.abs(a)).astype(jnp.float32)
        e = jnp.where(jnp.isfinite(m) & (m > 0), jnp.ceil(jnp.log2(jnp.where(m > 0, m, 1.0))) - 14.0, 0.0)
        return (a * jnp.exp2(-e).astype(a.dtype)).astype(jnp.float16), e
    leaves, tdef = jax.tree.flatten(x)
    packed = [one(a) for a in leaves]
    return tdef.unflatten([q for q, _ in packed]), tdef.unflatten([e for _, e in packed])


def apc_unpack(packed, like):
    """The receiver's side of :func:`apc_pack`: back to the original dtypes of ``like``, times the scaler."""
    payload, e = packed
    return jax.tree.map(lambda q, s, a: q if q.dtype == a.dtype else (q.astype(a.dtype) * jnp.exp2(s).astype(a.dtype)),
                        payload, e, like)


def make_wpipe_fn(model, opt, D: int, M: int, mesh, mb_example, nan_bubbles: bool = False, seed: int = 0,
                  apc: bool = False):
    """``fn(lps, opt_states, shadow0, versions, accs, errors, carry, counters, batch, feed)``: 4M ticks.
    ``apc``: activations and gradients travel compressed (:func:`apc_pack`)."""
    pre = model.pre
    w_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), model.stage_params)
    x_aval = jax.eval_shape(pre, model.pre_params, mb_example)
    y_aval = model.stage_output_aval(w_example, x_aval, mb_example)
    model.check_activation(x_aval, y_aval)
    # (sum, count) losses: gradients of the sums accumulate, and each micro-batch's global count travels back
    # with dL/dy (and through the wrap-around) so that each group divides its batch sum by the batch's count
    summed = model.reduction(y_aval, mb_example) == "sum"
    T = 4 * M
    # a call runs 4M ticks from a multiple of 4M; the scan is cut where every device has finished G1's last
    # backward of the previous batch (tick offset 2D - 3 - d) and none has started G1's next forward (2M + d)
    cut = 2 * D - 2
    ties = Ties(model)
    tie_avals = ties.pre_leaves(model.pre_params)

    def body(lps, oss, shadow0, versions, accs, errors, carry, counters, batch, feed):
        sq = lambda t: jax.tree.map(lambda a: a[0], t)
        lps, oss, shadow0, versions, accs, errors, c = map(sq, (lps, oss, shadow0, versions, accs, errors, carry))
        t0, base, n_fed = counters
        me = lax.axis_index(STAGE)
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        ops, _ = StageOps.build(model, lps[0][0], full(x_aval, 0),
                                jax.tree.map(lambda a: a[0], batch))
        replica = lax.axis_index(PIPE) * mesh.shape[DATA] + lax.axis_index(DATA)
        c = c._replace(ring=jax.tree.map(lambda r, b: write(r, (base + n_fed) % 2, b), c.ring, batch))
        n_fed = n_fed + feed.astype(jnp.int32)
        zx = full(x_aval, 0)
        zeros = lambda t: jax.tree.map(jnp.zeros_like, t)

        def mb_of(c, gb, j):
            return jax.tree.map(lambda a: read(read(a, gb % 2), j), c.ring)

        def land(g, st, n):
            """The update of group g after its last backward of a batch on this device (G0 keeps the
            version it replaces as the shadow); ``n``: the batch's count of a (sum, count) loss."""
            lps, oss, shadow0, versions, accs = st
            if g == 0:
                shadow0 = lps[0]
            acc = jax.tree.map(lambda a: a / (n.astype(a.dtype) if summed else M), accs[g])
            u, o = opt.update(acc, oss[g], lps[g])
            new = optax.apply_updates(lps[g], u)
            lps = (new, lps[1]) if g == 0 else (lps[0], new)
            oss = (o, oss[1]) if g == 0 else (oss[0], o)
            accs = (zeros(accs[0]), accs[1]) if g == 0 else (accs[0], zeros(accs[1]))
            return lps, oss, shadow0, versions.at[g].add(1), accs

        def choice(st, g, gb, err):
            """Which stored version the op reads -- 0: G0's current, 1: G0's shadow, 2: G1 -- and the count
            of version-read errors (a version the timeline says must be there and is not)."""
            _, _, _, versions, _ = st
            v = jnp.maximum(gb - 1, 0)
            cur = versions[0] == v
            err0 = err + (~cur & (versions[0] - 1 != v)).astype(jnp.int32)
            err1 = err + (versions[1] != gb).astype(jnp.int32)
            return jnp.where(g == 1, 2, jnp.where(cur, 0, 1)), jnp.where(g == 1, err1, err0)

        def fwd_variant(k, flag):
            # k: the version read (G0 current / G0 shadow / G1); flag: device 0's pre on G0, device D-1's
            # loss on G1.  Small outputs only: message, residuals, dL/dy, head gradient, loss.
            g = 1 if k == 2 else 0

            def op(cands, x_f, x_bnd, mb, ctx, t_f, t_v):
                w, pre_p, post_p = cands[k]
                if g == 0:
                    x = x_f
                else:
                    x = x_bnd if D == 1 else where(me == 0, x_bnd, x_f)
                # tied arrays: G0's version of this batch (device 0's own; others receive it with x_f)
                t_mine = ties.pre_leaves(pre_p) if (g == 0 and flag) else (t_f if g == 0 else t_v)
                y, res, head = ops.forward(w, x, mb, pre_p, ties.post_with(post_p, t_mine),
                                           first=g == 0 and flag, last=g == 1 and flag, ctx=ctx)
                if head is not None:
                    l, n, gq, dy = head
                    gq, gt = ties.take_post(gq)
                    n_glob = jnp.zeros((), jnp.float32)
                    if summed:          # the metric: this micro-batch's exact mean over every replica
                        n_glob = psum_over(n, mesh, DP_AXES).astype(jnp.float32)
                        l = psum_over(l, mesh, DP_AXES) / n_glob
                    return zeros(zx), res, cast(dy, x_aval), gq, l.astype(jnp.float32), t_mine, gt, n_glob
                return (cast(y, x_aval), res, zx, zeros(post_p), jnp.zeros((), jnp.float32),
                        cast(t_mine, tie_avals), zeros(tie_avals), jnp.zeros((), jnp.float32))
            return op

        def bwd_variant(k):
            def op(cands, res, dy):
                return ops.backward(cands[k][0], res, dy)
            return op

        fwd_variants = [fwd_variant(k, f) for k in range(3) for f in (False, True)]
        bwd_variants = [bwd_variant(k) for k in range(3)]

        def f_lane(gb, j, g, flag, st, c, err, loss):
            lps, _, shadow0, _, _ = st
            k, err = choice(st, g, gb, err)
            mb = mb_of(c, gb, j)
            # micro-batch j of batch gb on model stage g D + me: the synchronous schedules' keys
            ctx = ops.context(mb, microbatch_key(seed, gb, replica * M + j), g * D + me)
            send, res, dy, gq, l, t_mine, gt, cnt = lax.switch(
                2 * k + flag.astype(jnp.int32), fwd_variants, (lps[0], shadow0, lps[1]), c.recv_f,
                read(c.bnd_f, j), mb, ctx, c.tie_f, read(c.tie_v, gb % 2))
            s0 = jnp.where(g == 0, (gb % 2) * M + j, 2 * M)         # the other group's write: scratch slot
            s1 = jnp.where(g == 1, j, M)
            loss_here = (g == 1) & flag
            c = c._replace(stash0=[write(a, s0, r) for a, r in zip(c.stash0, res)],
                           stash1=[write(a, s1, r) for a, r in zip(c.stash1, res)],
                           dy_own=where(loss_here, dy, c.dy_own),
                           gpost=jax.tree.map(lambda n, o: jnp.where(loss_here, n, o), gq, c.gpost),
                           cnt_own=jnp.where(loss_here, cnt, c.cnt_own))
            if ties:
                # device D - 1 keeps G0's version of batch gb for its G1 forwards and sums the head gradient
                so_far = jax.tree.map(lambda a, n: jnp.where(j == 0, n, a + n), read(c.gtie, gb % 2), gt)
                c = c._replace(tie_v=write(c.tie_v, jnp.where((g == 0) & (me == D - 1), gb % 2, 2), t_mine),
                               gtie=write(c.gtie, jnp.where(loss_here, gb % 2, 2), so_far))
            loss = (loss[0] + jnp.where(loss_here, l, 0.0), loss[1] + loss_here.astype(jnp.int32))
            return c, err, loss, (send, t_mine)

        def f_idle(gb, j, g, flag, st, c, err, loss):
            return c, err, loss, (junk, junk_tie)

        def b_lane(gb, j, g, flag, st, c, err):
            lps, oss, sh0, versions, accs = st
            k, err = choice(st, g, gb, err)
            r0 = [read(a, (gb % 2) * M + j) for a in c.stash0]
            r1 = [read(a, j) for a in c.stash1]
            res = [jnp.where(g == 0, a, b) for a, b in zip(r0, r1)]
            dy1 = where(flag, c.dy_own, c.recv_b)
            dy0 = read(c.bnd_b, j) if D == 1 else where(me == D - 1, read(c.bnd_b, j), c.recv_b)
            dw, dx = lax.switch(k, bwd_variants, (lps[0], sh0, lps[1]), res, where(g == 0, dy0, dy1))
            cnt1 = jnp.where(flag, c.cnt_own, c.cnt_b)          # the count travels like dL/dy
            cnt0 = read(c.bnd_cnt, j) if D == 1 else jnp.where(me == D - 1, read(c.bnd_cnt, j), c.cnt_b)
            cnt = jnp.where(g == 0, cnt0, cnt1)
            cnt_acc = c.cnt_acc.at[g].add(cnt)
            dx = cast(dx, x_aval)
            pre_p = jax.tree.map(lambda a, b: jnp.where(k == 1, b, a), lps[0][1], sh0[1])   # the version read
            dpre = zeros(pre_p)
            # tied arrays' head gradient of batch gb: leaves device D - 1 with G0's backward of the last
            # micro-batch (zero with the others), joins device 0's G0 gradient
            last_b0 = (g == 0) & (j == M - 1)
            own = jax.tree.map(lambda a: jnp.where(last_b0, a, jnp.zeros_like(a)), read(c.gtie, gb % 2))
            t_grad = where(me == D - 1, own, c.tie_b)
            if jax.tree.leaves(pre_p):
                dpre = lax.cond((g == 0) & flag,
                                lambda: ties.add_to_pre(ops.pre_grad(pre_p, mb_of(c, gb, j), dx), t_grad),
                                lambda: zeros(pre_p))
            dpost = jax.tree.map(lambda a: jnp.where((g == 1) & flag, a, jnp.zeros_like(a)), c.gpost)
            # (sum, count): sums over replicas, divided by the batch's count when the group lands
            grad = (psum_over if summed else pmean_over)((dw, dpre, dpost), mesh, DP_AXES)
            # one cond per group: each output slot is either its operand or a new value (no copies)
            add = lambda a: jax.tree.map(jnp.add, a, grad)
            accs = (lax.cond(g == 0, add, lambda a: a, accs[0]), lax.cond(g == 1, add, lambda a: a, accs[1]))
            st = (lps, oss, sh0, versions, accs)
            return st, err, (where((g == 0) & flag, zeros(dx), dx), t_grad, cnt), cnt_acc

        def b_idle(gb, j, g, flag, st, c, err):
            return st, err, (junk, junk_tie, junk_cnt), c.cnt_acc

        junk = full(x_aval, jnp.nan) if nan_bubbles else zx
        junk_tie = full(tie_avals, jnp.nan if nan_bubbles else 0)
        junk_cnt = jnp.full((), jnp.nan if nan_bubbles else 0, jnp.float32)

        table = jnp.asarray(wpipe_schedule.period_table(D, M))

        def role(t, d):
            """(active, down, group, batch, micro-batch, flag, sends) of device ``d``'s op at tick ``t``, read from
            the timeline's table; every device can compute any device's, so messages carry no indices or flags
            (each would be one more collective-permute -- a rendezvous of every device -- per tick)."""
            row = table[jnp.mod(t, T), d]
            even, g, j = row[0] == 1, row[1], row[3]
            b = jnp.floor_divide(t, T) + row[2]            # forwards: G0's is the next batch's
            active = (b >= 0) & (b < n_fed)
            flag = jnp.where(g == 0, d == 0, d == D - 1)     # pre on G0's first, loss on G1's last
            sends = active & jnp.where(even, ~((g == 1) & flag), ~((g == 0) & flag))
            return active, even, g, b, j, flag, sends

        def tick(s, t):
            st, c, err, loss = s
            active, even, g, b, j, flag, _ = role(t, me)
            gb = base + b
            # F lane and B lane: predicate conds around small switches (docs/design.md §2); one op per tick
            c, err, loss, mf = lax.cond(active & even, f_lane, f_idle, gb, j, g, flag, st, c, err, loss)
            st, err, mb_, cnt_acc = lax.cond(active & ~even, b_lane, b_idle, gb, j, g, flag, st, c, err)
            c = c._replace(cnt_acc=cnt_acc)
            # forwards travel d -> d + 1, backwards d -> d - 1; the wrap-arounds land in the buffers
            fwd_pairs, bwd_pairs = [(d, (d + 1) % D) for d in range(D)], [(d, (d - 1) % D) for d in range(D)]
            if apc:      # the activation and the gradient travel compressed; ties and counts as they are
                rf = apc_unpack(lax.ppermute(apc_pack(mf[0]), STAGE, fwd_pairs), mf[0])
                rb = apc_unpack(lax.ppermute(apc_pack(mb_[0]), STAGE, bwd_pairs), mb_[0])
                tf = lax.ppermute(mf[1], STAGE, fwd_pairs)
                tb, cb = lax.ppermute(mb_[1:], STAGE, bwd_pairs)
            else:        # float messages as their bits: exact, and faster on XLA CPU (ppermute_bits)
                rf, tf = ppermute_bits(mf, STAGE, fwd_pairs)
                rb, tb, cb = ppermute_bits(mb_, STAGE, bwd_pairs)
            _, f_down, _, _, jf, _, f_sends = role(t, jnp.mod(me - 1, D))      # what arrived, and for which
            _, b_down, _, _, jb, _, b_sends = role(t, jnp.mod(me + 1, D))      # micro-batch
            of, ob = f_sends & f_down, b_sends & ~b_down
            at0, atl = me == 0, me == D - 1
            # buffers are written in place, into slot M (scratch) when nothing arrived for them: a select of
            # the whole buffer would copy it every tick
            c = c._replace(
                recv_f=where(of & ~at0, rf, c.recv_f), tie_f=where(of & ~at0, tf, c.tie_f),
                tie_b=where(ob & ~atl, tb, c.tie_b), cnt_b=jnp.where(ob & ~atl, cb, c.cnt_b),
                bnd_cnt=write(c.bnd_cnt, jnp.where(ob & atl, jb, M), cb),
                bnd_f=write(c.bnd_f, jnp.where(of & at0, jf, M), rf),
                recv_b=where(ob & ~atl, rb, c.recv_b),
                bnd_b=write(c.bnd_b, jnp.where(ob & atl, jb, M), rb))
            return (st, c, err, loss), None

        loss0 = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        st = (lps, oss, shadow0, versions, accs)
        # the groups land between the scans, not in them (a landing conditional in the scan made XLA copy the
        # weights every tick it was compiled in): call k completes batch k - 1 of both groups -- G1's last
        # backward at tick 2D - 3 - d, before the cut at 2D - 2 and before G1's first forward of batch k + 1
        # (2M + d, next call); G0's within the call, and G0's next version is read from call k + 1 on
        s_ = (st, c, errors, loss0)
        bk = t0 // T - 1
        landing = (bk >= 0) & (bk < n_fed)
        for a, b in ((0, cut), (cut, T)):
            if b > a:
                s_, _ = lax.scan(tick, s_, t0 + jnp.arange(a, b, dtype=jnp.int32))
            st, c, errors, loss = s_
            g = 1 if b == cut else 0
            st = lax.cond(landing, lambda s: land(g, s, c.cnt_acc[g]), lambda s: s, st)
            c = c._replace(cnt_acc=jnp.where(landing, c.cnt_acc.at[g].set(0.0), c.cnt_acc))
            s_ = (st, c, errors, loss)
        st, c, errors, (lsum, lcount) = s_
        lps, oss, shadow0, versions, accs = st
        lsum, lcount = lax.psum((lsum, lcount), STAGE)
        lsum = pmean_over(lsum, mesh, DP_AXES)
        lcount = lax.pmax(lcount, DP_AXES)
        ex = lambda t: jax.tree.map(lambda a: a[None], t)
        return (ex(lps), ex(oss), ex(shadow0), ex(versions), ex(accs), ex(errors), ex(c),
                (t0 + T, base, n_fed), (lsum, lcount))

    stage = lambda t: jax.tree.map(lambda _: P(STAGE), t)
    dev = lambda t: jax.tree.map(lambda _: P(ALL), t)
    rep = lambda t: jax.tree.map(lambda _: P(), t)

    def fn(lps, oss, shadow0, versions, accs, errors, carry, counters, batch, feed):
        args = (lps, oss, shadow0, versions, accs, errors)
        in_specs = tuple(stage(a) for a in args) + (dev(carry), rep(counters),
                                                     jax.tree.map(lambda _: P(DP_AXES), batch), P())
        out_specs = tuple(stage(a) for a in args) + (dev(carry), rep(counters), (P(), P()))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
            *args, carry, counters, batch, feed)

    return fn, x_aval


def empty_carry(model, D: int, M: int, n_devices: int, mb_example, x_aval, res_avals,
                nan_bubbles: bool = False) -> WPipeCarry:
    """The in-flight state of an empty pipeline; with ``nan_bubbles`` every float buffer starts NaN."""
    def per(shape, dtype):
        fill = jnp.nan if nan_bubbles and jnp.issubdtype(dtype, jnp.floating) else 0
        return jnp.full((n_devices,) + tuple(shape), fill, dtype)
    msg = lambda lead: jax.tree.map(lambda a: per(tuple(lead) + tuple(a.shape), a.dtype), x_aval)
    tied = lambda lead: jax.tree.map(lambda a: per(tuple(lead) + jnp.shape(a), jnp.asarray(a).dtype),
                                     Ties(model).pre_leaves(model.pre_params))
    return WPipeCarry(
        stash0=[per((2 * M + 1,) + tuple(a.shape), a.dtype) for a in res_avals],     # + a scratch slot
        stash1=[per((M + 1,) + tuple(a.shape), a.dtype) for a in res_avals],
        recv_f=msg(()), recv_b=msg(()), bnd_f=msg((M + 1,)), bnd_b=msg((M + 1,)), dy_own=msg(()),
        gpost=jax.tree.map(lambda a: per(jnp.shape(a), jnp.asarray(a).dtype), Ties(model).strip(model.params)[2]),
        ring=jax.tree.map(lambda a: per((2, M) + tuple(a.shape), a.dtype), mb_example),
        tie_f=tied(()), tie_b=tied(()), tie_v=tied((3,)), gtie=tied((3,)),      # slot 2: scratch
        cnt_b=per((), jnp.float32), cnt_own=per((), jnp.float32), bnd_cnt=per((M + 1,), jnp.float32),
        cnt_acc=jnp.zeros((n_devices, 2), jnp.float32))
