"""The forward lanes of a tick (docs/design.md §2): a micro-batch's forward on the weights its policy
chose, the loss head on the last stage, Chimera §3.5's doubled forward, and what a forward writes into the
in-flight state.  Functions of the executor's :class:`~jaxpipe.runtime.program.Program` and
:class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from ..schedules.layout import ROUTE
from .common import F_OUT, cast, cond, read, write
from .call_base import (
    blank,
    blank_tie,
    candidate,
    choices,
    is_last,
    op_of,
    operands,
    per_chunk,
    pick,
    position,
    stage_of,
    x_like,
    zero_like,
)


def forward_at(prog, tr, first, last):
    # one position's forward on the weights the policy chose: small outputs only (message,
    # residuals, dL/dy and head gradient of the last stage, its loss)
    def op(wF, x_in, t_in, mb, ctx):
        w, pre_p, post_p = wF
        # tied arrays: the version stage 0 reads for this micro-batch, carried to the last stage
        t_mine = prog.ties.pre_leaves(pre_p) if first else t_in
        y, res, head = tr.sop.forward(
            w, x_in, mb, pre_p, prog.ties.post_with(post_p, t_mine), first, last, ctx
        )
        if not last:
            return (
                cast(y, prog.x_aval),
                res,
                x_like(prog, tr),
                zero_like(prog, tr, post_p),
                jnp.zeros((), jnp.float32),
                cast(t_mine, prog.tie_avals),
                zero_like(prog, tr, prog.tie_avals),
                jnp.zeros((), jnp.float32),
            )
        return head_out(prog, tr, res, head)

    return op


def head_out(prog, tr, res, head):
    """The last stage's outputs of one micro-batch's forward from its loss head."""
    l, n, gq, dy = head
    gq, gt = prog.ties.take_post(gq)
    return prog.grads.head(prog, tr, res, dy, gq, l, gt, n)


def double_at(prog, tr, first, last):
    """Chimera §3.5's forward doubling as one micro-batch of twice the size (``double_batch``): the pair's
    inputs concatenated along the batch axis, one stage forward, the output and the stashed residuals
    split back per micro-batch; the loss head runs per micro-batch.  Two forward outputs, as
    :func:`forward_at`'s."""

    def op(wF, xs, ts, mbs):
        w, pre_p, post_p = wF
        if first:
            xs = tuple(prog.model.pre(pre_p, mb) for mb in mbs)
            ts = (prog.ties.pre_leaves(pre_p),) * 2
        x = jax.tree.map(lambda a, b: jnp.concatenate([a, b], 0), *xs)
        y, res, _ = tr.sop.forward(w, x, None, pre_p, post_p, False, False, None)
        half = lambda t, k: jax.tree.map(lambda a: a[k * (a.shape[0] // 2) : (k + 1) * (a.shape[0] // 2)], t)
        outs = []
        for k in range(2):
            yk, rk = half(y, k), [half(r, k) for r in res]
            if last:
                outs.append(
                    head_out(prog, tr, rk, tr.sop.head(prog.ties.post_with(post_p, ts[k]), yk, mbs[k]))
                )
            else:
                outs.append(
                    (
                        cast(yk, prog.x_aval),
                        rk,
                        x_like(prog, tr),
                        zero_like(prog, tr, post_p),
                        jnp.zeros((), jnp.float32),
                        cast(ts[k], prog.tie_avals),
                        zero_like(prog, tr, prog.tie_avals),
                        jnp.zeros((), jnp.float32),
                    )
                )
        return tuple(outs)

    return op


def f_lane(prog, tr, c, g, slot, x_in, t_in, ops):
    # F lane (docs/design.md §2 lanes): a predicate cond around the position switch, so that nothing
    # big passes through a multi-way conditional (XLA copies such pass-throughs every tick)
    lps, pss, cr, loss = ops
    gi = tr.base + g
    mb = tr.mb_of(g)
    pos = pick(prog, tr, c, [jnp.asarray(prog.remap[cc])[position(prog, tr, cc)] for cc in range(prog.K)])
    # global micro-batch gi is micro-batch gi mod M of step gi // M on model stage c D + me: the
    # synchronous schedules' keys
    ctx = tr.sop.context(
        mb, prog.model_key(gi // prog.M, tr.replica * prog.M + gi % prog.M), stage_of(prog, tr, c)
    )
    if not prog.by_branch:
        policy, lp, ps = prog.policies[0], lps[0], pss[0]

        def fwd(wF):
            return lax.switch(pos, tr.variants[0], wF, x_in, t_in, mb, ctx)

        wF, ps = policy.forward_weights(lp, ps, gi, tr.me)
        pss = (ps,)
        if policy.forward_is_current is None:
            out = fwd(wF)
        else:
            # stages predicting by 0 read lp itself (no weight-sized axpy); the others predict inside
            # each position's branch, beside the forward that reads the prediction: made outside and
            # passed in, the predicted weights were materialised (spectrain 1.28-1.35x -> 1.19-1.24x of
            # micro_momentum, pipeoptim 0.95 -> 0.89x of micro_adamw, one-process A/B, BUILD_NOTES)
            def predicted(v):
                return lambda lp_, ps_, *a: tr.variants[0][v](
                    policy.forward_weights(lp_, ps_, gi, tr.me)[0], *a
                )

            out = lax.cond(
                policy.forward_is_current(tr.me),
                lambda: fwd(lp),
                lambda: lax.switch(
                    pos, [predicted(v) for v in range(len(tr.variants[0]))], lp, ps, x_in, t_in, mb, ctx
                ),
            )
    else:  # one branch per chunk, stored version and position: the chosen version is never copied
        ch = choices(prog, tr, g, *per_chunk(prog, tr, lps, pss))
        brs, start = [], []
        for cc, (_, cands) in enumerate(ch):
            start.append(len(brs))
            n = len(tr.variants[cc])
            brs += [
                (lambda cc, w, v: lambda cs, *a: tr.variants[cc][v](candidate(prog, tr, cs, cc, w), *a))(
                    cc, w, v
                )
                for w in range(len(cands))
                for v in range(n)
            ]
        k = pick(prog, tr, c, [kk for kk, _ in ch])
        idx = pick(prog, tr, c, [start[cc] + k * len(tr.variants[cc]) for cc in range(prog.K)]) + pos
        out = lax.switch(idx, brs, operands(prog, tr, ch, lps, pss), x_in, t_in, mb, ctx)
    cr, loss, send = f_account(prog, tr, c, slot, out, cr, loss)
    return (pss, cr, loss), send


def f_account(prog, tr, c, slot, out, cr, loss):
    """One forward's outputs into the state: residuals to their stash slot, the last stage's dL/dy and
    head gradient, the loss; returns the lane's message."""
    msg, res, dy, gq, l, t_out, gt, cnt = out
    last = is_last(prog, tr, c)
    # a direct hand-over (D = 1): the residuals go to this tick's B as they are, no stash slot
    cr = cr._replace(stash=list(res) if prog.direct else [write(a, slot, r) for a, r in zip(cr.stash, res)])
    cr, send = prog.route.last_forward(prog, last, msg, dy, gq, t_out, gt, cnt, cr)
    # the metric: losses over their weight -- 1 each, or a (sum, count) loss's count on a ring
    weight = cnt if prog.counting else jnp.ones((), jnp.float32)
    loss = (
        loss[0] + jnp.where(last, l, 0.0),
        loss[1] + last.astype(jnp.int32),
        loss[2] + jnp.where(last, weight, 0.0),
    )
    return cr, loss, send


def f_lanes_paired(prog, tr, t, rr, is_f, cf, gf, sf, x_in, t_in, ops):
    """The F lane and its F2 pair lane (Chimera's forward doubling on the ordered placement): one doubled
    forward where both run (the plan pairs forwards of one stage position), the F lane alone where only
    it does.  A sum-only policy's current weights (no version choice)."""
    is_f2, cf2, gf2 = op_of(prog, tr, t, tr.me, prog.KF2)
    x2_in, t2_in = (read(a, rr[prog.KF2, ROUTE["in"]]) for a in ops[2].mbuf[:2])
    s2 = rr[prog.KF2, ROUTE["stash"]]
    nothing = (
        blank(prog, tr),
        blank_tie(prog, tr),
        jnp.full((), jnp.nan if prog.nan_bubbles else 0, jnp.float32),
    )

    def single(ops):
        (pss, cr, loss), send = f_cond(prog, tr, is_f, cf, gf, sf, x_in, t_in, ops=ops)
        return (pss, cr, loss), send, nothing

    def double(ops):
        lps, pss, cr, loss = ops
        pos = pick(
            prog, tr, cf, [jnp.asarray(prog.remap[cc])[position(prog, tr, cc)] for cc in range(prog.K)]
        )
        brs, start = [], []
        for cc in range(prog.K):
            start.append(len(brs))
            brs += [
                (lambda cc, v: lambda lps_, *a: tr.doubles[cc][v](lps_[cc], *a))(cc, v)
                for v in range(len(tr.doubles[cc]))
            ]
        idx = pick(prog, tr, cf, start) + pos
        oa, ob = lax.switch(idx, brs, lps, (x_in, x2_in), (t_in, t2_in), (tr.mb_of(gf), tr.mb_of(gf2)))
        cr, loss, send_a = f_account(prog, tr, cf, sf, oa, cr, loss)
        cr, loss, send_b = f_account(prog, tr, cf, s2, ob, cr, loss)
        return (pss, cr, loss), send_a, send_b

    return f_cond(prog, tr, is_f2, ops=ops, branches=(double, single))


def f_cond(prog, tr, pred, *args, ops, branches=None):
    """``lax.cond(pred, f_lane, f_idle, *args, ops)`` (or ``branches(ops)``) with only what a forward
    writes as the conditional's outputs -- the stash, the last stage's registers, the loss (and the
    policy states where a forward may change them): the rest of the in-flight state (ring of
    micro-batches, message buffers) and a sum-only policy's gradient sums stay operands, which XLA does
    not copy; passed through, they were (+6-13% on the flushing schedules, HLO temp +4 MiB)."""
    lps, pss, cr, loss = ops

    def slim(fn):
        def run(*a):
            (pss_, cr_, loss_), *sends = fn(*a)
            return ((() if prog.fused else pss_), tuple(getattr(cr_, f) for f in F_OUT), loss_), *sends

        return run

    if branches is None:
        out = cond(pred, slim(partial(f_lane, prog, tr)), slim(partial(f_idle, prog, tr)), *args, ops)
    else:
        out = lax.cond(pred, slim(branches[0]), slim(branches[1]), ops)
    (pss_out, fields, loss), *sends = out
    cr = cr._replace(**dict(zip(F_OUT, fields)))
    return (pss if prog.fused else pss_out, cr, loss), *sends


def f_idle(prog, tr, c, g, slot, x_in, t_in, ops):
    lps, pss, cr, loss = ops
    return (pss, cr, loss), prog.route.idle_message(prog, blank(prog, tr), blank_tie(prog, tr))
