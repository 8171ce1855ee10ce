"""Cyclic Data Parallelism's ring reduction (Fournier & Oyallon §3.2): a worker adds its gradient to the
previous worker's partial sum and sends it on; the last worker updates the stage and broadcasts it; the
others land it the next tick.  Functions of the executor's :class:`~jaxpipe.runtime.program.Program` and
:class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..axes import DATA
from .common import balanced_broadcast, ppermute_bits, read, where, write
from .call_base import op_of, view


def land_stacked(prog, tr, j, new, cur, lp_st, ps_st, extra=()):
    """Ring: chunk ``j`` of the stacked state gets version ``new``, its policy retiring ``cur`` (written by
    dynamic-update-slice: XLA updates stacked buffers in place, where a conditional swapping per-chunk
    buffers copied the weights every tick -- HLO-checked)."""
    put = lambda st, v: jax.tree.map(lambda a, b: lax.dynamic_update_index_in_dim(a, b, j, 0), st, v)
    ps_j = prog.policies[0].retire(cur, view(prog, tr, ps_st, j))
    return (put(lp_st, new), put(ps_st, ps_j)) + tuple(put(a, b) for a, b in extra)


def receive_arrived(prog, tr, lps, pss, rs):
    """Ring: the stage the last worker sent last tick lands (its current version retired)."""
    cur = jax.tree.map(lambda a: read(a, rs.bchunk), lps)  # sliced outside the conditional
    return lax.cond(
        rs.bok,
        lambda lp_, ps_, cur_: land_stacked(prog, tr, rs.bchunk, rs.bnew, cur_, lp_, ps_),
        lambda lp_, ps_, cur_: (lp_, ps_),
        lps,
        pss,
        cur,
    )


def ring_exchange(prog, tr, t, lps, oss, pss, rs, is_b, cb, g_sum, cnt, may_update):
    """Ring: the last worker updates from its complete sum; every worker sends its sum on to the next
    and keeps what the previous one sent; the updated stage goes from the last worker to the others
    (only in ticks where it may complete a sum: no collective inside a conditional)."""
    n_sum = jnp.where(tr.replica > 0, read(rs.pcnt, cb), 0.0) + cnt
    n_sum = jnp.where(is_b, n_sum, rs.gcnt)
    if may_update:  # the last worker completes sums only in these ticks
        # the stage and its optimizer state sliced outside the conditional, written back in place
        cur, o_cur = jax.tree.map(lambda a: read(a, cb), (lps, oss))

        def apply(lp_, os_, ps_, cur_, o_):
            new, o_new = prog.policies[0].apply_sum(g_sum, n_sum, cur_, o_, counting=prog.counting)
            lp_, ps_, os_ = land_stacked(prog, tr, cb, new, cur_, lp_, ps_, ((os_, o_new),))
            return lp_, os_, ps_

        lps, oss, pss = lax.cond(
            is_b & (tr.replica == prog.W - 1),
            apply,
            lambda lp_, os_, ps_, c_, o_: (lp_, os_, ps_),
            lps,
            oss,
            pss,
            cur,
            o_cur,
        )
    rs = rs._replace(gbuf=g_sum, gcnt=n_sum)
    if prog.W > 1:
        got, got_n = ppermute_bits((g_sum, n_sum), DATA, [(i, i + 1) for i in range(prog.W - 1)])
        runs_s, c_s, _ = op_of(prog, tr, t, 0, 1, r=tr.replica - 1)
        slot = jnp.where(runs_s & (tr.replica > 0), c_s, prog.K)
        rs = rs._replace(
            partial=jax.tree.map(lambda a, v: write(a, slot, v), rs.partial, got),
            pcnt=write(rs.pcnt, slot, got_n),
        )
        l_runs, l_c, _ = op_of(prog, tr, t, 0, 1, r=prog.W - 1)
        if may_update:
            new = jax.tree.map(lambda a: read(a, l_c), lps)
            if prog.broadcast == "balanced":
                arrived = balanced_broadcast(new, prog.W, tr.replica, DATA)
            else:
                arrived = None
                for dst in range(prog.W - 1):
                    m = ppermute_bits(new, DATA, [(prog.W - 1, dst)])
                    arrived = m if arrived is None else where(tr.replica == dst, m, arrived)
            rs = rs._replace(bnew=arrived)
        rs = rs._replace(bchunk=l_c, bok=l_runs & (tr.replica < prog.W - 1))
    return lps, oss, pss, rs
