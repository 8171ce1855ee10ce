"""The SPMD executor of the flushing schedules: one ``shard_map`` program that runs a lane plan.

Mesh axes ``("pipe", "data", "stage")`` (docs/design.md §2).  Every device runs the same program: the ticks of a
:class:`~jaxpipe.schedules.lanes.LanePlan`, cut into phases (warm-up, steady, cool-down), each phase one
``lax.scan``.  A tick runs the lanes its phase compiles -- F, then B (then W for a split backward; F2 for
paired forwards in the ordered placement) -- and after each lane one ``ppermute`` per direction moves the
message that lane produced (an activation forward, a gradient backward); arriving messages go to the
receive-buffer slots the plan assigned.  A device idle in a lane skips it (``lax.switch`` on its branch
index, branch 0 computes nothing): on CPU-emulated devices idle work costs real time.

Backward is explicit: F calls ``jax.vjp(stage_fn, w, x)`` and writes the pullback's activation-dependent
residuals straight into their stash slot (inside the branch: no branch output in between); the residuals
that depend on the weights alone are not copied -- B rebuilds them from the weights and the pullback from
both.  The last stage's F also runs the loss and its gradient and keeps dL/dy on the device for its B.
Stage 0's B recomputes ``pre``'s pullback (an embedding: cheap).  Where a schedule splits the backward (ZB-H1),
B runs the input-gradient half of the pullback's jaxpr and keeps the per-layer output gradients in a slot
beside the residuals; W runs only the weight-gradient equations on them (:mod:`.wsplit`).  Gradients accumulate inside the B (W)
branches (divided by M at the source: the mean loss), then ``psum`` over ``stage`` for the replicated
pre/post parameters and ``pmean`` over ``pipe``/``data``.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..schedules.ir import SEND_MINUS, SEND_PLUS, Schedule
from ..schedules.lanes import F2, L, plan
from .stage import StageOps
from .wsplit import split_backward
from .common import cast, eager_points, exchange_perms, full, num_chunks, ppermute_bits, read, vary, where, write
from ..axes import DATA, DP_AXES, PIPE, STAGE

_RECV = {SEND_PLUS: L["recv_p"], SEND_MINUS: L["recv_m"]}


def lane_plan(sched: Schedule, placement: str = "lanes"):
    """The plan the executor runs (with a phase cut at Chimera's eager-reduction point)."""
    p = plan(sched, placement)
    if sched.options.get("eager_reduce"):
        p = plan(sched, placement, cut=tuple(t for t, _ in eager_points(sched, p.where)))
    return p


def _branch_codes(p):
    """Per lane: the branch codes (0 idle, ``1 + chunk*4 + first + 2*last``) used, and the table with codes
    replaced by their index in that list (only used branches are compiled)."""
    tab = p.table.copy()
    used = []
    for li, kind in enumerate(p.lanes):
        if kind in ("B", "W"):         # one backward branch per chunk, every position (see bwd)
            b = tab[:, :, li, L["branch"]]
            b[b > 0] = 1 + 4 * tab[:, :, li, L["chunk"]][b > 0]
        u = np.unique(tab[:, :, li, L["branch"]])
        u = u if u[0] == 0 else np.concatenate([[0], u])
        tab[:, :, li, L["branch"]] = np.searchsorted(u, tab[:, :, li, L["branch"]])
        used.append([int(c) for c in u])
    return tab, used


def double_pair(model, p, table, used, x_aval, mb_example):
    """``(F lane, F2 lane)`` for Chimera's forward doubling as one double-size micro-batch, after checking
    that it computes what the paired forwards compute: a context-free model (a stage context is per
    micro-batch), activations and stashed residuals with the micro-batch's rows on their leading axis (the
    pair is split back there), and wherever F2 runs, F runs the same stage position."""
    from ..errors import ConfigError
    from .common import residual_mask
    if F2 not in p.lanes:
        raise ConfigError("double_batch=True runs paired forwards as one: it needs Chimera with "
                          "concat='forward_doubling' and placement='ordered' (the lanes placement runs forwards "
                          "one per F lane beside the backwards, unpaired)")
    la, lb = p.lanes.index("F"), p.lanes.index(F2)
    if model.context:
        raise ConfigError("double_batch=True: this model takes a stage context (a key per micro-batch), which "
                          "one forward of two micro-batches cannot reproduce; use double_batch=False (paired "
                          "forwards, the same numbers)")
    rows = {int(np.shape(a)[0]) for a in jax.tree.leaves(mb_example)}
    xs = {int(np.shape(a)[0]) if np.ndim(a) else -1 for a in jax.tree.leaves(x_aval)}
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), model.stage_params)
    x2 = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2 * a.shape[0],) + tuple(a.shape[1:]), a.dtype), x_aval)
    _, r1 = residual_mask(model.stage_fn, w, x_aval, None)
    _, r2 = residual_mask(model.stage_fn, w, x2, None)
    ok_res = len(r1) == len(r2) and all(tuple(b.shape) == (2 * a.shape[0],) + tuple(a.shape[1:])
                                        for a, b in zip(r1, r2))
    if len(rows) != 1 or xs != rows or not ok_res:
        raise ConfigError(f"double_batch=True concatenates two micro-batches along the leading axis: every "
                          f"activation leaf and stashed residual must lead with the micro-batch's rows "
                          f"(micro-batch rows {sorted(rows)}, activation leading sizes {sorted(xs)}, residuals "
                          f"split {'ok' if ok_res else 'not along the rows'}); use double_batch=False")
    both = (table[:, :, lb, L["op"]] > 0)
    if np.any(both & (table[:, :, la, L["op"]] <= 0)) or np.any(
            both & (np.asarray(used[la])[table[:, :, la, L["branch"]]] != np.asarray(used[lb])[table[:, :, lb, L["branch"]]])):
        raise ConfigError("double_batch=True: the plan pairs forwards of different stage positions (executor bug)")
    return la, lb


