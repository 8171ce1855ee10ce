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
from .buffers import F_OUT, cast, cond, read, write
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


def forward_at(prog, trace, first, last):
    # one position's forward on the weights the policy chose: small outputs only (message,
    # residuals, dL/dy and head gradient of the last stage, its loss)
    def op(wF, x_in, t_in, microbatch, context):
        w, pre_p, post_p = wF
        # tied arrays: the version stage 0 reads for this micro-batch, carried to the last stage
        t_mine = prog.ties.pre_leaves(pre_p) if first else t_in
        y, res, head = trace.sop.forward(
            w, x_in, microbatch, pre_p, prog.ties.post_with(post_p, t_mine), first, last, context
        )
        if not last:
            return (
                cast(y, prog.x_aval),
                res,
                x_like(prog, trace),
                zero_like(prog, trace, post_p),
                jnp.zeros((), jnp.float32),
                cast(t_mine, prog.tie_avals),
                zero_like(prog, trace, prog.tie_avals),
                jnp.zeros((), jnp.float32),
            )
        return head_out(prog, trace, res, head)

    return op


def head_out(prog, trace, residuals, head):
    """The last stage's outputs of one micro-batch's forward from its loss head."""
    l, n, grad_post, dy = head
    grad_post, grad_tied = prog.ties.take_post(grad_post)
    return prog.reduction.head(prog, trace, residuals, dy, grad_post, l, grad_tied, n)


