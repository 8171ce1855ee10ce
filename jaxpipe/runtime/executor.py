"""The SPMD executor: one ``shard_map`` program that runs a schedule's tables over a device mesh.

Mesh axes ``("pipe", "data", "stage")`` (DESIGN.md §2).  Every device runs the same program: a ``lax.scan``
over lockstep ticks; in each tick it reads its row of the schedule tables (indexed by
``axis_index("stage")``), runs its op with ``lax.switch`` (idle ops compute nothing), then one ``ppermute``
per direction moves activations forward and gradients backward, and the arriving messages are written to
fixed-capacity receive buffers at the slots the IR assigned.

Backward is explicit: F calls ``jax.vjp(stage_fn, w, x)`` and keeps the pullback's residuals in a
fixed-capacity stash -- except the residuals that depend on the weights alone (the weights, slices or
transposes of them; found by a jaxpr dependency walk), which are not copied: B recomputes them from the
weights it must read and rebuilds the pullback.  The last stage's F also runs the loss
and its gradient, and leaves dL/dy in its own backward buffer for its B.  Stage 0's B recomputes ``pre``'s
pullback (an embedding: cheap) instead of stashing it.

Gradients are accumulated over micro-batches on each device (divided by M at the source: the mean loss),
``psum``'d over ``stage`` for the replicated pre/post parameters and averaged over ``pipe``/``data``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..schedules.ir import COLS, OP_B, OP_F, OP_IDLE, Schedule

AXES = ("pipe", "data", "stage")
DP_AXES = ("pipe", "data")
_C = {c: i for i, c in enumerate(COLS)}


def vary(x, axes: Sequence[str] = AXES):
    """Mark ``x`` device-varying over ``axes`` (only the axes it does not vary over yet)."""
    def one(a):
        have = getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", frozenset())
        missing = tuple(ax for ax in axes if ax not in have)
        return lax.pcast(a, missing, to="varying") if missing else a
    return jax.tree.map(one, x)


def residual_mask(stage_fn, w, x) -> Tuple[Tuple[bool, ...], list]:
    """Which leaves of ``jax.vjp(stage_fn, w, x)``'s pullback depend on the activation ``x``.

    Those are stashed by F.  The others are functions of the weights alone (the weights themselves, slices,
    transposes, casts of them): B recomputes them from the weights it must read, so weights are never
    copied into the stash.  Found by a dependency walk over the jaxpr (conservative: an equation with any
    x-dependent input makes all its outputs x-dependent).  Call it in the context the executor traces in
    (inside the ``shard_map``): how many residuals a pullback has can depend on it.  Returns the mask and
    the shapes of the stashed residuals.
    """
    def leaves(w, x):
        return jax.tree.leaves(jax.vjp(stage_fn, w, x)[1])

    jaxpr = jax.make_jaxpr(leaves)(w, x).jaxpr
    n_w = len(jax.tree.leaves(w))
    dep = set(jaxpr.invars[n_w:])
    is_var = lambda v: not hasattr(v, "val")          # Literals carry .val
    for eqn in jaxpr.eqns:
        if any(is_var(v) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    mask = tuple(is_var(v) and v in dep for v in jaxpr.outvars)
    return mask, [v.aval for v, m in zip(jaxpr.outvars, mask) if m]


def split_residuals(stage_fn, w, x, mask: Sequence[bool]):
    """``jax.vjp`` of one stage; returns (y, residuals to stash, all pullback leaves, treedef)."""
    y, pullback = jax.vjp(stage_fn, w, x)
    leaves, treedef = jax.tree.flatten(pullback)
    if len(leaves) != len(mask):
        raise RuntimeError(f"stage_fn's pullback has {len(leaves)} residuals here but {len(mask)} when "
                           f"analysed; stage_fn must trace the same way every time")
    return y, [l for l, m in zip(leaves, mask) if m], leaves, treedef


def rebuild_pullback(stage_fn, w, x_like, stashed: List[Any], mask: Sequence[bool]):
    """The pullback of F, from the stashed activation-dependent residuals and weight-only residuals
    recomputed from ``w`` (the forward traced here on a dummy ``x`` is dead code that XLA removes)."""
    _, _, fresh, treedef = split_residuals(stage_fn, w, x_like, mask)
    it = iter(stashed)
    return jax.tree.unflatten(treedef, [next(it) if m else f for f, m in zip(fresh, mask)])


def branch_table(sched: Schedule) -> np.ndarray:
    """``[tick, device]`` branch index: 0 idle, 1 + 2*(kind) + ... see ``_BRANCHES``."""
    t = sched.tables().data
    S = sched.num_model_stages
    first = (t["stage"] == 0).astype(np.int32)
    last = (t["stage"] == S - 1).astype(np.int32)
    pos = first + 2 * last                       # 0 mid, 1 first, 2 last, 3 only (D == 1)
    br = np.zeros_like(t["op"])
    br[t["op"] == OP_F] = 1 + pos[t["op"] == OP_F]
    br[t["op"] == OP_B] = 5 + pos[t["op"] == OP_B]
    return br


_BR, _SW, _DW = len(COLS), len(COLS) + 1, len(COLS) + 2   # extra columns: branch, stash write, dy write


def executor_table(sched: Schedule) -> np.ndarray:
    """The IR tables plus the executor's own columns, ``[T, D, len(COLS) + 3]`` int32.

    Writes that happen every tick (outside the switch) go to the scratch slot (index = capacity) on ticks
    where the op produces nothing to keep.
    """
    tabs = sched.tables()
    t = tabs.data
    is_f = t["op"] == OP_F
    last = t["stage"] == sched.num_model_stages - 1
    stash_w = np.where(is_f, t["stash"], tabs.stash_capacity)
    dy_w = np.where(is_f & last, t["dy_slot"], tabs.bbuf_capacity)
    return np.concatenate([tabs.stacked(), np.stack([branch_table(sched), stash_w, dy_w], -1)],
                          axis=-1).astype(np.int32)


def read(buf, slot):
    return lax.dynamic_index_in_dim(buf, slot, 0, False)


def write(buf, slot, val):
    return lax.dynamic_update_index_in_dim(buf, val.astype(buf.dtype), slot, 0)


def make_grad_fn(model, sched: Schedule, mesh, batch_example, *, nan_bubbles: bool = False) -> Callable:
    """Return ``fn(stage_params, pre_params, post_params, batch) -> (loss, (g_stage, g_pre, g_post))``.

    ``batch_example`` (arrays or ShapeDtypeStructs, global shapes) fixes the shapes the program is built for.
    With ``nan_bubbles`` every buffer starts NaN and idle ops send NaN: a test that the results stay finite
    proves nothing computed in a bubble or left in an unused slot reaches the loss or the gradients.
    """
    D, M = sched.D, sched.M
    tabs = sched.tables()
    table = executor_table(sched)
    # Only the branches this schedule uses are compiled (D == 1 needs 3 of the 9, D > 1 needs 7).
    used = np.unique(table[..., _BR])
    table[..., _BR] = np.searchsorted(used, table[..., _BR])
    n_dp = mesh.shape["pipe"] * mesh.shape["data"]
    stage_fn, pre, post_loss = model.stage_fn, model.pre, model.post_loss

    # Per-device shapes: one micro-batch, one stage's weights, the activation and the stash leaves.
    leaves = jax.tree.leaves(batch_example)
    mbs = leaves[0].shape[0] // (n_dp * M)
    mb_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct((mbs,) + tuple(a.shape[1:]), a.dtype),
                              batch_example)
    w_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), model.stage_params)
    x_aval = jax.eval_shape(pre, model.pre_params, mb_example)
    y_aval = jax.eval_shape(stage_fn, w_example, x_aval)
    model.check_activation(x_aval, y_aval)

    def fill(shape, dtype):
        return jnp.full(shape, jnp.nan if nan_bubbles else 0, dtype)

    def body(stage_p, pre_p, post_p, batch):
        w = jax.tree.map(lambda a: a[0], stage_p)
        w, pre_p, post_p, batch = vary((w, pre_p, post_p, batch))
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        me = lax.axis_index("stage")
        zeros = lambda t: vary(jax.tree.map(jnp.zeros_like, t))
        blank = lambda: vary(fill(x_aval.shape, x_aval.dtype))
        mask, stash_avals = residual_mask(stage_fn, w, vary(jnp.zeros(x_aval.shape, x_aval.dtype)))

        def mb_of(row):
            return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, row[_C["mb"]], 0, False), batch)

        # Every branch returns the same tuple: small *new values* (messages, residuals to stash, dy for its
        # own B) and the gradient/loss accumulators, which a branch that adds nothing passes through
        # untouched (XLA keeps them in place).  Returning a zero gradient from F branches and adding it
        # outside the switch instead costs a weight-sized memset and add every tick (measured: 1.25x on the
        # benchmark MLP).  The stash and receive buffers are written outside the switch.
        #   (send_f, send_b, residuals to stash, dy for own B, (g_w, g_pre, g_post, loss))
        def outputs(acc, send_f=None, send_b=None, res=None, dy=None, dw=None, dpre=None, dpost=None, loss=None):
            gw, gpre, gpost, gl = acc
            add = lambda a, d: a if d is None else jax.tree.map(lambda u, v: u + v.astype(u.dtype), a, d)
            return (blank() if send_f is None else send_f.astype(x_aval.dtype),
                    blank() if send_b is None else send_b.astype(x_aval.dtype),
                    [vary(fill(a.shape, a.dtype)) for a in stash_avals] if res is None else res,
                    blank() if dy is None else dy.astype(x_aval.dtype),
                    (add(gw, dw), add(gpre, dpre), add(gpost, dpost), add(gl, loss)))

        def idle(row, x_in, dy_in, res_in, acc):
            return outputs(acc)

        def fwd(first, last):
            def op(row, x_in, dy_in, res_in, acc):
                mb = mb_of(row) if (first or last) else None
                x = pre(pre_p, mb) if first else x_in
                y, res, _, _ = split_residuals(stage_fn, w, x, mask)
                if not last:
                    return outputs(acc, send_f=y, res=res)
                l, (gq, dy) = jax.value_and_grad(post_loss, argnums=(0, 1))(post_p, y, mb)
                return outputs(acc, res=res, dy=dy / M, dpost=jax.tree.map(lambda g: g / M, gq),
                               loss=(l / M).astype(jnp.float32))
            return op

        def bwd(first, last):
            def op(row, x_in, dy_in, res_in, acc):
                x_like = vary(jnp.zeros(x_aval.shape, x_aval.dtype))
                dw, dx = rebuild_pullback(stage_fn, w, x_like, res_in, mask)(dy_in)
                if not first:
                    return outputs(acc, send_b=dx, dw=dw)
                mb = mb_of(row)
                _, pre_pull = jax.vjp(lambda q: pre(q, mb), pre_p)
                return outputs(acc, dw=dw, dpre=pre_pull(dx.astype(x_aval.dtype))[0])
            return op

        # index = 0 idle; 1..4 F (mid, first, last, only); 5..8 B (mid, first, last, only)
        flags = [(False, False), (True, False), (False, True), (True, True)]
        branches = [idle] + [fwd(*f) for f in flags] + [bwd(*f) for f in flags]
        branches = [branches[i] for i in used]

        def tick(c, rows):
            stash, fbuf, bbuf, gw, gpre, gpost, loss = c
            row = rows[me]
            x_in = read(fbuf, row[_C["in_slot"]])
            dy_in = read(bbuf, row[_C["in_slot"]])
            res_in = [read(a, row[_C["stash"]]) for a in stash]
            send_f, send_b, res, dy, (gw, gpre, gpost, loss) = lax.switch(
                row[_BR], branches, row, x_in, dy_in, res_in, (gw, gpre, gpost, loss))
            stash = [write(a, row[_SW], r) for a, r in zip(stash, res)]
            bbuf = write(bbuf, row[_DW], dy)
            if D > 1:
                got_f = lax.ppermute(send_f, "stage", [(d, (d + 1) % D) for d in range(D)])
                got_b = lax.ppermute(send_b, "stage", [(d, (d - 1) % D) for d in range(D)])
                fbuf = write(fbuf, row[_C["recv_f"]], got_f)
                bbuf = write(bbuf, row[_C["recv_b"]], got_b)
            return (stash, fbuf, bbuf, gw, gpre, gpost, loss), None

        carry = vary((
            [fill((tabs.stash_capacity + 1,) + a.shape, a.dtype) for a in stash_avals],
            fill((tabs.fbuf_capacity + 1,) + x_aval.shape, x_aval.dtype),
            fill((tabs.bbuf_capacity + 1,) + x_aval.shape, x_aval.dtype),
            zeros(w), zeros(pre_p), zeros(post_p), jnp.zeros((), jnp.float32)))
        carry, _ = lax.scan(tick, carry, jnp.asarray(table))
        _, _, _, gw, gpre, gpost, loss = carry
        loss = lax.pmean(lax.psum(loss, "stage"), DP_AXES)
        gpre, gpost = lax.pmean(lax.psum((gpre, gpost), "stage"), DP_AXES)
        gw = jax.tree.map(lambda g: lax.pmean(g, DP_AXES)[None], gw)
        return loss, (gw, gpre, gpost)

    stage_spec = jax.tree.map(lambda _: P("stage"), model.stage_params)
    rep = lambda t: jax.tree.map(lambda _: P(), t)
    batch_spec = jax.tree.map(lambda _: P(DP_AXES), batch_example)
    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(stage_spec, rep(model.pre_params), rep(model.post_params), batch_spec),
        out_specs=(P(), (stage_spec, rep(model.pre_params), rep(model.post_params))))
