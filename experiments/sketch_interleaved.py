"""The interleaved 1F1B sketch, a baseline for the two-chunk schedules: Megatron's looped placement (model
stage ``s`` on device ``s % D`` as chunk ``s // D``) in one ``shard_map``, lockstep ticks of two lanes --
each device runs at most one forward, then one backward, each under ``lax.cond`` with the chunk's weights
picked from a stacked ``[V, ...]`` array by a dynamic index, a ring ``ppermute`` after each lane -- the
residuals of ``jax.vjp`` in a stash whose slots are assigned in NumPy, weights never stashed. ``chunks=1``
is the same program's two-lane 1F1B. Copied, as functions, from the project's reference sketch so that
:mod:`experiments.two_devices` (``--sketch``) and :mod:`experiments.peer` time it beside jaxpipe on the
two-process testbed, on a machine that has only the repository. Not library code.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.sketch_two_lane import scanned_stage

NEVER = 1 << 30


class GreedyPlan(NamedTuple):
    """The sketch's tables: ``table[lane, (micro-batch, chunk, slot), tick, device]`` (lane 0 forwards, 1
    backwards; -1 idle), the stash slots a device needs, and the lockstep makespan in one layer's forwards
    (a backward costs two)."""

    table: np.ndarray
    stash_slots: int
    makespan: int


def greedy_plan(devices: int, microbatches: int, chunks: int, layers: int) -> GreedyPlan:
    """An as-soon-as-possible lockstep simulation: each tick each device runs at most one forward and one
    backward whose input arrived the tick before (the last stage's backward may follow its own forward in the
    same tick); the forward takes the lowest ready (group of D micro-batches, chunk, micro-batch), the
    backward the lowest (group, -chunk, micro-batch)."""
    D, M, V = devices, microbatches, chunks
    S = V * D
    f_at, b_at = np.full((M, S), NEVER), np.full((M, S), NEVER)
    on = lambda d: [(m, s) for m in range(M) for s in range(d, S, D)]
    t = 0
    while (b_at == NEVER).any():
        for d in range(D):
            ready = [
                (m // D, s // D, m, s)
                for m, s in on(d)
                if f_at[m, s] == NEVER and (s == 0 or f_at[m, s - 1] < t)
            ]
            if ready:
                f_at[min(ready)[2:]] = t
        for d in range(D):
            ready = [
                (m // D, -(s // D), m, s)
                for m, s in on(d)
                if b_at[m, s] == NEVER and (f_at[m, s] <= t if s == S - 1 else b_at[m, s + 1] < t)
            ]
            if ready:
                b_at[min(ready)[2:]] = t
        t += 1
    # the program keeps no receive buffer: every message is consumed the tick after it was sent
    assert (f_at[:, 1:] == f_at[:, :-1] + 1).all() and (b_at[:, :-1] == b_at[:, 1:] + 1).all()
    table, slots = np.full((2, 3, t, D), -1, np.int32), 0
    for d in range(D):  # stash slots: interval colouring, a residual lives from its F tick to its B tick
        free = []
        for m, s in sorted(on(d), key=lambda ms: f_at[ms]):
            k = next((i for i, end in enumerate(free) if end <= f_at[m, s]), len(free))
            free[k : k + 1] = [b_at[m, s] + 1]
            table[0, :, f_at[m, s], d] = m, s // D, k
            table[1, :, b_at[m, s], d] = m, s // D, k
        slots = max(slots, len(free))
    per = layers // S
    span = sum(per * (table[0, 0, k] >= 0).any() + 2 * per * (table[1, 0, k] >= 0).any() for k in range(t))
    return GreedyPlan(table, slots, int(span))


def _global(mesh, spec, value):
    """``value`` (the same host array on every process) as a global array on ``mesh`` (several processes)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])