def double_at(prog, trace, first, last):
    """Chimera §3.5's forward doubling as one micro-batch of twice the size (``double_batch``): the pair's
    inputs concatenated along the batch axis, one stage forward, the output and the stashed residuals
    split back per micro-batch; the loss head runs per micro-batch.  Two forward outputs, as
    :func:`forward_at`'s."""

    def op(wF, xs, ts, mbs):
        w, pre_p, post_p = wF
        if first:
            xs = tuple(prog.model.pre(pre_p, mb) for mb in mbs)
            ts = (prog.ties.pre_leaves(pre_p),) * 2
        x = jax.tree.map(lambda leaf, b: jnp.concatenate([leaf, b], 0), *xs)
        y, res, _ = trace.sop.forward(w, x, None, pre_p, post_p, False, False, None)
        half = lambda tree, k: jax.tree.map(
            lambda leaf: leaf[k * (leaf.shape[0] // 2) : (k + 1) * (leaf.shape[0] // 2)], tree
        )
        outs = []
        for k in range(2):
            yk, rk = half(y, k), [half(r, k) for r in res]
            if last:
                outs.append(
                    head_out(prog, trace, rk, trace.sop.head(prog.ties.post_with(post_p, ts[k]), yk, mbs[k]))
                )
            else:
                outs.append(
                    (
                        cast(yk, prog.x_aval),
                        rk,
                        x_like(prog, trace),
                        zero_like(prog, trace, post_p),
                        jnp.zeros((), jnp.float32),
                        cast(ts[k], prog.tie_avals),
                        zero_like(prog, trace, prog.tie_avals),
                        jnp.zeros((), jnp.float32),
                    )
                )
        return tuple(outs)

    return op


def f_lane(prog, trace, chunk, mb_index, slot, x_in, t_in, lane_ops):
    """The F lane's forward of ``chunk`` on the call's micro-batch ``mb_index``, its output accounted
    (:func:`f_account`): ``((policy_states, carry, loss), message)``.  A predicate cond around the position
    switch (docs/design.md §2 lanes), so that nothing big passes through a multi-way conditional (XLA
    copies such pass-throughs every tick)."""
    chunk_params, policy_states, carry, loss = lane_ops
    gi = trace.base + mb_index
    mb = trace.mb_of(mb_index)
    pos = chunk_position(prog, trace, chunk)
    # global micro-batch gi is micro-batch gi mod M of step gi // M on model stage c D + me: the
    # synchronous schedules' keys
    key = prog.model_key(gi // prog.M, trace.replica * prog.M + gi % prog.M)
    ctx = trace.sop.context(mb, key, stage_of(prog, trace, chunk))
    inputs = (x_in, t_in, mb, ctx)
    if prog.by_branch:
        chosen = choices(prog, trace, mb_index, *per_chunk(prog, trace, chunk_params, policy_states))
        out = _forward_by_branch(prog, trace, chunk, pos, chosen, chunk_params, policy_states, inputs)
    else:
        out, policy_states = _forward_one_policy(prog, trace, gi, pos, chunk_params, policy_states, inputs)
    carry, loss, send = f_account(prog, trace, chunk, slot, out, carry, loss)
    return (policy_states, carry, loss), send


def chunk_position(prog, trace, chunk):
    """The index of ``chunk``'s forward variant this tick (``trace.variants[chunk]``): its stage position
    remapped to the positions its plan uses."""
    remapped = [jnp.asarray(prog.remap[c])[position(prog, trace, c)] for c in range(prog.num_chunks)]
    return pick(prog, trace, chunk, remapped)


def _forward_one_policy(prog, trace, gi, pos, chunk_params, policy_states, inputs):
    """``(output, policy_states)``: the forward of one chunk under one policy, at the weights it reads for
    global micro-batch ``gi``.  A predicting policy's stages that predict by 0 read the weights themselves
    (no weight-sized axpy); the others predict inside each position's branch, beside the forward that reads
    the prediction: made outside and passed in, the predicted weights were materialised (spectrain
    1.28-1.35x -> 1.19-1.24x of micro_momentum, pipeoptim 0.95 -> 0.89x of micro_adamw, one-process A/B,
    BUILD_NOTES.md)."""
    policy, params, pstate = prog.policies[0], chunk_params[0], policy_states[0]
    variants = trace.variants[0]
    w_forward, pstate = policy.forward_weights(params, pstate, gi, trace.me)
    if policy.forward_is_current is None:
        return lax.switch(pos, variants, w_forward, *inputs), (pstate,)

    def predicted(variant):
        return lambda params_, pstate_, *leaf: variants[variant](
            policy.forward_weights(params_, pstate_, gi, trace.me)[0], *leaf
        )

    out = lax.cond(
        policy.forward_is_current(trace.me),
        lambda: lax.switch(pos, variants, params, *inputs),
        lambda: lax.switch(pos, [predicted(v) for v in range(len(variants))], params, pstate, *inputs),
    )
    return out, (pstate,)


def _forward_by_branch(prog, trace, chunk, pos, chosen, chunk_params, policy_states, inputs):
    """The forward with one branch per chunk, stored weight version and position (``chosen``: each chunk's
    ``(version index, candidates)``, :func:`choices`): the chosen version is never copied."""
    branches, first_of_chunk = [], []
    for c, (_, candidates) in enumerate(chosen):
        first_of_chunk.append(len(branches))
        n = len(trace.variants[c])
        branches += [
            (
                lambda c, version, variant: (
                    lambda cs, *leaf: trace.variants[c][variant](
                        candidate(prog, trace, cs, c, version), *leaf
                    )
                )
            )(c, version, variant)
            for version in range(len(candidates))
            for variant in range(n)
        ]
    version = pick(prog, trace, chunk, [k for k, _ in chosen])
    first = [first_of_chunk[c] + version * len(trace.variants[c]) for c in range(prog.num_chunks)]
    index = pick(prog, trace, chunk, first) + pos
    return lax.switch(index, branches, operands(prog, trace, chosen, chunk_params, policy_states), *inputs)


def f_account(prog, trace, chunk, slot, out, carry, loss):
    """One forward's outputs into the state: residuals to their stash slot, the last stage's dL/dy and
    head gradient, the loss; returns the lane's message."""
    msg, res, dy, grad_post, l, t_out, grad_tied, count = out
    last = is_last(prog, trace, chunk)
    # a direct hand-over (D = 1): the residuals go to this tick's B as they are, no stash slot
    carry = carry._replace(
        stash=list(res) if prog.direct else [write(a, slot, r) for a, r in zip(carry.stash, res)]
    )
    carry, send = prog.routing.last_forward(prog, last, msg, dy, grad_post, t_out, grad_tied, count, carry)
    # the metric: losses over their weight -- 1 each, or a (sum, count) loss's count on a ring
    weight = count if prog.counting else jnp.ones((), jnp.float32)
    loss = (
        loss[0] + jnp.where(last, l, 0.0),
        loss[1] + last.astype(jnp.int32),
        loss[2] + jnp.where(last, weight, 0.0),
    )
    return carry, loss, send


def f_lanes_paired(prog, trace, tick, route_row, is_f, chunk_f, mb_f, slot_f, x_in, t_in, lane_ops):
    """The F lane and its F2 pair lane (Chimera's forward doubling on the ordered placement): one doubled
    forward where both run (the plan pairs forwards of one stage position), the F lane alone where only
    it does.  A sum-only policy's current weights (no version choice)."""
    is_f2, cf2, gf2 = op_of(prog, trace, tick, trace.me, prog.lane_f2)
    x2_in, t2_in = (read(a, route_row[prog.lane_f2, ROUTE["in"]]) for a in lane_ops[2].mbuf[:2])
    s2 = route_row[prog.lane_f2, ROUTE["stash"]]
    nothing = (
        blank(prog, trace),
        blank_tie(prog, trace),
        jnp.full((), jnp.nan if prog.nan_bubbles else 0, jnp.float32),
    )

    def single(lane_ops):
        (policy_states, carry, loss), send = f_cond(
            prog, trace, is_f, chunk_f, mb_f, slot_f, x_in, t_in, lane_ops=lane_ops
        )
        return (policy_states, carry, loss), send, nothing

    def double(lane_ops):
        chunk_params, policy_states, carry, loss = lane_ops
        pos = chunk_position(prog, trace, chunk_f)
        branches, first_of_chunk = [], []
        for c in range(prog.num_chunks):
            first_of_chunk.append(len(branches))
            branches += [
                (lambda c, variant: lambda params, *leaf: trace.doubles[c][variant](params[c], *leaf))(c, v)
                for v in range(len(trace.doubles[c]))
            ]
        index = pick(prog, trace, chunk_f, first_of_chunk) + pos
        oa, ob = lax.switch(
            index, branches, chunk_params, (x_in, x2_in), (t_in, t2_in), (trace.mb_of(mb_f), trace.mb_of(gf2))
        )
        carry, loss, send_a = f_account(prog, trace, chunk_f, slot_f, oa, carry, loss)
        carry, loss, send_b = f_account(prog, trace, chunk_f, s2, ob, carry, loss)
        return (policy_states, carry, loss), send_a, send_b

    return f_cond(prog, trace, is_f2, lane_ops=lane_ops, branches=(double, single))


def f_cond(prog, trace, pred, *args, lane_ops, branches=None):
    """``lax.cond(pred, f_lane, f_idle, *args, ops)`` (or ``branches(ops)``) with only what a forward
    writes as the conditional's outputs -- the stash, the last stage's registers, the loss (and the
    policy states where a forward may change them): the rest of the in-flight state (ring of
    micro-batches, message buffers) and a sum-only policy's gradient sums stay operands, which XLA does
    not copy; passed through, they were (+6-13% on the flushing schedules, HLO temp +4 MiB)."""
    chunk_params, policy_states, carry, loss = lane_ops

    def slim(fn):
        def run(*a):
            (states, carry_out, loss_out), *sends = fn(*a)
            written = tuple(getattr(carry_out, f) for f in F_OUT)
            return ((() if prog.fused else states), written, loss_out), *sends

        return run

    if branches is None:
        out = cond(
            pred, slim(partial(f_lane, prog, trace)), slim(partial(f_idle, prog, trace)), *args, lane_ops
        )
    else:
        out = lax.cond(pred, slim(branches[0]), slim(branches[1]), lane_ops)
    (states_out, written, loss), *sends = out
    carry = carry._replace(**dict(zip(F_OUT, written)))
    return (policy_states if prog.fused else states_out, carry, loss), *sends


def f_idle(prog, trace, chunk, mb_index, slot, x_in, t_in, lane_ops):
    chunk_params, policy_states, carry, loss = lane_ops
    return (policy_states, carry, loss), prog.routing.idle_message(
        prog, blank(prog, trace), blank_tie(prog, trace)
    )
