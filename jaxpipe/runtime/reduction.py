"""How gradients are reduced and applied: one strategy object per program, chosen once from the policies'
declared ``reduction`` (``Program.grads``).

* :class:`SumAfterCall` (``"sum"``: a flushing schedule's gradient) -- one predicate conditional per chunk
  runs a backward and adds its *local* gradient to the policy's sums in place; after the call the sums are
  reduced over the data replicas once (``finish``) and returned.
* :class:`UpdateEach` (``"update"``: the no-flush methods) -- a backward's gradient is reduced over the
  replicas and fed to its chunk's update, in a conditional of its own (and a pending version applied, an
  in-scan landing).
* :class:`RingReduction` (``"ring"``: Cyclic DP's DP form, Fournier & Oyallon §3.2) -- a worker adds the
  previous worker's partial sum, the last worker updates, nothing collective but point-to-point runs in the
  scan; every worker holds its chunks stacked, which the lanes read through static views (:mod:`.ring`).

Every method reads the :class:`~.program.Program` ``prog`` and the :class:`~.executor.Trace` ``tr`` it is
given.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..axes import DATA, DP_AXES, PIPE, STAGE
from .call_base import blank, blank_tie, views, zero_like
from .common import cast, pmean_over, psum_over, read
from .lanes_backward import b_idle, b_lane, b_lanes_summing, b_updates
from .ring import receive_arrived, ring_exchange


class AllReduce:
    """What the two all-reducing strategies share: chunks as tuples, collectives at the loss head and after
    the call."""

    def own_spec(self, prog):
        """Where a device's own parameters sit: stage s's at index s (AvgPipe's pipelines: one per pipe
        index)."""
        return P((PIPE, STAGE)) if prog.replicas else P(STAGE)

    def per_chunk(self, prog, tr, lps, pss):
        """The chunks' (weights, policy state)."""
        return lps, pss

    def operands(self, prog, tr, ch, lps, pss):
        """The version switch's weight operands: every chunk's candidates, each read in place by its
        branch."""
        return [cands for _, cands in ch]

    def candidate(self, prog, tr, cs, cc, w):
        return cs[cc][w]

    def before_tick(self, prog, tr, lps, oss, pss, cr, flags):
        return lps, pss, None

    def end_tick(self, lps, oss, pss):
        return tuple(lps), tuple(oss), tuple(pss)

    def head(self, prog, tr, res, dy, gq, l, gt, n):
        """The last stage's outputs of a forward: ``(sum, count)`` losses get their global count (a collective
        over the replicas) and are scaled or summed for the reduction that follows."""
        n_glob = (
            psum_over(n, prog.mesh, prog.RED).astype(jnp.float32)
            if prog.summed
            else jnp.zeros((), jnp.float32)
        )
        if prog.counting:
            l = psum_over(l, prog.mesh, prog.RED)  # the metric: summed, over the summed counts (below)
        elif prog.summed:
            # (sum, count): this micro-batch's loss over every replica's real tokens -- scaled here so
            # that the pmean over replicas in B gives sum over replicas / global count
            # a micro-batch whose every token is masked (count 0) contributes nothing, not 0/0
            scale = jnp.where(n_glob > 0, prog.n_red / jnp.where(n_glob > 0, n_glob, 1.0), 0.0)
            l, gq, gt, dy = l * scale, *jax.tree.map(lambda g: g * scale.astype(g.dtype), (gq, gt, dy))
        return (
            blank(prog, tr),
            res,
            cast(dy, prog.x_aval),
            gq,
            l.astype(jnp.float32),
            blank_tie(prog, tr),
            gt,
            n_glob,
        )

    def with_partial(self, prog, tr, c, grad, cr):
        return grad

    def idle_grad(self, prog, tr, lps, cr):
        return zero_like(prog, tr, lps[0])

    def call_loss(self, prog, lsum, lcount, lweight, errors):
        """The call's loss metric over the stages and replicas, its count, the version errors."""
        lsum, lcount, lweight = lax.psum((lsum, lcount, lweight), STAGE)
        lsum = pmean_over(lsum, prog.mesh, prog.RED)
        lcount = lax.pmax(lcount, DP_AXES)
        if (
            prog.counting
        ):  # the summed loss over the summed counts of the call's micro-batches (global already)
            loss = jnp.where(lweight > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan)
        else:
            loss = jnp.where(lcount > 0, lsum / jnp.maximum(lcount, 1), jnp.nan)
        return loss, lcount, lweight, lax.psum(errors, STAGE)

    def finish(self, prog, pss, lweight):
        """A summing policy's sums reduced over the replicas once (``(sum, count)`` losses: over the call's
        global count; a chunk may see some micro-batches only)."""
        mesh, RED = prog.mesh, prog.RED
        reduce = (
            (lambda t: psum_over(t, mesh, RED)) if prog.counting else (lambda t: pmean_over(t, mesh, RED))
        )
        total = lweight if prog.counting else None
        return tuple(
            p.finish(ps, reduce, total) if p.finish is not None else ps for p, ps in zip(prog.policies, pss)
        )


