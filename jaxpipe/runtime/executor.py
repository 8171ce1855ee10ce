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

from ..schedules.ir import COLS, OP_B, OP_F, OP_IDLE, SEND_MINUS, SEND_PLUS, Schedule

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


def num_chunks(sched: Schedule) -> int:
    return int(sched.stage_of_chunk().shape[1])


def branch_table(sched: Schedule) -> np.ndarray:
    """``[tick, device]`` branch key: 0 idle; else ``1 + chunk * 16 + kind * 4 + pos`` with kind 0 F, 1 B,
    2 W, 3 a forward pair (two lanes) and pos 0 mid, 1 first stage, 2 last stage, 3 both (one stage)."""
    t = sched.tables().data
    S = sched.num_model_stages
    pos = (t["stage"] == 0).astype(np.int32) + 2 * (t["stage"] == S - 1).astype(np.int32)
    kind = np.where(t["op"] == OP_F, np.where(t["op2"] == OP_F, 3, 0), np.where(t["op"] == OP_B, 1, 2))
    return np.where(t["op"] == OP_IDLE, 0, 1 + t["chunk"] * 16 + kind * 4 + pos)


_BR, _SW, _SW2 = len(COLS), len(COLS) + 1, len(COLS) + 2   # extra columns: branch, stash write slots


def executor_table(sched: Schedule) -> np.ndarray:
    """The IR tables plus the executor's own columns, ``[T, D, len(COLS) + 2]`` int32.

    Writes that happen every tick (outside the switch) go to the scratch slot (index = capacity) on ticks
    where the op produces nothing to keep.
    """
    tabs = sched.tables()
    t = tabs.data
    stash_w = np.where(t["op"] == OP_F, t["stash"], tabs.stash_capacity)
    stash_w2 = np.where(t["op2"] == OP_F, t["stash2"], tabs.stash_capacity)
    return np.concatenate([tabs.stacked(), np.stack([branch_table(sched), stash_w, stash_w2], -1)],
                          axis=-1).astype(np.int32)


def layout_index(sched: Schedule) -> np.ndarray:
    """``[D * chunks]``: the model stage each device-local chunk holds (device-major), the order in which
    the executor wants the stage parameters (a chunk a device does not use holds a copy of stage 0)."""
    soc = sched.stage_of_chunk()
    return np.where(soc < 0, 0, soc).reshape(-1).astype(np.int32)


def exchange_perms(sched: Schedule):
    """Where every chunk column is a permutation of the model's D stages (GPipe/1F1B/ZB: identity; Chimera:
    each device's second replica lives as the first on its mirror device), the executor takes the stage
    parameters in the model's own order, one stage per device, and fetches chunk c with one ``ppermute``
    (source device ``stage_of_chunk[d, c]`` -> d); its gradients go back the same way and are summed with
    the owner's: the paper's all-reduce between a stage's replicas.  Returns the per-chunk permutations
    (None for the identity), or None where the layout is not of that form (interleaved: a gather)."""
    soc = sched.stage_of_chunk()
    D = sched.D
    if sched.num_model_stages != D:
        return None
    perms = []
    for c in range(soc.shape[1]):
        col = [int(v) for v in soc[:, c]]
        if sorted(col) != list(range(D)):
            return None
        perms.append(None if col == list(range(D)) else [(col[d], d) for d in range(D)])
    return perms


def eager_point(sched: Schedule):
    """For Chimera's eager reduction: (tick after which the last stage's replica gradient is final, the
    device holding that replica, its chunk, the owner device)."""
    soc, S = sched.stage_of_chunk(), sched.num_model_stages
    perms = exchange_perms(sched)
    src = [(d, c) for d in range(sched.D) for c in range(soc.shape[1]) if soc[d, c] == S - 1 and c > 0]
    if perms is None or len(src) != 1 or perms[src[0][1]] is None:
        raise ValueError(f"{sched.name}: eager reduction needs exactly one replica of the last stage")
    d, c = src[0]
    ticks = sched.ticks()
    last = "W" if sched.has_w() else "B"
    t_e = 1 + max(t for (k, st, m), t in ticks.items() if k == last and st == S - 1)
    return t_e, d, c, S - 1