def make_grad_fn(model, sched: Schedule, mesh, batch_example, *, nan_bubbles: bool = False,
                 replicas: bool = False, placement: str = "lanes", lanes=None) -> Callable:
    """Return ``fn(stage_params, pre_params, post_params, batch) -> (loss, (g_stage, g_pre, g_post))``.

    ``stage_params`` here are in the executor's layout: leading axis ``D * chunks``, device-major (see
    :func:`layout_index`; :class:`jaxpipe.Pipeline` gathers them from the model's stage order and
    scatter-adds the gradients back, which sums the gradients of a stage's replicas).
    ``batch_example`` (arrays or ShapeDtypeStructs, global shapes) fixes the shapes the program is built for.
    With ``nan_bubbles`` every buffer starts NaN and idle lanes send NaN: a test that the results stay finite
    proves nothing computed in a bubble or left in an unused slot reaches the loss or the gradients.
    ``placement``: ``"lanes"`` (F and B lanes in every tick) or ``"ordered"`` (the schedule's own one action
    per tick: its memory bound); see :mod:`jaxpipe.schedules.lanes`.  ``lanes``: a ready
    :class:`~jaxpipe.schedules.lanes.LanePlan` of ``sched`` (default: built from ``placement``).

    ``replicas=True`` (AvgPipe's parallel pipelines): every parameter has a leading axis of one replica per
    ``pipe`` index, each pipeline trains its own, and gradients and losses are averaged over ``data`` only;
    the loss comes back per replica (shape ``[pipes]``).
    """
    D, M = sched.D, sched.M
    p = lanes if lanes is not None else lane_plan(sched, placement)
    table, used = _branch_codes(p)
    nchunk = num_chunks(sched)
    n_dp = mesh.shape[PIPE] * mesh.shape[DATA]
    pre = model.pre

    leaves = jax.tree.leaves(batch_example)
    mbs = leaves[0].shape[0] // (n_dp * M)
    mb_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct((mbs,) + tuple(a.shape[1:]), a.dtype),
                              batch_example)
    w_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), model.stage_params)
    x_aval = jax.eval_shape(pre, model.pre_params, mb_example)
    y_aval = model.stage_output_aval(w_example, x_aval, mb_example)
    model.check_activation(x_aval, y_aval)
    summed = model.reduction(y_aval, mb_example) == "sum"

    blank_value = jnp.nan if nan_bubbles else 0      # what unwritten buffers and idle lanes hold

    perms = exchange_perms(sched)
    pair = double_pair(model, p, table, used, x_aval, mb_example) if sched.options.get("double_batch") else None
    eager = dict(eager_points(sched, p.where)) if sched.options.get("eager_reduce") else {}
    red = (DATA,) if replicas else DP_AXES
    split = sched.has_w()
    w_split = split and sched.options.get("w_from", "frontier") == "frontier"
    ring = {SEND_PLUS: [(d, (d + 1) % D) for d in range(D)], SEND_MINUS: [(d, (d - 1) % D) for d in range(D)]}

    def body(stage_p, pre_p, post_p, batch, step_key):
        if replicas:
            stage_p, pre_p, post_p = jax.tree.map(lambda a: a[0], (stage_p, pre_p, post_p))
        if perms is not None:      # one stage per device; Chimera's replicas fetched from their owners
            own = jax.tree.map(lambda a: a[0], stage_p)
            ws = [own if pm is None else jax.tree.map(lambda a: lax.ppermute(a, STAGE, pm), own)
                  for pm in perms]
        else:
            ws = [jax.tree.map(lambda a: a[c], stage_p) for c in range(nchunk)]
        ws, pre_p, post_p, batch = vary((ws, pre_p, post_p, batch))
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        me = lax.axis_index(STAGE)
        blank = lambda: vary(full(x_aval, blank_value))
        x_like = lambda: vary(full(x_aval, 0))
        ops, stash_avals = StageOps.build(model, ws[0], x_like(), jax.tree.map(lambda a: a[0], batch), x_like,
                                          zeros=lambda sh, dt: vary(jnp.zeros(sh, dt)), mark=vary)
        # the flat data-parallel replica: micro-batch j of replica r has key microbatch_key(seed, step, r M + j)
        replica = lax.axis_index(PIPE) * mesh.shape[DATA] + lax.axis_index(DATA)
        no_res = lambda: vary(full(stash_avals, blank_value))
        n_res = len(stash_avals)
        # ZB's W from the per-layer output gradients B kept (wsplit): none where the stage cannot be split
        wsp = split_backward(ops.backward, ws[0], no_res(), x_like(), stash_avals) if w_split else None
        no_front = lambda: vary(full(wsp.frontier_avals, blank_value)) if wsp is not None else []
        mb_of = lambda row: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, row[L["mb"]], 0, False), batch)
        add = lambda a, d: jax.tree.map(lambda u, v: u + v.astype(u.dtype), a, d)

        # An F branch maps (row, stash, mbuf, acc) -> (stash, acc, message), a B/W branch (row, stash, mbuf,
        # acc) -> (acc, message): the stash is an operand there, never an output, so XLA does not copy it
        # through the conditional.  acc = (g_w per chunk, g_pre, g_post, loss); a branch that adds nothing
        # passes the accumulators through (XLA keeps them in place).
        def idle_f(row, stash, mbuf, acc):
            return no_res(), acc, blank()

        def idle_b(row, stash, mbuf, acc):       # acc = (g_w of one chunk, g_pre)
            return acc, blank()

        def idle_b_front(row, stash, mbuf, acc):
            return acc, blank(), no_front()

        def fwd(chunk, first, last):
            def op(row, stash, mbuf, acc):
                mb = mb_of(row) if (first or last or model.context) else None
                x = None if first else read(mbuf, row[L["in"]])
                ctx = None
                if model.context:
                    ctx = ops.context(mb, jax.random.fold_in(step_key, replica * M + row[L["mb"]]), row[L["stage"]])
                y, res, head = ops.forward(ws[chunk], x, mb, pre_p, post_p, first, last, ctx)
                if not last:
                    return res, acc, cast(y, x_aval)
                acc, dy = account(acc, head)
                return res, acc, dy
            return op

        def account(acc, head):
            """The last stage's loss and head gradient added to the accumulators; returns (acc, dL/dy)."""
            l, n, gq, dy = head
            gws, gpre, gpost, (gl, gn) = acc
            if summed:      # (sum, count) losses: divided by the global count after the pipeline
                return (gws, gpre, add(gpost, gq), (gl + l.astype(jnp.float32), gn + n)), cast(dy, x_aval)
            acc = (gws, gpre, add(gpost, jax.tree.map(lambda g: g / M, gq)), (gl + (l / M).astype(jnp.float32), gn))
            return acc, cast(jax.tree.map(lambda d: d / M, dy), x_aval)

        def fwd_double(chunk, first, last):
            """Chimera §3.5's forward doubling as one micro-batch of twice the size: the pair's inputs
            concatenated along the batch axis, one stage forward, the output and the stashed residuals (the
            stage input: forward doubling recomputes) split back per micro-batch; the loss head runs per
            micro-batch (a mean over each, as the unpaired forward)."""
            def op(ra, rb, stash, mbuf, acc):
                mba, mbb = mb_of(ra), mb_of(rb)
                if first:
                    xa, xb = model.pre(pre_p, mba), model.pre(pre_p, mbb)
                else:
                    xa, xb = read(mbuf, ra[L["in"]]), read(mbuf, rb[L["in"]])
                x = jax.tree.map(lambda a, b: jnp.concatenate([a, b], 0), xa, xb)
                y, res, _ = ops.forward(ws[chunk], x, None, pre_p, post_p, False, False, None)
                half = lambda t, k: jax.tree.map(lambda a: a[k * (a.shape[0] // 2):(k + 1) * (a.shape[0] // 2)], t)
                ya, yb = half(y, 0), half(y, 1)
                res_a, res_b = [half(r, 0) for r in res], [half(r, 1) for r in res]
                if not last:
                    return res_a, res_b, acc, cast(ya, x_aval), cast(yb, x_aval)
                acc, dya = account(acc, ops.head(post_p, ya, mba))
                acc, dyb = account(acc, ops.head(post_p, yb, mbb))
                return res_a, res_b, acc, dya, dyb
            return op

        def bwd(chunk, want_dw=True, want_dx=True):
            # want_dw=False: zero-bubble B (input gradient only); want_dx=False: its deferred W.  XLA drops
            # the half of the pullback whose result is not used.  One branch for every position (dL/dy is in
            # the message buffer on the last stage too; stage 0's pre pullback under its own small cond):
            # the fewer branches pass the gradient accumulators through, the fewer copies XLA makes.
            def op(row, stash, mbuf, acc):
                gw, gpre = acc
                res = [read(a, row[L["stash"]]) for a in stash[:n_res]]
                dy = read(mbuf, row[L["in"]])
                front = None
                if wsp is not None and not want_dx:           # W: the weight-gradient equations only
                    dw = wsp.weight_part(ws[chunk], res, dy, [read(a, row[L["stash"]]) for a in stash[n_res:]])
                elif wsp is not None and not want_dw:         # B: input gradient, frontier kept for W
                    dx, front = wsp.input_part(ws[chunk], res, dy)
                else:
                    dw, dx = ops.backward(ws[chunk], res, dy)
                if want_dw:
                    gw = add(gw, dw)
                if not want_dx:
                    return (gw, gpre), blank()
                dx = cast(dx, x_aval)
                if jax.tree.leaves(pre_p):
                    def pre_grad(g):
                        return add(g, ops.pre_grad(pre_p, mb_of(row), dx))
                    gpre = lax.cond(row[L["stage"]] == 0, pre_grad, lambda g: g, gpre)
                if front is not None:
                    return (gw, gpre), dx, front
                return (gw, gpre), dx
            return op

        def make(kind, code):
            if code == 0:
                return idle_f if kind in ("F", F2) else idle_b
            chunk, f = divmod(code - 1, 4)
            first, last = bool(f & 1), bool(f & 2)
            if kind in ("F", F2):
                return fwd(chunk, first, last)
            if kind == "B":
                return bwd(chunk, want_dw=not split)
            return bwd(chunk, want_dx=False)

        branches = [[make(kind, c) for c in used[li]] for li, kind in enumerate(p.lanes)]
        pair_branches = None
        if pair is not None:          # indexed like the F lane's branches (same codes, checked in double_pair)
            pair_branches = [lambda ra, rb, stash, mbuf, acc: (no_res(), no_res(), acc, blank(), blank())]
            for code in used[pair[0]][1:]:
                chunk, f = divmod(int(code) - 1, 4)
                pair_branches.append(fwd_double(chunk, bool(f & 1), bool(f & 2)))

        def backward_lane(li, row, stash, mbuf, acc):
            # one predicate cond per chunk, each passing through only that chunk's gradient (and g_pre): a
            # pass-through of accumulators in a multi-way conditional makes XLA copy them every tick
            gws, gpre, gpost, gl = acc
            gws, msg, front = list(gws), None, None
            fronts = wsp is not None and p.lanes[li] == "B"
            for k, code in enumerate(used[li][1:], 1):
                c = (code - 1) // 4
                out = lax.cond(row[L["branch"]] == k, branches[li][k], idle_b_front if fronts else idle_b, row,
                               stash, mbuf, (gws[c], gpre))
                (gws[c], gpre), m = out[:2]
                msg = m if msg is None else where(row[L["branch"]] == k, m, msg)
                if fronts:
                    front = out[2] if front is None else where(row[L["branch"]] == k, out[2], front)
            if fronts:      # the frontier into the micro-batch's slot beside its residuals (scratch when idle)
                slot = jnp.where(row[L["op"]] > 0, row[L["stash"]], p.stash_capacity)
                stash = list(stash[:n_res]) + [write(a, slot, f) for a, f in zip(stash[n_res:], front or no_front())]
            return stash, (gws, gpre, gpost, gl), blank() if msg is None else msg

        def lane(li, row, c, direct=None):
            # direct: the op of a lane every device runs in this phase (no conditional around it)
            stash, mbuf, acc = c
            if p.lanes[li] in ("F", F2):
                if direct is not None:
                    res, acc, msg = direct(row, stash, mbuf, acc)
                else:
                    res, acc, msg = lax.switch(row[L["branch"]], branches[li], row, stash, mbuf, acc)
                slot = jnp.where(row[L["op"]] > 0, row[L["stash"]], p.stash_capacity)
                stash = [write(a, slot, r) for a, r in zip(stash, res)] + list(stash[n_res:])
            elif direct is not None and wsp is None:
                gws, gpre, gpost, gl = acc
                (g0, gpre), msg = direct(row, stash, mbuf, (gws[0], gpre))
                acc = ([g0] + list(gws[1:]), gpre, gpost, gl)
            else:
                stash, acc, msg = backward_lane(li, row, stash, mbuf, acc)
            return stash, deliver(li, row, msg, mbuf), acc

        def deliver(li, row, msg, mbuf):
            """The lane's message kept on the device and/or sent on its channels (one ppermute each)."""
            if p.keeps[li]:
                mbuf = write(mbuf, row[L["keep"]], msg)
            for ch in p.channels[li]:
                mbuf = write(mbuf, row[_RECV[ch]], ppermute_bits(msg, STAGE, ring[ch]))
            return mbuf

        def lane_pair(la, lb, ra, rb, c):
            """The F lane and its F2 pair lane as one doubled forward where both run (fwd_double), the F
            lane alone where only it does."""
            stash, mbuf, acc = c

            def single(ra, rb, stash, mbuf, acc):
                res, acc, msg = lax.switch(ra[L["branch"]], branches[la], ra, stash, mbuf, acc)
                return res, no_res(), acc, msg, blank()

            def double(ra, rb, stash, mbuf, acc):
                return lax.switch(ra[L["branch"]], pair_branches, ra, rb, stash, mbuf, acc)

            res_a, res_b, acc, msg_a, msg_b = lax.cond(rb[L["op"]] > 0, double, single, ra, rb, stash, mbuf, acc)
            slot_a = jnp.where(ra[L["op"]] > 0, ra[L["stash"]], p.stash_capacity)
            slot_b = jnp.where(rb[L["op"]] > 0, rb[L["stash"]], p.stash_capacity)
            stash = [write(write(a, slot_a, r), slot_b, q) for a, r, q in zip(stash, res_a, res_b)] + list(stash[n_res:])
            return stash, deliver(lb, rb, msg_b, deliver(la, ra, msg_a, mbuf)), acc

        def direct_op(t0, t1, li):
            """The op a lane runs without a conditional in ticks [t0, t1) where it is busy in every tick: on
            one device (D = 1) with one chunk, the lane's only branch.  Measured (BUILD_NOTES, "Where the
            remaining time goes"): a conditional costs ~4-8% of the step at D = 1; at D = 4 dropping the
            conditionals of busy lanes was slower (1f1b 1.16x -> 1.20-1.26x) and took 4 MiB more temp, so
            D > 1 keeps them."""
            if D != 1 or nchunk != 1:
                return None
            codes = np.unique(table[t0:t1, :, li, L["branch"]])
            return branches[li][int(codes[0])] if len(codes) == 1 else None

        def phase(t0, t1, lanes_used, full):
            direct = {li: direct_op(t0, t1, li) for li in full}

            def tick(c, rows):
                row = rows[me]
                for li in lanes_used:
                    if pair is not None and li == pair[1] and pair[0] in lanes_used:
                        continue                            # run with its F lane
                    if pair is not None and li == pair[0] and pair[1] in lanes_used:
                        c = lane_pair(pair[0], pair[1], row[pair[0]], row[pair[1]], c)
                    else:
                        c = lane(li, row[li], c, direct.get(li))
                return c, None
            return tick

        # gradients accumulate in float32 at least (bf16 parameters: float32 sums, cast back at the end)
        zeros = lambda t: vary(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), t))
        carry = vary((
            full(stash_avals, blank_value, (p.stash_capacity + 1,)) + (
                full(wsp.frontier_avals, blank_value, (p.stash_capacity + 1,)) if wsp is not None else []),
            full(x_aval, blank_value, (p.mbuf_capacity + 1,)),
            ([zeros(w) for w in ws], zeros(pre_p), zeros(post_p), (jnp.zeros((), jnp.float32),) * 2)))
        full_sets = p.full or ((),) * len(p.phases)
        for (t0, t1, lanes_used), full_lanes in zip(p.phases, full_sets):
            carry, _ = lax.scan(phase(t0, t1, lanes_used, full_lanes), carry, jnp.asarray(table[t0:t1]))
            if t1 in eager:
                carry = _eager_exchange(carry, eager[t1], me)
        _, _, (gws, gpre, gpost, (loss, count)) = carry
        if summed:      # the mean over every real token/example of the step: sum over all, then / count
            total = lax.psum(lax.psum(count, STAGE), red)
            reduce = lambda t: jax.tree.map(lambda a: a / total.astype(a.dtype), lax.psum(t, red))
        else:           # the mean over replicas of the micro-batch means
            reduce = lambda t: lax.pmean(t, red)
        loss = reduce(lax.psum(loss, STAGE))
        gpre, gpost = reduce(lax.psum((gpre, gpost), STAGE))
        if perms is not None:
            # each replica's gradient goes home to the stage's owner and is summed there
            home = [g if pm is None else jax.tree.map(lambda a: lax.ppermute(a, STAGE, [(d, s_) for s_, d in pm]), g)
                    for g, pm in zip(gws, perms)]
            gw = jax.tree.map(lambda *g: reduce(sum(g))[None], *home)
        else:
            gw = jax.tree.map(lambda *g: reduce(jnp.stack(g)), *gws)
        like = lambda g, p_: jax.tree.map(lambda a, b: a.astype(b.dtype), g, p_)
        gw = like(gw, stage_p)
        gpre, gpost = like(gpre, pre_p), like(gpost, post_p)
        if replicas:
            return jax.tree.map(lambda a: a[None], (loss, (gw, gpre, gpost)))
        return loss, (gw, gpre, gpost)

    stage_spec = jax.tree.map(lambda _: P(PIPE, STAGE) if replicas else P(STAGE), model.stage_params)
    rep = lambda t: jax.tree.map(lambda _: P(PIPE) if replicas else P(), t)
    batch_spec = jax.tree.map(lambda _: P(DP_AXES), batch_example)
    program = jax.shard_map(
        body, mesh=mesh,
        in_specs=(stage_spec, rep(model.pre_params), rep(model.post_params), batch_spec, P()),
        out_specs=(P(PIPE) if replicas else P(), (stage_spec, rep(model.pre_params), rep(model.post_params))))

    def fn(stage_p, pre_p, post_p, batch, step_key=None):
        """``step_key``: ``fold_in(PRNGKey(seed), step)`` of a context model (default: step 0 of seed 0)."""
        if step_key is None:
            step_key = jax.random.fold_in(jax.random.PRNGKey(0), 0)
        return program(stage_p, pre_p, post_p, batch, step_key)
    return fn


def _eager_exchange(carry, pairs, me):
    """Chimera §3.2 eager gradient synchronisation: the replica gradients of the stages whose backwards are
    all done go home now (one ``ppermute`` for the group, chunk 1 of each replica device -> chunk 0 of the
    stage's owner), between two phases where the transfer may overlap the rest of the pipeline, instead of
    after it.  The sent copies are zeroed: the final exchange then adds 0 for them."""
    stash, mbuf, (gws, gpre, gpost, loss) = carry
    gws = list(gws)
    got = jax.tree.map(lambda a: lax.ppermute(a, STAGE, list(pairs)), gws[1])
    dst = jnp.isin(me, jnp.asarray([d for _, d in pairs]))
    src = jnp.isin(me, jnp.asarray([r for r, _ in pairs]))
    gws[0] = jax.tree.map(lambda a, b: jnp.where(dst, a + b, a), gws[0], got)
    gws[1] = jax.tree.map(lambda a: jnp.where(src, jnp.zeros_like(a), a), gws[1])
    return stash, mbuf, (gws, gpre, gpost, loss)
