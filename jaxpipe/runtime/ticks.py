"""A lockstep tick (its F, F2, B and W lanes, the messages they send), the call's scans over the plan's
phases, and what happens between scans (landings, Chimera's eager exchange).  Functions over the
executor's :class:`~jaxpipe.runtime.program.Program` and :class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..axes import STAGE
from ..schedules.ir import F, W, kind_of
from ..schedules.layout import ROUTE
from .call_base import errors_of, is_first, op_of, per_chunk
from .lanes_backward import BackwardIn, w_lanes
from .lanes_forward import f_cond, f_lanes_paired


class LaneOp(NamedTuple):
    """A lane's action this tick on this device (:func:`~jaxpipe.runtime.call_base.op_of`)."""

    runs: Any  # whether the lane runs here this tick (True: on every device, no conditional)
    chunk: Any  # which of the device's chunks
    microbatch: Any  # the micro-batch's index in the call


class TickState(NamedTuple):
    """What a call's scan carries from tick to tick (chunks as tuples, one entry per chunk of the device)."""

    chunk_params: Any  # each chunk's stage weights
    opt_states: Any  # each chunk's optimizer state
    policy_states: Any  # each chunk's weight-policy state (versions, stashes, gradient sums)
    carry: Any  # the in-flight buffers: messages, stash, counters (.inflight)
    loss: Any  # (loss sum, count, weight) of the call so far


def scan_phases(prog, trace, state: TickState) -> TickState:
    """The call's scans, one per phase (``segments``: a tick range and its static flags), with the landings
    and Chimera's eager exchanges between them."""
    state = TickState(*state)
    for a, b, flags in prog.segments:
        ticks = trace.t0 + jnp.arange(a, b, dtype=jnp.int32)
        if prog.fused:  # sum-only policies never write the weights: they stay out of the loop's state
            fixed = state[:2]  # (chunk_params, opt_states)

            def scan_tick(moving, tick_index, fixed=fixed, flags=flags):
                new = _loss_carried(
                    tick(prog, trace, TickState(*fixed, *moving), tick_index, flags)[0], tick_index
                )
                return tuple(new[2:]), None

            moving, _ = lax.scan(scan_tick, tuple(state[2:]), ticks)
            state = TickState(*fixed, *moving)
        else:
            state, _ = lax.scan(
                lambda s_, tick_index, flags=flags: (
                    _loss_carried(tick(prog, trace, s_, tick_index, flags)[0], tick_index),
                    None,
                ),
                state,
                ticks,
            )
        state = land_between(prog, trace, state, b)
        if b in prog.eager:
            state = exchange_between(prog, trace, state, prog.eager[b])
    return state


def _loss_carried(state: TickState, tick_index) -> TickState:
    """``state`` with its loss sums written by every tick: selected by a predicate XLA cannot evaluate (the
    tick index or 1 is never 0), so a phase without the last stage's forwards still computes them and they
    leave the call's last loop as that loop's own result.

    Trap (XLA CPU): its runtime orders instructions by the buffers they read and write, not by the
    program's data edges.  A loop that passes a value through unchanged never writes it, and a collective
    reading it after the loop -- the loss's all-reduces -- may start on one device while another still runs
    the loop: ZB-H1 on four devices deadlocked that way (BUILD_NOTES, "The executor";
    ``tests/hlo_order.py``'s ``orders_only_on_paper`` finds such pairs).  An optimization barrier kept the
    sums a loop output for XLA's passes but was removed before the runtime, leaving them passed through."""
    written = jnp.bitwise_or(tick_index, 1) != 0
    loss = jax.tree.map(lambda x: jnp.where(written, x, jnp.zeros_like(x)), state.loss)
    return state._replace(loss=loss)


def tick(prog, trace, state: TickState, tick_index, flags=True):
    """One tick: its lanes in the plan's order (F, F2, B, W; a second lane of a kind, F', B', W', runs as its
    kind's), then the tick's one exchange.  ``flags`` (static, per scan segment): whether an in-scan landing
    may happen in it; on a ring, (may land an arrived stage, may complete a sum); a lane plan's phase: the
    lanes some device uses in these ticks (the others are not compiled here)."""
    state = TickState(*state)
    trace.outbox.clear()  # (what an interrupted trace may have left)
    # the lanes compiled here; this device's route rows
    run, route_row = prog.routing.lanes(prog, trace, tick_index, flags)
    state, stacks = prog.reduction.before_tick(prog, trace, state, flags)
    err = jnp.zeros((), jnp.int32)
    for lane, kind in enumerate(prog.kinds):
        if not run[lane] or lane == prog.lane_f2:  # F2 runs beside the F lane (a pair)
            continue
        runs, chunk, mb = op_of(prog, trace, tick_index, trace.me, lane)
        lane_op = LaneOp(True if run[lane] == 2 else runs, chunk, mb)  # 2: busy everywhere, no conditional
        if kind_of(kind) == W:  # ZB's W lane (a lane plan's: W reads its slots), also in a phase without B
            state = w_lanes(prog, trace, tick_index, lane, route_row[lane], state)
            continue
        weights = per_chunk(prog, trace, state.chunk_params, state.policy_states)[1]
        err = err + errors_of(prog, trace, chunk, mb, lane_op.runs, weights)
        if kind_of(kind) == F:
            state = forward_lanes(prog, trace, tick_index, lane, route_row, run, lane_op, state)
        else:
            state = backward_lanes(prog, trace, tick_index, lane, route_row, flags, lane_op, stacks, state)
    carry = prog.routing.exchange(prog, trace, state.carry)  # the tick's messages, in one exchange
    carry = carry._replace(errors=carry.errors + err, **({"stash": []} if prog.direct else {}))
    return prog.reduction.end_tick(state._replace(carry=carry)), None