def read(buf, slot):
    return lax.dynamic_index_in_dim(buf, slot, 0, False)


def write(buf, slot, val):
    return lax.dynamic_update_index_in_dim(buf, val.astype(buf.dtype), slot, 0)


def make_grad_fn(model, sched: Schedule, mesh, batch_example, *, nan_bubbles: bool = False,
                 replicas: bool = False) -> Callable:
    """Return ``fn(stage_params, pre_params, post_params, batch) -> (loss, (g_stage, g_pre, g_post))``.

    ``stage_params`` here are in the executor's layout: leading axis ``D * chunks``, device-major (see
    :func:`layout_index`; :class:`jaxpipe.Pipeline` gathers them from the model's stage order and
    scatter-adds the gradients back, which sums the gradients of a stage's replicas).
    ``batch_example`` (arrays or ShapeDtypeStructs, global shapes) fixes the shapes the program is built for.
    With ``nan_bubbles`` every buffer starts NaN and idle ops send NaN: a test that the results stay finite
    proves nothing computed in a bubble or left in an unused slot reaches the loss or the gradients.

    ``replicas=True`` (AvgPipe's parallel pipelines): every parameter has a leading axis of one replica per
    ``pipe`` index, each pipeline trains its own, and gradients and losses are averaged over ``data`` only;
    the loss comes back per replica (shape ``[pipes]``).
    """
    D, M = sched.D, sched.M
    tabs = sched.tables()
    table = executor_table(sched)
    nchunk = num_chunks(sched)
    # Only the branches this schedule uses are compiled.
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

    perms = exchange_perms(sched)
    lane2 = sched.has_pairs()
    eager = eager_point(sched) if getattr(sched, "options", {}).get("eager_reduce") else None

    red = ("data",) if replicas else DP_AXES

    def body(stage_p, pre_p, post_p, batch):
        if replicas:
            stage_p, pre_p, post_p = jax.tree.map(lambda a: a[0], (stage_p, pre_p, post_p))
        # the device's chunks, split once outside the loop (a static index: no copy per tick), or fetched
        # from the devices that own them (Chimera's replicas)
        if perms is not None:
            own = jax.tree.map(lambda a: a[0], stage_p)
            ws = [own if pm is None else jax.tree.map(lambda a: lax.ppermute(a, "stage", pm), own)
                  for pm in perms]
        else:
            ws = [jax.tree.map(lambda a: a[c], stage_p) for c in range(nchunk)]
        ws, pre_p, post_p, batch = vary((ws, pre_p, post_p, batch))
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        me = lax.axis_index("stage")
        zeros = lambda t: vary(jax.tree.map(jnp.zeros_like, t))
        blank = lambda: vary(fill(x_aval.shape, x_aval.dtype))
        mask, stash_avals = residual_mask(stage_fn, ws[0], vary(jnp.zeros(x_aval.shape, x_aval.dtype)))

        def mb_of(row, col="mb"):
            return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, row[_C[col]], 0, False), batch)

        # Every branch returns the same tuple: small *new values* (its one message, residuals to stash) and
        # the gradient/loss accumulators, which a branch that adds nothing passes through untouched (XLA
        # keeps them in place).  Returning a zero gradient from F branches and adding it outside the switch
        # instead costs a weight-sized memset and add every tick (measured: 1.25x on the benchmark MLP).
        # The stash and the message buffer are written outside the switch.
        #   (message, residuals to stash, (g_w per chunk, g_pre, g_post, loss))
        no_res = lambda: [vary(fill(a.shape, a.dtype)) for a in stash_avals]

        def outputs(acc, msg=None, res=None, chunk=0, dw=None, dpre=None, dpost=None, loss=None, msg2=None,
                    res2=None):
            gws, gpre, gpost, gl = acc
            add = lambda a, d: a if d is None else jax.tree.map(lambda u, v: u + v.astype(u.dtype), a, d)
            gws = list(gws)
            gws[chunk] = add(gws[chunk], dw)
            out = (blank() if msg is None else msg.astype(x_aval.dtype), no_res() if res is None else res,
                   (gws, add(gpre, dpre), add(gpost, dpost), add(gl, loss)))
            if lane2:        # the second lane's message and residuals (a paired forward)
                out += (blank() if msg2 is None else msg2.astype(x_aval.dtype), no_res() if res2 is None else res2)
            return out

        def idle(row, m_in, res_in, acc, m_in2=None):
            return outputs(acc)

        def forward_one(chunk, first, last, row, x_in, col):
            """One unit's forward: (message, residuals, d post, loss)."""
            mb = mb_of(row, col) if (first or last) else None
            x = pre(pre_p, mb) if first else x_in
            y, res, _, _ = split_residuals(stage_fn, ws[chunk], x, mask)
            if not last:
                return y, res, None, None
            l, (gq, dy) = jax.value_and_grad(post_loss, argnums=(0, 1))(post_p, y, mb)
            return dy / M, res, jax.tree.map(lambda g: g / M, gq), (l / M).astype(jnp.float32)

        def fwd(chunk, first, last):
            def op(row, x_in, res_in, acc, m_in2=None):
                msg, res, dpost, loss = forward_one(chunk, first, last, row, x_in, "mb")
                return outputs(acc, msg=msg, res=res, dpost=dpost, loss=loss)
            return op

        def fwd_pair(chunk, first, last):
            # forward doubling / backward halving: two units' forwards in one tick, one per lane
            def op(row, x_in, res_in, acc, m_in2=None):
                msg, res, dpost, loss = forward_one(chunk, first, last, row, x_in, "mb")
                msg2, res2, dpost2, loss2 = forward_one(chunk, first, last, row, m_in2, "mb2")
                if last:
                    dpost = jax.tree.map(lambda u, v: u + v, dpost, dpost2)
                    loss = loss + loss2
                return outputs(acc, msg=msg, res=res, dpost=dpost, loss=loss, msg2=msg2, res2=res2)
            return op

        def bwd(chunk, first, last, want_dw=True, want_dx=True):
            # want_dw=False: zero-bubble B (input gradient only); want_dx=False: its deferred W.  XLA drops
            # the half of the pullback whose result is not returned.
            def op(row, dy_in, res_in, acc, m_in2=None):
                x_like = vary(jnp.zeros(x_aval.shape, x_aval.dtype))
                dw, dx = rebuild_pullback(stage_fn, ws[chunk], x_like, res_in, mask)(dy_in)
                dw = dw if want_dw else None
                if not want_dx:
                    return outputs(acc, chunk=chunk, dw=dw)
                if not first:
                    return outputs(acc, msg=dx, chunk=chunk, dw=dw)
                mb = mb_of(row)
                _, pre_pull = jax.vjp(lambda q: pre(q, mb), pre_p)
                return outputs(acc, chunk=chunk, dw=dw, dpre=pre_pull(dx.astype(x_aval.dtype))[0])
            return op

        split = sched.has_w()
        flags = [(False, False), (True, False), (False, True), (True, True)]
        branches = [idle]
        for c in range(nchunk):
            branches += [fwd(c, *f) for f in flags]
            branches += [bwd(c, *f, want_dw=not split) for f in flags]
            branches += [bwd(c, *f, want_dx=False) for f in flags]
            branches += [fwd_pair(c, *f) for f in flags]
        branches = [branches[i] for i in used]
        ring = {SEND_PLUS: [(d, (d + 1) % D) for d in range(D)],
                SEND_MINUS: [(d, (d - 1) % D) for d in range(D)]}
        recv_col = {SEND_PLUS: _C["recv_p"], SEND_MINUS: _C["recv_m"]}
        recv_col2 = {SEND_PLUS: _C["recv_p2"], SEND_MINUS: _C["recv_m2"]}

        def tick(c, rows):
            stash, mbuf, gws, gpre, gpost, loss = c
            row = rows[me]
            m_in = read(mbuf, row[_C["in_slot"]])
            res_in = [read(a, row[_C["stash"]]) for a in stash]
            extra = (read(mbuf, row[_C["in2"]]),) if lane2 else ()
            out = lax.switch(row[_BR], branches, row, m_in, res_in, (gws, gpre, gpost, loss), *extra)
            msg, res, (gws, gpre, gpost, loss) = out[:3]
            stash = [write(a, row[_SW], r) for a, r in zip(stash, res)]
            mbuf = write(mbuf, row[_C["keep"]], msg)
            for ch in tabs.channels:
                mbuf = write(mbuf, row[recv_col[ch]], lax.ppermute(msg, "stage", ring[ch]))
            if lane2:
                msg2, res2 = out[3:]
                stash = [write(a, row[_SW2], r) for a, r in zip(stash, res2)]
                mbuf = write(mbuf, row[_C["keep2"]], msg2)
                for ch in tabs.channels:
                    mbuf = write(mbuf, row[recv_col2[ch]], lax.ppermute(msg2, "stage", ring[ch]))
            return (stash, mbuf, gws, gpre, gpost, loss), None

        carry = vary((
            [fill((tabs.stash_capacity + 1,) + a.shape, a.dtype) for a in stash_avals],
            fill((tabs.mbuf_capacity + 1,) + x_aval.shape, x_aval.dtype),
            [zeros(w) for w in ws], zeros(pre_p), zeros(post_p), jnp.zeros((), jnp.float32)))
        if eager is None:
            carry, _ = lax.scan(tick, carry, jnp.asarray(table))
        else:
            # Chimera §3.2 eager reduction: the last stage's replica gradient is final early (its backwards
            # come first in both directions); send it home between two scans, where it may overlap the
            # rest of the pipeline, instead of after the pipeline.  The sent copy is zeroed: the final
            # exchange then adds exactly 0 for it.
            t_e, src, c_r, dst = eager
            carry, _ = lax.scan(tick, carry, jnp.asarray(table[:t_e]))
            stash, mbuf, gws, gpre, gpost, loss = carry
            gws = list(gws)
            got = jax.tree.map(lambda a: lax.ppermute(a, "stage", [(src, dst)]), gws[c_r])
            gws[0] = jax.tree.map(lambda a, b: a + b, gws[0], got)
            gws[c_r] = jax.tree.map(lambda a: jnp.where(me == src, jnp.zeros_like(a), a), gws[c_r])
            carry, _ = lax.scan(tick, (stash, mbuf, gws, gpre, gpost, loss), jnp.asarray(table[t_e:]))
        _, _, gws, gpre, gpost, loss = carry
        loss = lax.pmean(lax.psum(loss, "stage"), red)
        gpre, gpost = lax.pmean(lax.psum((gpre, gpost), "stage"), red)
        if perms is not None:
            # each replica's gradient goes home to the stage's owner and is summed there
            home = [g if pm is None else jax.tree.map(lambda a: lax.ppermute(a, "stage", [(d, s_) for s_, d in pm]), g)
                    for g, pm in zip(gws, perms)]
            gw = jax.tree.map(lambda *g: lax.pmean(sum(g), red)[None], *home)
        else:
            gw = jax.tree.map(lambda *g: lax.pmean(jnp.stack(g), red), *gws)
        if replicas:
            return jax.tree.map(lambda a: a[None], (loss, (gw, gpre, gpost)))
        return loss, (gw, gpre, gpost)

    stage_spec = jax.tree.map(lambda _: P("pipe", "stage") if replicas else P("stage"), model.stage_params)
    rep = lambda t: jax.tree.map(lambda _: P("pipe") if replicas else P(), t)
    batch_spec = jax.tree.map(lambda _: P(DP_AXES), batch_example)
    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(stage_spec, rep(model.pre_params), rep(model.post_params), batch_spec),
        out_specs=(P("pipe") if replicas else P(), (stage_spec, rep(model.pre_params), rep(model.post_params))))
