"""The backward lanes of a tick: a micro-batch's backward on the version its forward read, the update
(or a gradient policy's in-place sum), ZB's split backward and its W lane.  Functions over the
executor's :class:`~jaxpipe.runtime.program.Program` and :class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..schedules.layout import ROUTE
from . import front_pack
from .common import cast, cond, full, pmean_over, psum_over, read, where, write
from .call_base import (
    blank,
    blank_tie,
    candidate,
    choices,
    is_first,
    is_last,
    op_of,
    operands,
    per_chunk,
    pick,
    zero_like,
)


def bwd(prog, tr, w, res, dy, sums=None, add=None):
    """``(dw, dx, frontier)`` of a backward; split: ``dw`` is None (W computes it) and the frontier is
    what W reads (none where W recomputes).  ``sums`` (a summing policy's stage sums, ``add`` its
    ``add_leaf``; only with ``tr.wfuse``): the whole backward as B's input part then W's added into the sums
    in place, and the first value is the new sums -- the same products as the fused backward without its
    zero-filled stacked weight gradient and the pass adding it (one core, testbed stage: 11.3 -> 9.2 ms)."""
    if sums is not None:
        dx, front = tr.wfuse.input_part(w, res, dy)
        return tr.wfuse.weight_part_into(w, res, dy, front, sums, add), dx, ()
    if not prog.split:
        return (*tr.sop.backward(w, res, dy), ())
    if tr.wsp is not None:
        return (None, *tr.wsp.input_part(w, res, dy))
    return None, tr.sop.backward(w, res, dy)[1], ()


def b_lane(prog, tr, c, g, slot, dy_in, t_in, ops, sums=None):
    """``(grad, messages, frontier)``; with ``sums`` (:func:`bwd`) also the new sums, and ``grad``'s stage
    part is None (it is in them)."""
    lps, pss, cr = ops
    add = prog.policies[c].add_leaf if sums is not None else None  # c is static there (b_lanes_summing)
    gi = tr.base + g
    res = list(cr.stash) if prog.direct else [read(a, slot) for a in cr.stash]
    last, first = is_last(prog, tr, c), is_first(prog, tr, c)
    dy = prog.route.last_dy(prog, cr, last, dy_in)
    policy, (lp,), (ps,) = prog.policies[0], *(v[:1] for v in per_chunk(prog, tr, lps, pss))
    pre_p = None
    if not prog.by_branch and policy.backward_is_current is not None:
        # stages predicting by 0 read lp itself: no weight-sized axpy
        dw, dx, front = lax.cond(
            policy.backward_is_current(tr.me),
            lambda: bwd(prog, tr, lp[0], res, dy, sums, add),
            lambda: bwd(prog, tr, policy.backward_weights(lp, ps, gi, tr.me)[0], res, dy, sums, add),
        )
    elif not prog.by_branch:
        w, pre_p, _ = policy.backward_weights(lp, ps, gi, tr.me)
        dw, dx, front = bwd(prog, tr, w, res, dy, sums, add)
    else:
        ch = choices(prog, tr, g, *per_chunk(prog, tr, lps, pss))
        brs, start = [], []
        for cc, (_, cands) in enumerate(ch):
            start.append(len(brs))
            brs += [
                (
                    lambda cc, v: (
                        lambda cs, r, d, sm: bwd(prog, tr, candidate(prog, tr, cs, cc, v)[0], r, d, sm, add)
                    )
                )(cc, v)
                for v in range(len(cands))
            ]
        idx = pick(prog, tr, c, [start[cc] + ch[cc][0] for cc in range(prog.K)])
        dw, dx, front = lax.switch(idx, brs, operands(prog, tr, ch, lps, pss), res, dy, sums)
    new_sums, dw = (dw, None) if sums is not None else (None, dw)
    dx = cast(dx, prog.x_aval)
    dpre = zero_like(prog, tr, lp[1])
    # the tied arrays' last-stage gradient of this micro-batch, on its way to stage 0
    t_grad = prog.route.last_tie_grad(prog, cr, last, t_in)
    if jax.tree.leaves(lp[1]):

        def pre_grad():
            q0 = pre_p if pre_p is not None else policy.backward_weights(lp, ps, gi, tr.me)[1]
            return prog.ties.add_to_pre(tr.sop.pre_grad(q0, tr.mb_of(g), dx), t_grad)

        dpre = lax.cond(first, pre_grad, lambda: zero_like(prog, tr, lp[1]))
    # a lane plan's stream summed post's gradient at its forwards (None: nothing to add here)
    dpost = prog.route.last_head_grad(prog, cr, last, lp)
    grad = (dw, dpre, dpost)
    grad = prog.grads.with_partial(prog, tr, c, grad, cr)  # a ring: the previous worker's partial sum
    out = grad, (where(first, blank(prog, tr), dx), where(first, blank_tie(prog, tr), t_grad)), front
    return out if sums is None else out + (new_sums,)


def b_idle(prog, tr, c, g, slot, dy_in, t_in, ops):
    lps, pss, cr = ops
    return prog.grads.idle_grad(prog, tr, lps, cr), (blank(prog, tr), blank_tie(prog, tr)), ()


def b_apply(prog, tr, c, g, grad, cnt, lp, os_, ps):
    # the update, in a conditional of its own: one that also ran the backward (reading the weights
    # it then updates) made XLA copy the weights twice per tick (HLO-checked, BUILD_NOTES)
    gi = tr.base + g
    policy = prog.policies[c]
    if policy.finish is not None:  # local sums, reduced once after the call
        return policy.update(grad, lp, os_, ps, gi, tr.me, count=cnt if prog.counting else None)
    if prog.counting:  # sums over replicas; the policy divides the step's sum by the step's count
        return policy.update(psum_over(grad, prog.mesh, prog.RED), lp, os_, ps, gi, tr.me, count=cnt)
    return policy.update(pmean_over(grad, prog.mesh, prog.RED), lp, os_, ps, gi, tr.me)


def b_lanes_summing(prog, tr, cb, gb, sb, dy_in, tb_in, cnt, is_b, lps, oss, pss, cr):
    """Policies that only sum gradients (``finish``): one predicate conditional per chunk runs the
    backward and adds its gradient to the chunk's sums in place -- a weight-sized gradient handed out
    of the backward's conditional to an update's was written and read again every tick (+25% on a
    flushing schedule, measured against the deleted lane executor)."""
    packed = tr.fplace is not None  # the frontier goes into B's own stash slot (front_pack)
    pss, send_b, fb, stash = list(pss), None, cr.front, cr.stash
    for c in range(prog.K):

        def run(g, slots, dy, t_in, n, ps, fb, c=c, crc=cr._replace(stash=stash)):  # the stash as last put
            slot, f_slot = slots if tr.wsp is not None else (slots, None)
            fuse = tr.wfuse is not None  # the stage's gradient added into the sums in place (bwd)
            grad, snd, front, *sums = b_lane(
                prog,
                tr,
                c,
                g,
                slot,
                dy,
                t_in,
                (lps, tuple(pss[:c]) + (ps,) + tuple(pss[c + 1 :]), crc),
                sums=prog.policies[c].sums[0](ps) if fuse else None,
            )
            if packed:  # out of this conditional, into the stash by the next (one that read and wrote
                fb = front  # the stash made XLA copy it)
            elif tr.wsp is not None:  # the frontier into its slot (the plan's, B to W)
                fb = [write(a, f_slot, f) for a, f in zip(fb, front)]
            if fuse:  # the new sums in first: nothing reads the old ones after (else XLA copied them)
                ps = prog.policies[c].sums[1](ps, sums[0])
            return b_apply(prog, tr, c, g, grad, n, lps[c], oss[c], ps)[2], fb, snd

        def idle(g, slot, dy, t_in, n, ps, fb):
            return ps, fb, (blank(prog, tr), blank_tie(prog, tr))

        mine = is_b if is_b is True and prog.K == 1 else is_b & (cb == c)
        f_in = full(tr.wsp.frontier_avals, jnp.nan if prog.nan_bubbles else 0) if packed else fb
        pss[c], fb, snd = cond(mine, run, idle, gb, sb, dy_in, tb_in, cnt, pss[c], f_in)
        if packed:
            stash = cond(
                mine, lambda st, f: front_pack.put(st, sb[0], f, tr.fplace), lambda st, f: st, stash, fb
            )
        send_b = snd if send_b is None else where(cb == c, snd, send_b)
    return tuple(pss), cr._replace(stash=stash, **({} if packed else {"front": fb})), send_b


def w_lanes(prog, tr, t, rw, lps, oss, pss, cr):
    """ZB's W lane: the weight gradient of the micro-batch whose B ran earlier, from its residuals and
    its dL/dy (kept in their slots until now) and, split at the frontier, the per-layer output
    gradients its B kept; added to the chunk's sums (one predicate conditional per chunk)."""
    is_w, cw, gw = op_of(prog, tr, t, tr.me, prog.KW)
    pss = list(pss)
    for c in range(prog.K):

        def run(g, rw, ps, c=c):
            res = [read(a, rw[ROUTE["stash"]]) for a in cr.stash]
            dy = read(cr.mbuf[0], rw[ROUTE["in"]])
            if tr.wsp is not None:
                front = (
                    front_pack.get(cr.stash, rw[ROUTE["stash"]], tr.wsp.frontier_avals, tr.fplace)
                    if tr.fplace is not None
                    else [read(a, rw[ROUTE["front"]]) for a in cr.front]
                )
                policy = prog.policies[c]
                if policy.add_leaf is not None and policy.sums is not None:  # added into the sums in place
                    get, put = policy.sums
                    return put(
                        ps, tr.wsp.weight_part_into(lps[c][0], res, dy, front, get(ps), policy.add_leaf)
                    )
                dw = tr.wsp.weight_part(lps[c][0], res, dy, front)
            else:
                dw = tr.sop.backward(lps[c][0], res, dy)[0]
            return prog.policies[c].update((dw, None, None), lps[c], oss[c], ps, tr.base + g, tr.me)[2]

        pss[c] = lax.cond(is_w & (cw == c), run, lambda g, rw, ps: ps, gw, rw, pss[c])
    return tuple(pss)


def b_updates(prog, tr, is_b, cb, gb, grad, cnt, flags, lps, oss, pss):
    """The backward's update of its chunk: one conditional per chunk, each output either its operand or a
    new value (no copies); a pending version applied; an in-scan landing where the policy lands."""
    lps, oss, pss = list(lps), list(oss), list(pss)
    for c in range(prog.K):
        mine = is_b & (cb == c)
        lps[c], oss[c], pss[c] = lax.cond(
            mine,
            lambda *a, c=c: b_apply(prog, tr, c, *a),
            lambda g, gr, n, *a: a,
            gb,
            grad,
            cnt,
            lps[c],
            oss[c],
            pss[c],
        )
        if prog.policies[c].apply_pending is not None:
            lps[c] = lax.cond(mine, prog.policies[c].apply_pending, lambda lp, ps: lp, lps[c], pss[c])
        if prog.in_scan and flags:
            lps[c], oss[c], pss[c] = lax.cond(
                mine & prog.policies[c].lands(tr.base + gb),
                lambda *a, c=c: prog.policies[c].land(*a, counting=prog.counting, b=(tr.base + gb) // prog.M),
                lambda *a: a,
                lps[c],
                oss[c],
                pss[c],
            )
    return lps, oss, pss
