"""The SPMD executor: one ``shard_map`` program that runs a schedule's tables over a device mesh.

Mesh axes ``("pipe", "data", "stage")`` (DESIGN.md §2).  Every device runs the same program: a ``lax.scan``
over lockstep ticks; in each tick it reads its row of the schedule tables (indexed by
``axis_index("stage")``), runs its op with ``lax.switch`` (idle ops compute nothing), then one ``ppermute``
per direction moves activations forward and gradients backward, and the arriving messages are written to
fixed-capacity receive buffers at the slots the IR assigned.

Backward is explicit: F calls ``jax.vjp(stage_fn, w, x)`` and keeps the pullback's residuals in a
fixed-capacity stash -- except the residuals that *are* the stage weights (recognised by identity), which are
not copied: B rebuilds the pullback with the weights it must read.  The last stage's F also runs the loss
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


def split_residuals(stage_fn, w, x):
    """``jax.vjp`` of one stage; returns (y, stashed residuals, treedef, kinds).

    ``kinds[i]`` is the index of the weight leaf that residual ``i`` *is* (not stashed), or -1 (stashed).
    """
    y, pullback = jax.vjp(stage_fn, w, x)
    leaves, treedef = jax.tree.flatten(pullback)
    wid = {id(l): i for i, l in enumerate(jax.tree.leaves(w))}
    kinds = tuple(wid.get(id(l), -1) for l in leaves)
    return y, [l for l, k in zip(leaves, kinds) if k < 0], treedef, kinds


def rebuild_pullback(treedef, kinds, stashed: List[Any], w):
    wl = jax.tree.leaves(w)
    it = iter(stashed)
    return jax.tree.unflatten(treedef, [wl[k] if k >= 0 else next(it) for k in kinds])


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


def make_grad_fn(model, sched: Schedule, mesh, batch_example, *, nan_bubbles: bool = False) -> Callable:
    """Return ``fn(stage_params, pre_params, post_params, batch) -> (loss, (g_stage, g_pre, g_post))``.

    ``batch_example`` (arrays or ShapeDtypeStructs, global shapes) fixes the shapes the program is built for.
    With ``nan_bubbles`` every buffer starts NaN and idle ops send NaN: a test that the results stay finite
    proves nothing computed in a bubble or left in an unused slot reaches the loss or the gradients.
    """
    D, M = sched.D, sched.M
    tabs = sched.tables()
    table = np.concatenate([tabs.stacked(), branch_table(sched)[..., None]], axis=-1)  # [T, D, C+1]
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
    stash_avals = jax.eval_shape(lambda w, x: split_residuals(stage_fn, w, x)[1], w_example, x_aval)

    def fill(shape, dtype):
        return jnp.full(shape, jnp.nan if nan_bubbles else 0, dtype)

    def body(stage_p, pre_p, post_p, batch):
        w = jax.tree.map(lambda a: a[0], stage_p)
        w, pre_p, post_p, batch = vary((w, pre_p, post_p, batch))
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        me = lax.axis_index("stage")

        def mb_of(row):
            return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, row[_C["mb"]], 0, False), batch)

        def read(buf, slot):
            return lax.dynamic_index_in_dim(buf, slot, 0, False)

        def write(buf, slot, val):
            return lax.dynamic_update_index_in_dim(buf, val.astype(buf.dtype), slot, 0)

        blank = lambda: vary(fill(x_aval.shape, x_aval.dtype))

        def idle(c, row):
            return c, blank(), blank()

        def fwd(first, last):
            def op(c, row):
                stash, fbuf, bbuf, gw, gpre, gpost, loss = c
                mb = mb_of(row) if (first or last) else None
                x = pre(pre_p, mb) if first else read(fbuf, row[_C["in_slot"]])
                y, res, _, _ = split_residuals(stage_fn, w, x)
                stash = [write(s, row[_C["stash"]], r) for s, r in zip(stash, res)]
                send_f = blank()
                if last:
                    l, (gq, dy) = jax.value_and_grad(post_loss, argnums=(0, 1))(post_p, y, mb)
                    loss = loss + l / M
                    gpost = jax.tree.map(lambda a, g: a + g / M, gpost, gq)
                    bbuf = write(bbuf, row[_C["dy_slot"]], dy / M)
                else:
                    send_f = y.astype(x_aval.dtype)
                return (stash, fbuf, bbuf, gw, gpre, gpost, loss), send_f, blank()
            return op

        def bwd(first, last):
            def op(c, row):
                stash, fbuf, bbuf, gw, gpre, gpost, loss = c
                dy = read(bbuf, row[_C["in_slot"]])
                res = [read(s, row[_C["stash"]]) for s in stash]
                _, _, treedef, kinds = split_residuals(stage_fn, w, vary(jnp.zeros(x_aval.shape, x_aval.dtype)))
                dw, dx = rebuild_pullback(treedef, kinds, res, w)(dy)
                gw = jax.tree.map(jnp.add, gw, dw)
                send_b = blank()
                if first:
                    mb = mb_of(row)
                    _, pre_pull = jax.vjp(lambda q: pre(q, mb), pre_p)
                    gpre = jax.tree.map(jnp.add, gpre, pre_pull(dx.astype(x_aval.dtype))[0])
                else:
                    send_b = dx.astype(x_aval.dtype)
                return (stash, fbuf, bbuf, gw, gpre, gpost, loss), blank(), send_b
            return op

        # index = 0 idle; 1..4 F (mid, first, last, only); 5..8 B (mid, first, last, only)
        flags = [(False, False), (True, False), (False, True), (True, True)]
        branches = [idle] + [fwd(*f) for f in flags] + [bwd(*f) for f in flags]

        def tick(c, rows):
            row = rows[me]
            c, send_f, send_b = lax.switch(row[-1], branches, c, row)
            if D > 1:
                got_f = lax.ppermute(send_f, "stage", [(d, (d + 1) % D) for d in range(D)])
                got_b = lax.ppermute(send_b, "stage", [(d, (d - 1) % D) for d in range(D)])
                stash, fbuf, bbuf, *rest = c
                fbuf = write(fbuf, row[_C["recv_f"]], got_f)
                bbuf = write(bbuf, row[_C["recv_b"]], got_b)
                c = (stash, fbuf, bbuf, *rest)
            return c, None

        zeros_like = lambda t: jax.tree.map(jnp.zeros_like, t)
        carry = vary((
            [fill((tabs.stash_capacity,) + a.shape, a.dtype) for a in stash_avals],
            fill((tabs.fbuf_capacity + 1,) + x_aval.shape, x_aval.dtype),
            fill((tabs.bbuf_capacity + 1,) + x_aval.shape, x_aval.dtype),
            zeros_like(w), zeros_like(pre_p), zeros_like(post_p), jnp.zeros((), jnp.float32)))
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
