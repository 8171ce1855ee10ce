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

Every method reads the :class:`~.program.Program` ``prog`` and the :class:`~.executor.Trace` ``trace`` it is
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
from .buffers import cast, read
from .collectives import pmean_over, psum_over
from .lanes_backward import b_idle, b_lane, b_lanes_summing, b_updates
from .ring import receive_arrived, ring_exchange


class AllReduce:
    """What the two all-reducing strategies share: chunks as tuples, collectives at the loss head and after
    the call."""

    def own_spec(self, prog):
        """Where a device's own parameters sit: stage s's at index s (AvgPipe's pipelines: one per pipe
        index)."""
        return P((PIPE, STAGE)) if prog.replicas else P(STAGE)

    def per_chunk(self, prog, trace, chunk_params, policy_states):
        """The chunks' (weights, policy state)."""
        return chunk_params, policy_states

    def operands(self, prog, trace, chunk, chunk_params, policy_states):
        """The version switch's weight operands: every chunk's candidates, each read in place by its
        branch."""
        return [cands for _, cands in chunk]

    def candidate(self, prog, trace, chunk_stack, chunk_choice, weights):
        return chunk_stack[chunk_choice][weights]

    def before_tick(self, prog, trace, state, flags):
        """``(state, stacks)``: the tick's state (:class:`~jaxpipe.runtime.ticks.TickState`) as its lanes
        read it, and what the ring's update reads (None here)."""
        return state, None

    def end_tick(self, state):
        """``state`` with its chunks as tuples again (the lanes may leave lists)."""
        return state._replace(
            chunk_params=tuple(state.chunk_params),
            opt_states=tuple(state.opt_states),
            policy_states=tuple(state.policy_states),
        )

    def head(self, prog, trace, residuals, cotangent, grad_post, loss, grad_tied, n):
        """The last stage's outputs of a forward: ``(sum, count)`` losses get their global count (a collective
        over the replicas) and are scaled or summed for the reduction that follows."""
        n_glob = (
            psum_over(n, prog.mesh, prog.reduce_axes).astype(jnp.float32)
            if prog.summed
            else jnp.zeros((), jnp.float32)
        )
        if prog.counting:
            loss = psum_over(
                loss, prog.mesh, prog.reduce_axes
            )  # the metric: summed, over the summed counts (below)
        elif prog.summed:
            # (sum, count): this micro-batch's loss over every replica's real tokens -- scaled here so
            # that the pmean over replicas in B gives sum over replicas / global count
            # a micro-batch whose every token is masked (count 0) contributes nothing, not 0/0
            scale = jnp.where(n_glob > 0, prog.num_replicas / jnp.where(n_glob > 0, n_glob, 1.0), 0.0)
            loss, grad_post, grad_tied, cotangent = (
                loss * scale,
                *jax.tree.map(lambda g: g * scale.astype(g.dtype), (grad_post, grad_tied, cotangent)),
            )
        return (
            blank(prog, trace),
            residuals,
            cast(cotangent, prog.x_aval),
            grad_post,
            loss.astype(jnp.float32),
            blank_tie(prog, trace),
            grad_tied,
            n_glob,
        )

    def with_partial(self, prog, trace, chunk, grad, carry):
        return grad

    def idle_grad(self, prog, trace, chunk_params, carry):
        return zero_like(prog, trace, chunk_params[0])

    def call_loss(self, prog, lsum, lcount, lweight, errors):
        """The call's loss metric over the stages and replicas, its count, the version errors."""
        lsum, lcount, lweight = lax.psum((lsum, lcount, lweight), STAGE)
        lsum = pmean_over(lsum, prog.mesh, prog.reduce_axes)
        lcount = lax.pmax(lcount, DP_AXES)
        if (
            prog.counting
        ):  # the summed loss over the summed counts of the call's micro-batches (global already)
            loss = jnp.where(lweight > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan)
        else:
            loss = jnp.where(lcount > 0, lsum / jnp.maximum(lcount, 1), jnp.nan)
        return loss, lcount, lweight, lax.psum(errors, STAGE)

    def finish(self, prog, policy_states, lweight):
        """A summing policy's sums reduced over the replicas once (``(sum, count)`` losses: over the call's
        global count; a chunk may see some micro-batches only)."""
        mesh, RED = prog.mesh, prog.reduce_axes
        reduce = (
            (lambda tree: psum_over(tree, mesh, RED))
            if prog.counting
            else (lambda tree: pmean_over(tree, mesh, RED))
        )
        total = lweight if prog.counting else None
        return tuple(
            p.finish(pstate, reduce, total) if p.finish is not None else pstate
            for p, pstate in zip(prog.policies, policy_states)
        )


class SumAfterCall(AllReduce):
    """Sums in place, reduced once after the call (module docstring)."""

    name = "sum"

    def backward(self, prog, trace, b_in, is_b, state):
        """``(state, grad, message)``: the B lane (``b_in``: a
        :class:`~jaxpipe.runtime.lanes_backward.BackwardIn`) with its sum; the gradient stays in the sums
        (None)."""
        state, send_b = b_lanes_summing(prog, trace, b_in, is_b, state)
        return state, None, send_b

    def apply(self, prog, trace, tick, flags, stacks, lane_op, grad, count, state):
        """``state`` after the B lane's update: nothing to apply (the sums are reduced after the call)."""
        return state