def sketch_step(weights, x, y, devices: int, microbatches: int, chunks: int):
    """``(step, args, plan)``: the sketch's jitted ``(loss, gradient)`` over ``devices * chunks`` model
    stages, its arguments on a mesh of the first ``devices`` devices (processes included), and its
    :class:`GreedyPlan`; ``step(*args)`` runs it.

    Args:
        weights: ``[layers, H, H]``, cut into ``devices * chunks`` stages.
        x: ``[B, H]`` inputs.
        y: ``[B, H]`` targets (the loss: the mean squared error of the last layer's output).
        devices: D.
        microbatches: M.
        chunks: V, model stages a device (1: the two-lane 1F1B).

    Returns:
        ``(step, args, plan)``; the gradient comes back as ``[D, V, layers / (D V), H, H]``.
    """
    D, M, V = devices, microbatches, chunks
    L, H, B = weights.shape[0], weights.shape[-1], x.shape[0]
    plan = greedy_plan(D, M, V, L)
    mesh = jax.make_mesh((D,), ("stage",), devices=jax.devices()[:D])
    stages = np.asarray(weights).reshape(V, D, L // (V * D), H, H).transpose(1, 0, 2, 3, 4)
    args = (
        _global(mesh, P("stage"), stages),
        _global(mesh, P(), np.asarray(x).reshape(M, B // M, H)),
        _global(mesh, P(), np.asarray(y).reshape(M, B // M, H)),
    )
    pipe = _pipe(plan, D, V, B, H)
    step = jax.jit(
        jax.shard_map(pipe, mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=(P(), P("stage")))
    )
    return step, args, plan


def _pipe(plan: GreedyPlan, D: int, V: int, B: int, H: int):
    """The per-device program: the plan's ticks in a ``lax.scan``."""

    def vary(a):
        return (
            a
            if "stage" in str(jax.typeof(a).manual_axis_type)
            else jax.lax.pcast(a, ("stage",), to="varying")
        )

    def f_any(w, h, target):
        out = scanned_stage(w, h)
        return out, jnp.sum((out - target) ** 2) / (B * H)

    def pipe(stage_weights, xs, ys):
        w = stage_weights[0]  # this device's V chunks, [V, layers, H, H]
        d, table = jax.lax.axis_index("stage"), jnp.asarray(plan.table)
        w0 = w[0]
        _, vjp0 = jax.vjp(f_any, w0, vary(xs[0]), vary(ys[0]))
        leaves0, tdef = jax.tree_util.tree_flatten(vjp0)
        is_w = [leaf is w0 for leaf in leaves0].index(True)
        stash = [
            None if i == is_w else vary(jnp.zeros((plan.stash_slots,) + leaf.shape, leaf.dtype))
            for i, leaf in enumerate(leaves0)
        ]
        zero = vary(jnp.zeros(xs.shape[1:]))

        def tick(carry, t):
            stash, recv_f, recv_b, grads, loss = carry
            f_mb, f_chunk, f_slot = table[0, :, t, d]
            b_mb, b_chunk, b_slot = table[1, :, t, d]

            def forward(stash, loss):
                inp = jnp.where((d == 0) & (f_chunk == 0), xs[f_mb], recv_f)
                (out, part), vjp = jax.vjp(f_any, w[f_chunk], inp, vary(ys[f_mb]))
                leaves = jax.tree_util.tree_leaves(vjp)
                stash = [s if s is None else s.at[f_slot].set(leaf) for s, leaf in zip(stash, leaves)]
                return stash, out, loss + jnp.where((d == D - 1) & (f_chunk == V - 1), part, 0.0)

            def backward(grads):
                vjp = jax.tree_util.tree_unflatten(
                    tdef, [w[b_chunk] if s is None else s[b_slot] for s in stash]
                )
                last = (d == D - 1) & (b_chunk == V - 1)
                g_w, g_x, _ = vjp((jnp.where(last, 0.0, recv_b), jnp.where(last, 1.0, 0.0)))
                return grads.at[b_chunk].add(g_w), g_x

            stash, out, loss = jax.lax.cond(f_mb >= 0, forward, lambda s, lo: (s, zero, lo), stash, loss)
            sent_f = jax.lax.ppermute(out, "stage", [(j, (j + 1) % D) for j in range(D)])
            grads, g_x = jax.lax.cond(b_mb >= 0, backward, lambda g: (g, zero), grads)
            sent_b = jax.lax.ppermute(g_x, "stage", [(j, (j - 1) % D) for j in range(D)])
            return (stash, sent_f, sent_b, grads, loss), None

        carry = (stash, zero, zero, vary(jnp.zeros_like(w)), vary(jnp.zeros(())))
        (_, _, _, grads, loss), _ = jax.lax.scan(tick, carry, jnp.arange(plan.table.shape[2]))
        return jax.lax.psum(loss, "stage"), grads[None]

    return pipe
