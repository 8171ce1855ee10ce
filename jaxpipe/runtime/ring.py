"""Cyclic Data Parallelism's ring reduction (Fournier & Oyallon §3.2): a worker adds its gradient to the
previous worker's partial sum and sends it on; the last worker updates the stage and broadcasts it; the
others land it the next tick.  Functions of the executor's :class:`~jaxpipe.runtime.program.Program` and
:class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..axes import DATA
from .collectives import balanced_broadcast, ppermute_bits
from .buffers import read, where, write
from .call_base import op_of, view


def land_stacked(prog, trace, j, new, cur, lp_st, ps_st, extra=()):
    """Ring: chunk ``j`` of the stacked state gets version ``new``, its policy retiring ``cur`` (written by
    dynamic-update-slice: XLA updates stacked buffers in place, where a conditional swapping per-chunk
    buffers copied the weights every tick -- HLO-checked)."""
    put = lambda st, value: jax.tree.map(
        lambda leaf, b: lax.dynamic_update_index_in_dim(leaf, b, j, 0), st, value
    )
    ps_j = prog.policies[0].retire(cur, view(prog, trace, ps_st, j))
    return (put(lp_st, new), put(ps_st, ps_j)) + tuple(put(a, b) for a, b in extra)


def receive_arrived(prog, trace, chunk_params, policy_states, ring_state):
    """Ring: the stage the last worker sent last tick lands (its current version retired)."""
    cur = jax.tree.map(
        lambda leaf: read(leaf, ring_state.bchunk), chunk_params
    )  # sliced outside the conditional
    return lax.cond(
        ring_state.bok,
        lambda params_, pstate_, cur_: land_stacked(
            prog, trace, ring_state.bchunk, ring_state.bnew, cur_, params_, pstate_
        ),
        lambda params_, pstate_, cur_: (params_, pstate_),
        chunk_params,
        policy_states,
        cur,
    )


def ring_exchange(
    prog,
    trace,
    tick,
    chunk_params,
    opt_states,
    policy_states,
    ring_state,
    is_b,
    chunk_b,
    g_sum,
    count,
    may_update,
):
    """Ring: the last worker updates from its complete sum; every worker sends its sum on to the next
    and keeps what the previous one sent; the updated stage goes from the last worker to the others
    (only in ticks where it may complete a sum: no collective inside a conditional)."""
    n_sum = jnp.where(trace.replica > 0, read(ring_state.pcnt, chunk_b), 0.0) + count
    n_sum = jnp.where(is_b, n_sum, ring_state.gcnt)
    if may_update:  # the last worker completes sums only in these ticks
        # the stage and its optimizer state sliced outside the conditional, written back in place
        cur, o_cur = jax.tree.map(lambda leaf: read(leaf, chunk_b), (chunk_params, opt_states))

        def apply(params_, opt_state, pstate_, cur_, o_):
            new, o_new = prog.policies[0].apply_sum(g_sum, n_sum, cur_, o_, counting=prog.counting)
            params_, pstate_, opt_state = land_stacked(
                prog, trace, chunk_b, new, cur_, params_, pstate_, ((opt_state, o_new),)
            )
            return params_, opt_state, pstate_

        chunk_params, opt_states, policy_states = lax.cond(
            is_b & (trace.replica == prog.ring_workers - 1),
            apply,
            lambda params_, opt_state, pstate_, c_, o_: (params_, opt_state, pstate_),
            chunk_params,
            opt_states,
            policy_states,
            cur,
            o_cur,
        )
    ring_state = ring_state._replace(gbuf=g_sum, gcnt=n_sum)
    if prog.ring_workers > 1:
        got, got_n = ppermute_bits((g_sum, n_sum), DATA, [(i, i + 1) for i in range(prog.ring_workers - 1)])
        runs_s, c_s, _ = op_of(prog, trace, tick, 0, 1, r=trace.replica - 1)
        slot = jnp.where(runs_s & (trace.replica > 0), c_s, prog.num_chunks)
        ring_state = ring_state._replace(
            partial=jax.tree.map(lambda leaf, value: write(leaf, slot, value), ring_state.partial, got),
            pcnt=write(ring_state.pcnt, slot, got_n),
        )
        l_runs, l_c, _ = op_of(prog, trace, tick, 0, 1, r=prog.ring_workers - 1)
        if may_update:
            new = jax.tree.map(lambda leaf: read(leaf, l_c), chunk_params)
            if prog.broadcast == "balanced":
                arrived = balanced_broadcast(new, prog.ring_workers, trace.replica, DATA)
            else:
                arrived = None
                for dst in range(prog.ring_workers - 1):
                    m = ppermute_bits(new, DATA, [(prog.ring_workers - 1, dst)])
                    arrived = m if arrived is None else where(trace.replica == dst, m, arrived)
            ring_state = ring_state._replace(bnew=arrived)
        ring_state = ring_state._replace(bchunk=l_c, bok=l_runs & (trace.replica < prog.ring_workers - 1))
    return chunk_params, opt_states, policy_states, ring_state