def forward_lanes(prog, trace, tick_index, lane, route_row, run, lane_op, state: TickState) -> TickState:
    """The tick's F lane ``lane`` (with its F2 pair where the plan has one) and the messages they send."""
    is_f, chunk_f, mb_f = lane_op
    x_in, t_in, slot_f = prog.routing.forward_in(
        prog, trace, tick_index, route_row, lane, state.carry, chunk_f, mb_f
    )
    lane_ops = (state.chunk_params, state.policy_states, state.carry, state.loss)
    if prog.paired and run[prog.lane_f2]:  # F2 pairs with F: one forward of the two micro-batches
        (policy_states, carry, loss), send_f, send_f2 = f_lanes_paired(
            prog, trace, tick_index, route_row, is_f, chunk_f, mb_f, slot_f, x_in, t_in, lane_ops
        )
        carry = prog.routing.paired_out(prog, trace, tick_index, route_row, carry, send_f, send_f2)
        return state._replace(policy_states=policy_states, carry=carry, loss=loss)
    (policy_states, carry, loss), send_f = f_cond(
        prog, trace, is_f, chunk_f, mb_f, slot_f, x_in, t_in, lane_ops=lane_ops
    )
    carry = prog.routing.forward_out(prog, trace, tick_index, route_row, lane, carry, send_f)
    return state._replace(policy_states=policy_states, carry=carry, loss=loss)


def backward_lanes(
    prog, trace, tick_index, lane, route_row, flags, lane_op, stacks, state: TickState
) -> TickState:
    """The tick's B lane ``lane``, the update it feeds (or the ring's exchange), and its messages."""
    is_b, chunk_b, mb_b = lane_op
    dy_in, tb_in, count, slot_b = prog.routing.backward_in(
        prog, trace, route_row, lane, state.carry, chunk_b, mb_b
    )
    if trace.wsp is not None:  # B keeps its frontier for W in a slot of its own
        slot_b = (slot_b, route_row[lane, ROUTE["front"]])
    b_in = BackwardIn(chunk_b, mb_b, slot_b, dy_in, tb_in, count)
    state, grad, send_b = prog.reduction.backward(prog, trace, b_in, is_b, state)
    count_out = jnp.where(  # the micro-batch's count goes with dL/dy to the stage before (the first: none)
        is_b & ~is_first(prog, trace, chunk_b),
        count,
        jnp.full((), jnp.nan if prog.nan_bubbles else 0, jnp.float32),
    )
    state = prog.reduction.apply(prog, trace, tick_index, flags, stacks, lane_op, grad, count, state)
    carry = prog.routing.backward_out(
        prog, trace, tick_index, route_row, lane, state.carry, send_b + (count_out,)
    )
    return state._replace(carry=carry)


def land_between(prog, trace, state, tau):
    """The chunks whose batch completes by tick offset ``tau`` land it now (``lag`` calls after it was
    fed), outside any scan: a landing conditional in a scan made XLA copy the weights every tick."""
    if not any(tc == tau for _, tc in prog.lands.values()):
        return state
    chunk_params, opt_states, policy_states, carry, loss = state
    chunk_params, opt_states, policy_states = list(chunk_params), list(opt_states), list(policy_states)
    for c, (lag, tc) in prog.lands.items():
        if tc != tau:
            continue
        bk = trace.t0 // prog.num_ticks - lag
        chunk_params[c], opt_states[c], policy_states[c] = lax.cond(
            (bk >= 0) & (bk * prog.M < trace.n_fed),
            lambda *leaf, c=c: prog.policies[c].land(
                *leaf, counting=prog.counting, b=trace.base // prog.M + bk
            ),
            lambda *leaf: leaf,
            chunk_params[c],
            opt_states[c],
            policy_states[c],
        )
    return TickState(tuple(chunk_params), tuple(opt_states), tuple(policy_states), carry, loss)


def exchange_between(prog, trace, state, pairs):
    """Chimera §3.2: the replica gradients of the stages whose backwards are all done go home now
    (one ``ppermute`` for the group), where the transfer may overlap the rest of the pipeline; the sent
    sums are zeroed, so the exchange after the call adds nothing for them."""
    chunk_params, opt_states, policy_states, carry, loss = state
    (get0, put0), (get1, put1) = prog.policies[0].sums, prog.policies[1].sums
    got = jax.tree.map(lambda leaf: lax.ppermute(leaf, STAGE, list(pairs)), get1(policy_states[1]))
    dst = jnp.isin(trace.me, jnp.asarray([d for _, d in pairs]))
    src = jnp.isin(trace.me, jnp.asarray([r for r, _ in pairs]))
    p0 = put0(
        policy_states[0],
        jax.tree.map(lambda leaf, b: jnp.where(dst, leaf + b, leaf), get0(policy_states[0]), got),
    )
    p1 = put1(
        policy_states[1],
        jax.tree.map(lambda leaf: jnp.where(src, jnp.zeros_like(leaf), leaf), get1(policy_states[1])),
    )
    return TickState(chunk_params, opt_states, (p0, p1), carry, loss)
