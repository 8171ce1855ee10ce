"""The backward lanes of a tick: a micro-batch's backward on the version its forward read, the update
(or a gradient policy's in-place sum), ZB's split backward and its W lane.  Functions over the
executor's :class:`~jaxpipe.runtime.program.Program` and :class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..schedules.layout import ROUTE
from . import front_pack
from .buffers import cast, cond, full, read, where, write
from .collectives import pmean_over, psum_over
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


class BackwardIn(NamedTuple):
    """What a B lane reads this tick (a routing's ``backward_in``)."""

    chunk: Any  # which of the device's chunks
    microbatch: Any  # the micro-batch's index in the call
    slot: Any  # its stash slot; with zero-bubble's split, (stash slot, frontier slot)
    cotangent: Any  # dL/dy, arrived from the stage after
    tied_grad: Any  # the tied arrays' gradient, arrived with it
    count: Any  # the micro-batch's count, arrived with it


def bwd(prog, trace, weights, residuals, cotangent, sums=None, add=None):
    """``(dw, dx, frontier)`` of a backward; split: ``dw`` is None (W computes it) and the frontier is
    what W reads (none where W recomputes).  ``sums`` (a summing policy's stage sums, ``add`` its
    ``add_leaf``; only with ``trace.wfuse``): the whole backward as B's input part then W's added into the
    sums in place, and the first value is the new sums -- the same products as the fused backward without its
    zero-filled stacked weight gradient and the pass adding it (one core, testbed stage: 11.3 -> 9.2 ms)."""
    if sums is not None:
        dx, front = trace.wfuse.input_part(weights, residuals, cotangent)
        return trace.wfuse.weight_part_into(weights, residuals, cotangent, front, sums, add), dx, ()
    if not prog.split:
        return (*trace.sop.backward(weights, residuals, cotangent), ())
    if trace.wsp is not None:
        return (None, *trace.wsp.input_part(weights, residuals, cotangent))
    return None, trace.sop.backward(weights, residuals, cotangent)[1], ()


def b_lane(prog, trace, chunk, mb_index, slot, dy_in, t_in, lane_ops, sums=None):
    """``(grad, messages, frontier)``; with ``sums`` (:func:`bwd`) also the new sums, and ``grad``'s stage
    part is None (it is in them)."""
    chunk_params, policy_states, carry = lane_ops
    add = prog.policies[chunk].add_leaf if sums is not None else None  # c is static there (b_lanes_summing)
    gi = trace.base + mb_index
    res = list(carry.stash) if prog.direct else [read(a, slot) for a in carry.stash]
    last, first = is_last(prog, trace, chunk), is_first(prog, trace, chunk)
    dy = prog.routing.last_dy(prog, carry, last, dy_in)
    policy, (params,), (pstate,) = (
        prog.policies[0],
        *(v[:1] for v in per_chunk(prog, trace, chunk_params, policy_states)),
    )
    pre_p = None
    if not prog.by_branch and policy.backward_is_current is not None:
        # stages predicting by 0 read lp itself: no weight-sized axpy
        dw, dx, front = lax.cond(
            policy.backward_is_current(trace.me),
            lambda: bwd(prog, trace, params[0], res, dy, sums, add),
            lambda: bwd(
                prog, trace, policy.backward_weights(params, pstate, gi, trace.me)[0], res, dy, sums, add
            ),
        )
    elif not prog.by_branch:
        w, pre_p, _ = policy.backward_weights(params, pstate, gi, trace.me)
        dw, dx, front = bwd(prog, trace, w, res, dy, sums, add)
    else:
        ch = choices(prog, trace, mb_index, *per_chunk(prog, trace, chunk_params, policy_states))
        brs, start = [], []
        for cc, (_, cands) in enumerate(ch):
            start.append(len(brs))
            brs += [
                (
                    lambda cc, value: (
                        lambda cs, r, d, sm: bwd(
                            prog, trace, candidate(prog, trace, cs, cc, value)[0], r, d, sm, add
                        )
                    )
                )(cc, v)
                for v in range(len(cands))
            ]
        idx = pick(prog, trace, chunk, [start[cc] + ch[cc][0] for cc in range(prog.num_chunks)])
        dw, dx, front = lax.switch(
            idx, brs, operands(prog, trace, ch, chunk_params, policy_states), res, dy, sums
        )
    new_sums, dw = (dw, None) if sums is not None else (None, dw)
    dx = cast(dx, prog.x_aval)
    dpre = zero_like(prog, trace, params[1])
    # the tied arrays' last-stage gradient of this micro-batch, on its way to stage 0
    t_grad = prog.routing.last_tie_grad(prog, carry, last, t_in)
    if jax.tree.leaves(params[1]):

        def pre_grad():
            q0 = pre_p if pre_p is not None else policy.backward_weights(params, pstate, gi, trace.me)[1]
            return prog.ties.add_to_pre(trace.sop.pre_grad(q0, trace.mb_of(mb_index), dx), t_grad)

        dpre = lax.cond(first, pre_grad, lambda: zero_like(prog, trace, params[1]))
    # a lane plan's stream summed post's gradient at its forwards (None: nothing to add here)
    dpost = prog.routing.last_head_grad(prog, carry, last, params)
    grad = (dw, dpre, dpost)
    grad = prog.reduction.with_partial(
        prog, trace, chunk, grad, carry
    )  # a ring: the previous worker's partial sum
    out = grad, (where(first, blank(prog, trace), dx), where(first, blank_tie(prog, trace), t_grad)), front
    return out if sums is None else out + (new_sums,)


def b_idle(prog, trace, chunk, mb_index, slot, dy_in, t_in, lane_ops):
    chunk_params, policy_states, carry = lane_ops
    return (
        prog.reduction.idle_grad(prog, trace, chunk_params, carry),
        (blank(prog, trace), blank_tie(prog, trace)),
        (),
    )


def b_apply(prog, trace, chunk, mb_index, grad, count, params, opt_state, pstate):
    # the update, in a conditional of its own: one that also ran the backward (reading the weights
    # it then updates) made XLA copy the weights twice per tick (HLO-checked, BUILD_NOTES)
    gi = trace.base + mb_index
    policy = prog.policies[chunk]
    if policy.finish is not None:  # local sums, reduced once after the call
        return policy.update(
            grad, params, opt_state, pstate, gi, trace.me, count=count if prog.counting else None
        )
    if prog.counting:  # sums over replicas; the policy divides the step's sum by the step's count
        return policy.update(
            psum_over(grad, prog.mesh, prog.reduce_axes), params, opt_state, pstate, gi, trace.me, count=count
        )
    return policy.update(
        pmean_over(grad, prog.mesh, prog.reduce_axes), params, opt_state, pstate, gi, trace.me
    )


def b_lanes_summing(prog, trace, b_in: BackwardIn, is_b, state):
    """``(state, message)``: the B lane ``b_in`` for policies that only sum gradients (``finish``): one
    predicate conditional per chunk runs the backward and adds its gradient to the chunk's sums in place --
    a weight-sized gradient handed out of the backward's conditional to an update's was written and read
    again every tick (+25% on a flushing schedule, measured against the deleted lane executor).  ``state``:
    the tick's :class:`~jaxpipe.runtime.ticks.TickState`."""
    chunk_b, mb_b, slot_b, dy_in, tb_in, count = b_in
    chunk_params, opt_states, policy_states, carry = state[:4]
    packed = trace.fplace is not None  # the frontier goes into B's own stash slot (front_pack)
    policy_states, send_b, fb, stash = list(policy_states), None, carry.front, carry.stash
    for c in range(prog.num_chunks):

        def run(
            mb_index, slots, cotangent, t_in, n, pstate, fb, chunk=c, carry_c=carry._replace(stash=stash)
        ):  # the stash as last put
            slot, f_slot = slots if trace.wsp is not None else (slots, None)
            fuse = trace.wfuse is not None  # the stage's gradient added into the sums in place (bwd)
            grad, snd, front, *sums = b_lane(
                prog,
                trace,
                chunk,
                mb_index,
                slot,
                cotangent,
                t_in,
                (
                    chunk_params,
                    tuple(policy_states[:chunk]) + (pstate,) + tuple(policy_states[chunk + 1 :]),
                    carry_c,
                ),
                sums=prog.policies[chunk].sums[0](pstate) if fuse else None,
            )
            if packed:  # out of this conditional, into the stash by the next (one that read and wrote
                fb = front  # the stash made XLA copy it)
            elif trace.wsp is not None:  # the frontier into its slot (the plan's, B to W)
                fb = [write(a, f_slot, f) for a, f in zip(fb, front)]
            if fuse:  # the new sums in first: nothing reads the old ones after (else XLA copied them)
                pstate = prog.policies[chunk].sums[1](pstate, sums[0])
            return (
                b_apply(
                    prog, trace, chunk, mb_index, grad, n, chunk_params[chunk], opt_states[chunk], pstate
                )[2],
                fb,
                snd,
            )

        def idle(mb_index, slot, cotangent, t_in, n, pstate, fb):
            return pstate, fb, (blank(prog, trace), blank_tie(prog, trace))

        mine = is_b if is_b is True and prog.num_chunks == 1 else is_b & (chunk_b == c)
        f_in = full(trace.wsp.frontier_avals, jnp.nan if prog.nan_bubbles else 0) if packed else fb
        policy_states[c], fb, snd = cond(
            mine, run, idle, mb_b, slot_b, dy_in, tb_in, count, policy_states[c], f_in
        )
        if packed:
            stash = cond(
                mine,
                lambda st, f: front_pack.put(st, slot_b[0], f, trace.fplace),
                lambda st, f: st,
                stash,
                fb,
            )
        send_b = snd if send_b is None else where(chunk_b == c, snd, send_b)
    carry = carry._replace(stash=stash, **({} if packed else {"front": fb}))
    return state._replace(policy_states=tuple(policy_states), carry=carry), send_b


def w_lanes(prog, trace, tick, lane, rw, state):
    """``state`` (the tick's :class:`~jaxpipe.runtime.ticks.TickState`) after ZB's W lane ``lane`` (``rw``:
    its route row): the weight gradient of the micro-batch whose B ran earlier, from its residuals and its
    dL/dy (kept in their slots until now) and, split at the frontier, the per-layer output gradients its B
    kept; added to the chunk's sums (one predicate conditional per chunk)."""
    is_w, cw, gw = op_of(prog, trace, tick, trace.me, lane)
    chunk_params, opt_states, policy_states, carry = state[:4]
    policy_states = list(policy_states)
    for c in range(prog.num_chunks):

        def run(mb_index, rw, pstate, chunk=c):
            res = [read(a, rw[ROUTE["stash"]]) for a in carry.stash]
            dy = read(carry.mbuf[0], rw[ROUTE["in"]])
            if trace.wsp is not None:
                front = (
                    front_pack.get(carry.stash, rw[ROUTE["stash"]], trace.wsp.frontier_avals, trace.fplace)
                    if trace.fplace is not None
                    else [read(a, rw[ROUTE["front"]]) for a in carry.front]
                )
                policy = prog.policies[chunk]
                if policy.add_leaf is not None and policy.sums is not None:  # added into the sums in place
                    get, put = policy.sums
                    return put(
                        pstate,
                        trace.wsp.weight_part_into(
                            chunk_params[chunk][0], res, dy, front, get(pstate), policy.add_leaf
                        ),
                    )
                dw = trace.wsp.weight_part(chunk_params[chunk][0], res, dy, front)
            else:
                dw = trace.sop.backward(chunk_params[chunk][0], res, dy)[0]
            return prog.policies[chunk].update(
                (dw, None, None),
                chunk_params[chunk],
                opt_states[chunk],
                pstate,
                trace.base + mb_index,
                trace.me,
            )[2]

        policy_states[c] = lax.cond(
            is_w & (cw == c), run, lambda g, rw, pstate: pstate, gw, rw, policy_states[c]
        )
    return state._replace(policy_states=tuple(policy_states))


def b_updates(prog, trace, is_b, chunk_b, mb_b, grad, count, flags, chunk_params, opt_states, policy_states):
    """The backward's update of its chunk: one conditional per chunk, each output either its operand or a
    new value (no copies); a pending version applied; an in-scan landing where the policy lands."""
    chunk_params, opt_states, policy_states = list(chunk_params), list(opt_states), list(policy_states)
    for c in range(prog.num_chunks):
        mine = is_b & (chunk_b == c)
        chunk_params[c], opt_states[c], policy_states[c] = lax.cond(
            mine,
            lambda *leaf, c=c: b_apply(prog, trace, c, *leaf),
            lambda g, gr, n, *leaf: leaf,
            mb_b,
            grad,
            count,
            chunk_params[c],
            opt_states[c],
            policy_states[c],
        )
        if prog.policies[c].apply_pending is not None:
            chunk_params[c] = lax.cond(
                mine,
                prog.policies[c].apply_pending,
                lambda params, pstate: params,
                chunk_params[c],
                policy_states[c],
            )
        if prog.in_scan and flags:
            chunk_params[c], opt_states[c], policy_states[c] = lax.cond(
                mine & prog.policies[c].lands(trace.base + mb_b),
                lambda *leaf, c=c: prog.policies[c].land(
                    *leaf, counting=prog.counting, b=(trace.base + mb_b) // prog.M
                ),
                lambda *leaf: leaf,
                chunk_params[c],
                opt_states[c],
                policy_states[c],
            )
    return chunk_params, opt_states, policy_states