class SumAfterCall(AllReduce):
    """Sums in place, reduced once after the call (module docstring)."""

    name = "sum"

    def backward(self, prog, tr, b_in, is_b, lps, oss, pss, cr):
        """``(pss, cr, grad, message)``: the B lane with its sum (the gradient stays in the sums: None)."""
        cb, gb, sb, dy_in, tb_in, cnt = b_in
        pss, cr, send_b = b_lanes_summing(prog, tr, cb, gb, sb, dy_in, tb_in, cnt, is_b, lps, oss, pss, cr)
        return pss, cr, None, send_b

    def apply(self, prog, tr, t, flags, stacks, op, grad, cnt, lps, oss, pss, cr):
        return lps, oss, pss, cr


class UpdateEach(AllReduce):
    """Each backward's gradient to its chunk's update (module docstring)."""

    name = "update"

    def backward(self, prog, tr, b_in, is_b, lps, oss, pss, cr):
        grad, send_b, _ = lax.cond(
            is_b, partial(b_lane, prog, tr), partial(b_idle, prog, tr), *b_in[:5], (lps, pss, cr)
        )
        return pss, cr, grad, send_b

    def apply(self, prog, tr, t, flags, stacks, op, grad, cnt, lps, oss, pss, cr):
        is_b, cb, gb = op
        lps, oss, pss = b_updates(prog, tr, is_b, cb, gb, grad, cnt, flags, lps, oss, pss)
        return lps, oss, pss, cr


class RingReduction(UpdateEach):
    """Cyclic DP's ring over the data workers (module docstring); the backward runs as
    :class:`UpdateEach`'s."""

    name = "ring"

    def own_spec(self, prog):
        return P((DATA, STAGE))  # each worker holds a replica of its own

    def per_chunk(self, prog, tr, lps, pss):
        return views(prog, tr, lps), views(prog, tr, pss)

    def operands(self, prog, tr, ch, lps, pss):
        """The stacked candidates (``lps``, ``pss``: the stacks), each branch slicing its chunk (views sliced
        outside were materialised: 173 MiB of temp)."""
        return prog.policies[0].choose(lps, pss, tr.base, tr.me)[1]

    def candidate(self, prog, tr, cs, cc, w):
        return jax.tree.map(lambda a: a[cc], cs[w])

    def before_tick(self, prog, tr, lps, oss, pss, cr, flags):
        """The stage the last worker sent last tick lands; the lanes read static views of the stacks."""
        if flags[0]:
            lps, pss = receive_arrived(prog, tr, lps, pss, cr.reduce)
        return lps, pss, (lps, oss, pss)

    def end_tick(self, lps, oss, pss):
        return lps, oss, pss

    def head(self, prog, tr, res, dy, gq, l, gt, n):
        """Workers run the head at different ticks: nothing collective; counts travel the ring."""
        n = jnp.asarray(n, jnp.float32) if prog.summed else jnp.zeros((), jnp.float32)
        return (
            blank(prog, tr),
            res,
            cast(dy, prog.x_aval),
            gq,
            l.astype(jnp.float32),
            blank_tie(prog, tr),
            gt,
            n,
        )

    def with_partial(self, prog, tr, c, grad, cr):
        """The previous worker's partial sum of this chunk added (none on the first worker)."""
        return jax.tree.map(
            lambda p_, a: jnp.where(tr.replica > 0, p_, jnp.zeros_like(p_)) + a.astype(p_.dtype),
            jax.tree.map(lambda b: read(b, c), cr.reduce.partial),
            grad,
        )

    def idle_grad(self, prog, tr, lps, cr):
        return (
            cr.reduce.gbuf
        )  # the last sum passes through (a fresh fill would be a weight-sized write per tick)

    def apply(self, prog, tr, t, flags, stacks, op, grad, cnt, lps, oss, pss, cr):
        is_b, cb, _ = op
        lps, oss, pss, rs = ring_exchange(prog, tr, t, *stacks, cr.reduce, is_b, cb, grad, cnt, flags[1])
        return lps, oss, pss, cr._replace(reduce=rs)

    def call_loss(self, prog, lsum, lcount, lweight, errors):
        """Every worker's own micro-batches: the call's losses over their summed weight."""
        lsum, lcount, lweight = lax.psum((lsum, lcount, lweight), (DATA, STAGE))
        loss = jnp.where(lweight > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan)
        return loss, lcount, lweight, lax.psum(errors, (DATA, STAGE))

    def finish(self, prog, pss, lweight):
        return pss


REDUCTIONS = {"sum": SumAfterCall(), "update": UpdateEach(), "ring": RingReduction()}