class UpdateEach(AllReduce):
    """Each backward's gradient to its chunk's update (module docstring)."""

    name = "update"

    def backward(self, prog, trace, b_in, is_b, state):
        """``(state, grad, message)``: the B lane's gradient, handed to :meth:`apply`."""
        grad, send_b, _ = lax.cond(
            is_b,
            partial(b_lane, prog, trace),
            partial(b_idle, prog, trace),
            *b_in[:5],  # (chunk, micro-batch, slot, dL/dy, tied gradient)
            (state.chunk_params, state.policy_states, state.carry),
        )
        return state, grad, send_b

    def apply(self, prog, trace, tick, flags, stacks, lane_op, grad, count, state):
        """``state`` after the B lane's chunk took ``grad`` in its update (:func:`b_updates`)."""
        chunk_params, opt_states, policy_states = b_updates(
            prog,
            trace,
            lane_op.runs,
            lane_op.chunk,
            lane_op.microbatch,
            grad,
            count,
            flags,
            state.chunk_params,
            state.opt_states,
            state.policy_states,
        )
        return state._replace(chunk_params=chunk_params, opt_states=opt_states, policy_states=policy_states)


class RingReduction(UpdateEach):
    """Cyclic DP's ring over the data workers (module docstring); the backward runs as
    :class:`UpdateEach`'s."""

    name = "ring"

    def own_spec(self, prog):
        return P((DATA, STAGE))  # each worker holds a replica of its own

    def per_chunk(self, prog, trace, chunk_params, policy_states):
        return views(prog, trace, chunk_params), views(prog, trace, policy_states)

    def operands(self, prog, trace, chunk, chunk_params, policy_states):
        """The stacked candidates (``chunk_params``, ``policy_states``: the stacks), each branch slicing its
        chunk (views sliced outside were materialised: 173 MiB of temp)."""
        return prog.policies[0].choose(chunk_params, policy_states, trace.base, trace.me)[1]

    def candidate(self, prog, trace, chunk_stack, chunk_choice, weights):
        return jax.tree.map(lambda leaf: leaf[chunk_choice], chunk_stack[weights])

    def before_tick(self, prog, trace, state, flags):
        """The stage the last worker sent last tick lands; the lanes read static views of the stacks."""
        if flags[0]:
            chunk_params, policy_states = receive_arrived(
                prog, trace, state.chunk_params, state.policy_states, state.carry.reduce
            )
            state = state._replace(chunk_params=chunk_params, policy_states=policy_states)
        return state, (state.chunk_params, state.opt_states, state.policy_states)

    def end_tick(self, state):
        return state

    def head(self, prog, trace, residuals, cotangent, grad_post, loss, grad_tied, n):
        """Workers run the head at different ticks: nothing collective; counts travel the ring."""
        n = jnp.asarray(n, jnp.float32) if prog.summed else jnp.zeros((), jnp.float32)
        return (
            blank(prog, trace),
            residuals,
            cast(cotangent, prog.x_aval),
            grad_post,
            loss.astype(jnp.float32),
            blank_tie(prog, trace),
            grad_tied,
            n,
        )

    def with_partial(self, prog, trace, chunk, grad, carry):
        """The previous worker's partial sum of this chunk added (none on the first worker)."""
        return jax.tree.map(
            lambda p_, leaf: jnp.where(trace.replica > 0, p_, jnp.zeros_like(p_)) + leaf.astype(p_.dtype),
            jax.tree.map(lambda b: read(b, chunk), carry.reduce.partial),
            grad,
        )

    def idle_grad(self, prog, trace, chunk_params, carry):
        return (
            carry.reduce.gbuf
        )  # the last sum passes through (a fresh fill would be a weight-sized write per tick)

    def apply(self, prog, trace, tick, flags, stacks, lane_op, grad, count, state):
        """``state`` after the ring's exchange of this tick's sums
        (:func:`~jaxpipe.runtime.ring.ring_exchange`)."""
        is_b, chunk_b, _ = lane_op
        chunk_params, opt_states, policy_states, ring_state = ring_exchange(
            prog, trace, tick, *stacks, state.carry.reduce, is_b, chunk_b, grad, count, flags[1]
        )
        return state._replace(
            chunk_params=chunk_params,
            opt_states=opt_states,
            policy_states=policy_states,
            carry=state.carry._replace(reduce=ring_state),
        )

    def call_loss(self, prog, lsum, lcount, lweight, errors):
        """Every worker's own micro-batches: the call's losses over their summed weight."""
        lsum, lcount, lweight = lax.psum((lsum, lcount, lweight), (DATA, STAGE))
        loss = jnp.where(lweight > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan)
        return loss, lcount, lweight, lax.psum(errors, (DATA, STAGE))

    def finish(self, prog, policy_states, lweight):
        return policy_states
