"""The backward lanes of a tick: a micro-batch's backward on the version its forward read, the update
(or a gradient policy's in-place sum), ZB's split backward and its W lane.  Methods of the executor's
per-trace :class:`~jaxpipe.runtime.executor._Call`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .common import ROUTE, cast, pmean_over, psum_over, read, where, write


class BackwardLanes:
    def bwd(self, w, res, dy):
        """``(dw, dx, frontier)`` of a backward; split: ``dw`` is None (W computes it) and the frontier is
        what W reads (none where W recomputes)."""
        if not self.split:
            return (*self.sop.backward(w, res, dy), ())
        if self.wsp is not None:
            return (None, *self.wsp.input_part(w, res, dy))
        return None, self.sop.backward(w, res, dy)[1], ()

    def b_lane(self, c, g, slot, dy_in, t_in, ops):
        lps, pss, cr = ops
        gi = self.base + g
        res = [read(a, slot) for a in cr.stash]
        last, first = self.is_last(c), self.is_first(c)
        dy = dy_in if self.slots else where(last, cr.dy_own, dy_in)
        policy, (lp,), (ps,) = self.policies[0], *(v[:1] for v in self.per_chunk(lps, pss))
        pre_p = None
        if not self.by_branch and policy.backward_is_current is not None:
            # stages predicting by 0 read lp itself: no weight-sized axpy
            dw, dx, front = lax.cond(policy.backward_is_current(self.me), lambda: self.bwd(lp[0], res, dy),
                                     lambda: self.bwd(policy.backward_weights(lp, ps, gi, self.me)[0], res, dy))
        elif not self.by_branch:
            w, pre_p, _ = policy.backward_weights(lp, ps, gi, self.me)
            dw, dx, front = self.bwd(w, res, dy)
        else:
            ch = self.choices(g, *self.per_chunk(lps, pss))
            brs, start = [], []
            for cc, (_, cands) in enumerate(ch):
                start.append(len(brs))
                brs += [(lambda cc, v: (lambda cs, r, d: self.bwd(self.candidate(cs, cc, v)[0], r, d)))(cc, v)
                        for v in range(len(cands))]
            idx = self.pick(c, [start[cc] + ch[cc][0] for cc in range(self.K)])
            dw, dx, front = lax.switch(idx, brs, self.operands(ch, lps, pss), res, dy)
        dx = cast(dx, self.x_aval)
        dpre = self.zero_like(lp[1])
        # the tied arrays' last-stage gradient of this micro-batch, on its way to stage 0
        t_grad = t_in if self.slots else where(last, cr.gtie, t_in)
        if jax.tree.leaves(lp[1]):
            def pre_grad():
                q0 = pre_p if pre_p is not None else policy.backward_weights(lp, ps, gi, self.me)[1]
                return self.ties.add_to_pre(self.sop.pre_grad(q0, self.mb_of(g), dx), t_grad)
            dpre = lax.cond(first, pre_grad, lambda: self.zero_like(lp[1]))
        # a lane plan's stream summed post's gradient at its forwards (None: nothing to add here)
        dpost = None if self.slots else jax.tree.map(lambda a, q: jnp.where(last, a, 0).astype(q.dtype), cr.gpost, lp[2])
        grad = (dw, dpre, dpost)
        if self.ring:        # the previous worker's partial sum of this chunk (none on the first worker)
            grad = jax.tree.map(lambda p_, a: jnp.where(self.replica > 0, p_, jnp.zeros_like(p_)) + a.astype(p_.dtype),
                                jax.tree.map(lambda b: read(b, c), cr.reduce.partial), grad)
        return grad, (where(first, self.blank(), dx), where(first, self.blank_tie(), t_grad)), front

    def b_idle(self, c, g, slot, dy_in, t_in, ops):
        lps, pss, cr = ops
        if self.ring:        # the last sum passes through (a fresh fill would be a weight-sized write per tick)
            return cr.reduce.gbuf, (self.blank(), self.blank_tie()), ()
        return self.zero_like(lps[0]), (self.blank(), self.blank_tie()), ()

    def b_apply(self, c, g, grad, cnt, lp, os_, ps):
        # the update, in a conditional of its own: one that also ran the backward (reading the weights
        # it then updates) made XLA copy the weights twice per tick (HLO-checked, BUILD_NOTES)
        gi = self.base + g
        policy = self.policies[c]
        if policy.finish is not None:       # local sums, reduced once after the call
            return policy.update(grad, lp, os_, ps, gi, self.me, count=cnt if self.counting else None)
        if self.counting:        # sums over replicas; the policy divides the step's sum by the step's count
            return policy.update(psum_over(grad, self.mesh, self.RED), lp, os_, ps, gi, self.me, count=cnt)
        return policy.update(pmean_over(grad, self.mesh, self.RED), lp, os_, ps, gi, self.me)

    def b_lanes_summing(self, cb, gb, sb, dy_in, tb_in, cnt, is_b, lps, oss, pss, cr):
        """Policies that only sum gradients (``finish``): one predicate conditional per chunk runs the
        backward and adds its gradient to the chunk's sums in place -- a weight-sized gradient handed out
        of the backward's conditional to an update's was written and read again every tick (+25% on a
        flushing schedule, measured against the deleted lane executor)."""
        pss, send_b, fb = list(pss), None, cr.front
        for c in range(self.K):
            def run(g, slot, dy, t_in, n, ps, fb, c=c):
                grad, snd, front = self.b_lane(c, g, slot, dy, t_in,
                                          (lps, tuple(pss[:c]) + (ps,) + tuple(pss[c + 1:]), cr))
                if self.wsp is not None:     # the frontier into the micro-batch's slot beside its residuals
                    fb = [write(a, slot, f) for a, f in zip(fb, front)]
                return self.b_apply(c, g, grad, n, lps[c], oss[c], ps)[2], fb, snd

            def idle(g, slot, dy, t_in, n, ps, fb):
                return ps, fb, (self.blank(), self.blank_tie())
            pss[c], fb, snd = lax.cond(is_b & (cb == c), run, idle, gb, sb, dy_in, tb_in, cnt, pss[c], fb)
            send_b = snd if send_b is None else where(cb == c, snd, send_b)
        return tuple(pss), cr._replace(front=fb), send_b

    def w_lanes(self, t, rw, lps, oss, pss, cr):
        """ZB's W lane: the weight gradient of the micro-batch whose B ran earlier, from its residuals and
        its dL/dy (kept in their slots until now) and, split at the frontier, the per-layer output
        gradients its B kept; added to the chunk's sums (one predicate conditional per chunk)."""
        is_w, cw, gw = self.op_of(t, self.me, self.KW)
        pss = list(pss)
        for c in range(self.K):
            def run(g, rw, ps, c=c):
                res = [read(a, rw[ROUTE["stash"]]) for a in cr.stash]
                dy = read(cr.mbuf[0], rw[ROUTE["in"]])
                if self.wsp is not None:
                    dw = self.wsp.weight_part(lps[c][0], res, dy, [read(a, rw[ROUTE["stash"]]) for a in cr.front])
                else:
                    dw = self.sop.backward(lps[c][0], res, dy)[0]
                return self.policies[c].update((dw, None, None), lps[c], oss[c], ps, self.base + g, self.me)[2]
            pss[c] = lax.cond(is_w & (cw == c), run, lambda g, rw, ps: ps, gw, rw, pss[c])
        return tuple(pss)
