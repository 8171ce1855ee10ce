"""The one executor: every method -- GPipe, 1F1B, interleaved 1F1B, ZB-H1, Chimera, AvgPipe, PipeDream,
PipeDream-2BW, SpecTrain, PipeOptim, CDP (both forms) and WPipe -- runs here, from the schedule IR as data.

One ``shard_map`` program per call, a ``lax.scan`` over lockstep ticks, read from a stream of the IR
(:class:`jaxpipe.schedules.periodic.Periodic`, read as a call table): on device ``d`` the F of stream unit ``i``
runs at tick ``period * i + offset_F[d]`` and its B at ``period * i + offset_B[d]`` (the no-flush 1F1B family:
PipeOptim Fig. 1(d)-(e), or F and B lanes in every tick), or at per-unit offsets of a call (Cyclic DP: a worker's
F down its N stages and B back up; a flushing schedule: its lane plan as a stream of one call).  A unit is a
micro-batch on one of the device's model chunks (:meth:`Periodic.unit_table`: WPipe's V units carry G0's
forward of batch p + 1 and G0's backward of batch p); chunk ``c`` of device ``d`` holds the model stage of the
stream's stage table (``c D + d``, or Chimera's mirrored pipelines).  Every capacity comes from replaying the
stream (:meth:`Periodic.buffers`).  Data replicas may run the stream late (``replica_delay``) and reduce along
a ring (below: Cyclic DP's DP form); AvgPipe's pipelines each train their own weights (``replicas``).

Messages.  A periodic stream consumes every message the tick after it was sent (a register per direction;
a wrap-around buffer between chunks, indexed like the ring of micro-batches).  A stream of one call made from a
lane plan (``periodic.plan``) routes in the plan's slots instead: messages in both directions, kept or waiting
where the plan says, residuals in its stash slots; its lanes may include Chimera's paired forward (F2: one
doubled forward) and ZB's W (the weight gradient from the frontier B kept).

Nothing flushes between calls: the train state carries the stashed residuals, the messages on the wire, the
last stage's dL/dy, the recent micro-batches and, per chunk, each stage's weights, optimizer state and policy
state.  ``step`` feeds M micro-batches and runs ``period * U`` ticks (U units per call); ``drain`` runs calls
without feeding until everything in flight is finished.  Which weights an op reads and when updates land come
from the chunk's weight policy (``jaxpipe.optim.policies``; a flushing schedule's: ``gradient``, which sums and
returns): the executor never asks a method's name.  A tick is an F lane and a B lane (and F2/W where the plan
has them), each a predicate ``lax.cond`` around a switch over small outputs (nothing weight-sized passes
through a multi-way conditional: XLA copies such pass-throughs); the update runs in a conditional of its own
per chunk (a sum-only policy adds inside the backward's); accumulating policies land between scans, at the
tick the timeline allows (:func:`landing_points`), or in the ticks where some stage lands
(:func:`landing_segments`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..errors import ConfigError
from ..model import microbatch_key
from ..tying import Ties
from .apc import apc_pack, apc_unpack
from .common import balanced_broadcast, cast, eager_points, full, pmean_over, ppermute_bits, psum_over, read, where, write
from .landing import landing_points, landing_segments, ring_phases
from .stage import StageOps
from .wsplit import split_backward
from ..axes import AXES, DATA, DP_AXES, PIPE, STAGE
from ..schedules.ir import SEND_PLUS
from ..schedules.lanes import L as _L

ALL = AXES
#: a lane plan's columns the slot routing reads: stash slot, input slot, kept-message slot, arrival slots
_ROUTE = ("stash", "in", "keep", "recv_p", "recv_m")
_R = {k: i for i, k in enumerate(_ROUTE)}
#: the in-flight fields a forward lane writes (the rest pass through its conditional untouched)
_F_OUT = ("stash", "gpost", "dy_own", "gtie", "cnt_own")


def make_async_fn(model, policy, opt, D: int, M: int, mesh, mb_example, nan_bubbles: bool = False,
                  periodic=None, seed: int = 0, apc: bool = False, broadcast: str = "direct",
                  replicas: bool = False):
    """``fn(params, opt_state, policy_state, carry, counters, batch, feed) -> (same..., metrics)``.

    ``policy``: a :class:`~jaxpipe.optim.policies.WeightPolicy`, or a tuple of one per chunk; ``params``,
    ``opt_state`` and ``policy_state`` are then tuples over chunks, each ``(w [D..], pre [D..], post [D..])``
    per stage (pre/post: each stage's copy; stage 0's pre and the last stage's post are the trained ones).
    ``feed`` (traced bool): whether ``batch``'s M micro-batches enter the pipeline; ``drain`` calls the same
    program with ``feed=False`` (the batch is then written to ring slots no micro-batch in flight uses).
    ``counters = (t, base, n_fed)`` int32 scalars: tick since the last (re)start, global index of the first
    micro-batch since then, micro-batches fed since then.  ``mb_example``: one micro-batch per data replica.
    ``apc``: activations and gradients travel compressed (WPipe appendix A.3, :mod:`.apc`).

    Ring reduction (policies with ``apply_sum``: Cyclic DP's workers on ``data``, ``D = 1``, every stage a chunk
    of the worker): replica ``r`` runs the stream ``r * replica_delay`` ticks late; a backward adds the previous
    worker's partial sum of its chunk and sends the sum on (one ``ppermute`` per tick); the last worker's sum
    is complete: it updates the stage (``apply_sum``) and sends it to the others (``broadcast``: ``"direct"``
    or ``"balanced"``, :func:`.common.balanced_broadcast`), which land it the next tick.  No collective runs
    inside a conditional, and none but point-to-point ones in the scan.  ``params``, ``opt_state`` and
    ``policy_state`` are then one replica per worker (leading axis over data and stage) with the worker's chunks
    stacked (``[K, ...]``): the lanes slice their chunk inside their branches, a stage lands by dynamic-update-
    slice (``land_stacked``; per-chunk buffers swapped in conditionals were copied every tick).
    """
    chunked = not hasattr(policy, "_fields")       # a WeightPolicy is a NamedTuple; chunks: a tuple of them
    policies = tuple(policy) if chunked else (policy,)
    K = len(policies)
    if periodic is None:
        from ..schedules.periodic import no_flush_1f1b
        periodic = no_flush_1f1b(policies[0].name, D)
    if periodic.chunks != K:
        raise ConfigError(f"the timeline has {periodic.chunks} chunks per device, the policy {K}")
    by_branch = K > 1 or policies[0].choose is not None
    if K > 1 and any(p.choose is None or (p.land is not None and not p.land_at_call_end) for p in policies):
        raise ConfigError("a timeline of several chunks runs policies that choose among stored versions and "
                          "land between scans")
    if len({p.per_microbatch for p in policies}) != 1:
        raise ConfigError("the chunks' policies must all update per micro-batch or all per batch")
    ring = policies[0].apply_sum is not None
    W = mesh.shape[DATA]
    if ring and (D != 1 or mesh.shape[PIPE] != 1 or any(p.apply_sum is None for p in policies)):
        raise ConfigError("a ring reduction runs every stage on each worker of the 'data' axis (stage = pipe = 1)")
    units = periodic.unit_table(M)
    n_dp = mesh.shape[PIPE] * mesh.shape[DATA]
    # replicas (AvgPipe's parallel pipelines): one set of weights per 'pipe' index, averaged over 'data' only
    RED = (DATA,) if replicas else DP_AXES
    n_red = mesh.shape[DATA] if replicas else n_dp
    buf = periodic.buffers(M, periodic.replica_delay * (n_dp - 1))
    C, S = buf["ring"], buf["stash"]
    S_off = np.concatenate([[0], np.cumsum(S)])
    w_example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), model.stage_params)
    x_aval = jax.eval_shape(model.pre, model.pre_params, mb_example)
    y_aval = model.stage_output_aval(w_example, x_aval, mb_example)
    model.check_activation(x_aval, y_aval)
    summed = model.reduction(y_aval, mb_example) == "sum"
    model_key = lambda step, mb: microbatch_key(seed, step, mb)
    # (sum, count) losses: per-micro-batch updaters scale each micro-batch at the loss by replicas / its global
    # count; accumulating policies (2BW, CDP, WPipe) get unscaled sums, and each micro-batch's global count
    # travels back with dL/dy so that every stage divides its step's summed gradient by the step's count
    # (the ring reduction sums each micro-batch's count along the ring with its gradient)
    counting = summed and (ring or not policies[0].per_microbatch)
    ties = Ties(model)
    tie_avals = ties.pre_leaves(model.pre_params)
    T = periodic.call_ticks(M)
    in_scan = policies[0].land is not None and not policies[0].land_at_call_end
    segments = landing_segments(periodic, M, D) if in_scan else [(0, T, False)]
    lands = {c: landing_points(periodic, M, c, p) for c, p in enumerate(policies)
             if p.land is not None and p.land_at_call_end}
    cuts = sorted({tau for _, tau in lands.values() if tau < T})
    if cuts:
        segments = [(a, b, False) for a, b in zip([0] + cuts, cuts + [T])]
    if ring:        # runs of ticks with the same (may land, may update): only those compile the broadcast
        flags = ring_phases(periodic, M, W)
        segments = []
        for tau, f in enumerate(flags):
            if segments and segments[-1][2] == f:
                segments[-1] = (segments[-1][0], tau + 1, f)
            else:
                segments.append((tau, tau + 1, f))
    # positions: chunk c of device d is first (pre) where it holds model stage 0, last (loss) where it holds
    # the last; only the (chunk, position) pairs some device has are compiled
    stg = periodic.stage_table()
    n_st = periodic.num_stages
    pos_of = lambda c, d: int(stg[c, d] == 0) + 2 * int(stg[c, d] == n_st - 1)
    # a stream of one call made from a lane plan: residuals and messages in the plan's slots (below)
    slots = periodic.plan is not None
    if slots and any(p.finish is None for p in policies):
        raise ConfigError("a lane plan's stream runs under a policy that returns the call's gradient ('gradient')")
    routes = np.asarray(periodic.plan.table[..., [_L[k] for k in _ROUTE]]) if slots else None
    fused = all(p.finish is not None for p in policies) and not ring
    # ZB's split backward (a plan with a W lane): B computes the input gradient and keeps the per-layer output
    # gradients (the frontier, :mod:`.wsplit`) beside the residuals; W adds the weight gradient from them
    kinds = periodic.kinds          # the lanes of a tick: F, (F2,) B, (W)
    KB, KW, KF2 = kinds.index("B"), kinds.index("W") if "W" in kinds else -1, kinds.index("F2") if "F2" in kinds else -1
    split, paired = KW >= 0, KF2 >= 0
    w_frontier = split and periodic.plan.schedule.options.get("w_from", "frontier") == "frontier"
    # Chimera §3.2's eager gradient synchronisation: after these ticks some stages' replica gradients are final
    # and go home between two scans (chunk 1 of the replica device -> chunk 0 of the owner)
    eager = dict(eager_points(periodic.plan.schedule, periodic.plan.where)) if (
        slots and periodic.plan.schedule.options.get("eager_reduce")) else {}
    if eager and (K != 2 or any(p.sums is None for p in policies)):
        raise ConfigError("eager_reduce moves one chunk's gradient sums to another's: two chunks whose policies "
                          "expose their sums")
    if slots:       # one scan per phase of the plan, compiling only the lanes some device uses there (its cuts
        # include the eager-reduction points); a lane idle on every device costs a conditional per tick else
        segments = [(a, b, frozenset(u)) for a, b, u in periodic.plan.phases]
        if not {b for _, b, _ in segments} >= set(eager):
            raise ConfigError("the plan's phases must end at its eager-reduction points (runtime.common.lane_plan)")
    used_pos = [sorted({pos_of(c, d) for d in range(D)}) for c in range(K)]
    remap = np.zeros((K, 4), np.int32)
    for c in range(K):
        remap[c, used_pos[c]] = np.arange(len(used_pos[c]))
    done_tab = np.asarray(buf["done"], np.int32)

    def body(params, opt_state, pstate, carry, counters, batch, feed):
        sq = lambda t: jax.tree.map(lambda a: a[0], t)
        lps, oss, pss, carry = sq(params), sq(opt_state), sq(pstate), sq(carry)
        if not chunked:
            lps, oss, pss = (lps,), (oss,), (pss,)
        t0, base, n_fed = counters
        me = lax.axis_index(STAGE)
        view = lambda stack, c: jax.tree.map(lambda a: a[c], stack)
        views = lambda stack: tuple(view(stack, c) for c in range(K))
        sop, avals = StageOps.build(model, (views(lps) if ring else lps)[0][0], full(x_aval, 0),
                                    jax.tree.map(lambda a: a[0], carry.ring))
        replica = lax.axis_index(PIPE) * mesh.shape[DATA] + lax.axis_index(DATA)
        if len(avals) != len(carry.stash):
            raise RuntimeError(f"stage_fn's pullback stashes {len(avals)} residuals inside the program but "
                               f"{len(carry.stash)} were allocated; stage_fn must trace the same way every time")
        wsp = None
        if w_frontier:      # W from the frontier B keeps (none where the stage cannot be split: W recomputes)
            wsp = split_backward(sop.backward, lps[0][0], full(avals, 0), full(x_aval, 0), avals)
        if wsp is not None:     # in the plan's stash slots (last: scratch), for this call only
            carry = carry._replace(front=full(wsp.frontier_avals, jnp.nan if nan_bubbles else 0,
                                              (periodic.plan.stash_capacity + 1,)))
        # this call's micro-batches go to ring slots (base + n_fed + j) mod C; counted only when fed
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        if slots:       # a stream of one call reads its own batch (micro-batch g of the call), kept nowhere
            mb_of = lambda g: jax.tree.map(lambda a: read(a, g), batch)
        else:
            carry = carry._replace(ring=lax.fori_loop(0, M, lambda j, r: jax.tree.map(
                lambda rb, b: write(rb, (base + n_fed + j) % C, b[j]), r, batch), carry.ring))
            mb_of = lambda g: jax.tree.map(lambda a: read(a, (base + g) % C), carry.ring)
        n_fed = n_fed + M * feed.astype(jnp.int32)
        zero_like = lambda t: jax.tree.map(jnp.zeros_like, t)
        blank = lambda: full(x_aval, jnp.nan if nan_bubbles else 0)
        blank_tie = lambda: full(tie_avals, jnp.nan if nan_bubbles else 0)
        x_like = lambda: full(x_aval, 0)
        ctab, unit_tab = jnp.asarray(periodic.call_table(M)), jnp.asarray(units)
        s_off, s_cap = jnp.asarray(S_off[:-1], jnp.int32), jnp.asarray(S, jnp.int32)
        slot_of = lambda c, g: s_off[c] + g % s_cap[c]

        def op_of(t, d, kind, r=None):
            """(runs, chunk, g): device ``d``'s op ``kind`` (0: F, 1: B) at tick ``t``, of micro-batch ``g``, on
            replica ``r`` (default: this one; it runs ``r * replica_delay`` ticks late)."""
            if periodic.replica_delay:
                t = t - (replica if r is None else r) * periodic.replica_delay
            u, shift = ctab[t % T, d, kind, 0], ctab[t % T, d, kind, 1]
            q = t // T - shift
            row = unit_tab[jnp.maximum(u, 0)]
            g = (q + jnp.where(kind in (0, KF2), row[1], row[2])) * M + row[3]     # W: the B's micro-batch
            return (u >= 0) & (q >= 0) & (g >= 0) & (g < n_fed), row[0], g

        stage_of = lambda c: jnp.asarray(stg)[c, me]          # the model stage of this device's chunk c
        is_first = lambda c: stage_of(c) == 0
        is_last = lambda c: stage_of(c) == n_st - 1

        def position(c: int):
            """The position code of this device's chunk ``c``: 1 first (pre), 2 last (loss), 3 both."""
            return is_first(c).astype(jnp.int32) + 2 * is_last(c).astype(jnp.int32)

        def pick(c, values):
            """``values[c]`` for a traced chunk index (scalars)."""
            out = values[0]
            for cc in range(1, K):
                out = jnp.where(c == cc, values[cc], out)
            return out

        def forward_at(first, last):
            # one position's forward on the weights the policy chose: small outputs only (message,
            # residuals, dL/dy and head gradient of the last stage, its loss)
            def op(wF, x_in, t_in, mb, ctx):
                w, pre_p, post_p = wF
                # tied arrays: the version stage 0 reads for this micro-batch, carried to the last stage
                t_mine = ties.pre_leaves(pre_p) if first else t_in
                y, res, head = sop.forward(w, x_in, mb, pre_p, ties.post_with(post_p, t_mine), first, last, ctx)
                if not last:
                    return (cast(y, x_aval), res, x_like(), zero_like(post_p), jnp.zeros((), jnp.float32),
                            cast(t_mine, tie_avals), zero_like(tie_avals), jnp.zeros((), jnp.float32))
                return head_out(res, head)
            return op

        def head_out(res, head):
            """The last stage's outputs of one micro-batch's forward from its loss head."""
            l, n, gq, dy = head
            gq, gt = ties.take_post(gq)
            if ring:     # workers run this at different ticks: nothing collective; counts travel the ring
                n = jnp.asarray(n, jnp.float32) if summed else jnp.zeros((), jnp.float32)
                return blank(), res, cast(dy, x_aval), gq, l.astype(jnp.float32), blank_tie(), gt, n
            n_glob = psum_over(n, mesh, RED).astype(jnp.float32) if summed else jnp.zeros((), jnp.float32)
            if counting:
                l = psum_over(l, mesh, RED)     # the metric: summed, over the summed counts (below)
            elif summed:
                # (sum, count): this micro-batch's loss over every replica's real tokens -- scaled here so
                # that the pmean over replicas in B gives sum over replicas / global count
                scale = n_red / n_glob
                l, gq, gt, dy = l * scale, *jax.tree.map(lambda g: g * scale.astype(g.dtype), (gq, gt, dy))
            return blank(), res, cast(dy, x_aval), gq, l.astype(jnp.float32), blank_tie(), gt, n_glob

        def double_at(first, last):
            """Chimera §3.5's forward doubling as one micro-batch of twice the size (``double_batch``): the pair's
            inputs concatenated along the batch axis, one stage forward, the output and the stashed residuals
            split back per micro-batch; the loss head runs per micro-batch.  Two forward outputs, as
            :func:`forward_at`'s."""
            def op(wF, xs, ts, mbs):
                w, pre_p, post_p = wF
                if first:
                    xs = tuple(model.pre(pre_p, mb) for mb in mbs)
                    ts = (ties.pre_leaves(pre_p),) * 2
                x = jax.tree.map(lambda a, b: jnp.concatenate([a, b], 0), *xs)
                y, res, _ = sop.forward(w, x, None, pre_p, post_p, False, False, None)
                half = lambda t, k: jax.tree.map(lambda a: a[k * (a.shape[0] // 2):(k + 1) * (a.shape[0] // 2)], t)
                outs = []
                for k in range(2):
                    yk, rk = half(y, k), [half(r, k) for r in res]
                    if last:
                        outs.append(head_out(rk, sop.head(ties.post_with(post_p, ts[k]), yk, mbs[k])))
                    else:
                        outs.append((cast(yk, x_aval), rk, x_like(), zero_like(post_p), jnp.zeros((), jnp.float32),
                                     cast(ts[k], tie_avals), zero_like(tie_avals), jnp.zeros((), jnp.float32)))
                return tuple(outs)
            return op

        variants = [[forward_at(bool(p & 1), bool(p & 2)) for p in used_pos[c]] for c in range(K)]
        doubles = [[double_at(bool(p & 1), bool(p & 2)) for p in used_pos[c]] for c in range(K)] if paired else None

        def choices(g, lps, pss):
            """Per chunk: (version index, candidates) the policy chooses for micro-batch ``g`` on this device."""
            return [p.choose(lp, ps, base + g, me) for p, lp, ps in zip(policies, lps, pss)]

        def operands(ch, lps, pss):
            """The switch's weight operands: every chunk's candidates (each read in place by its branch) -- or, on
            a ring, the stacked candidates (``lps``, ``pss``: the stacks), each branch slicing its chunk (views
            sliced outside were materialised: 173 MiB of temp)."""
            if ring:
                return policies[0].choose(lps, pss, base, me)[1]
            return [cands for _, cands in ch]

        def per_chunk(lps, pss):
            """The chunks' (weights, policy state): views of the stacks on a ring, else as they are."""
            return (views(lps), views(pss)) if ring else (lps, pss)

        def candidate(cs, cc, w):
            return jax.tree.map(lambda a: a[cc], cs[w]) if ring else cs[cc][w]

        def f_lane(c, g, slot, x_in, t_in, ops):
            # F lane (docs/design.md §2 lanes): a predicate cond around the position switch, so that nothing
            # big passes through a multi-way conditional (XLA copies such pass-throughs every tick)
            lps, pss, cr, loss = ops
            gi = base + g
            mb = mb_of(g)
            pos = pick(c, [jnp.asarray(remap[cc])[position(cc)] for cc in range(K)])
            # global micro-batch gi is micro-batch gi mod M of step gi // M on model stage c D + me: the
            # synchronous schedules' keys
            ctx = sop.context(mb, model_key(gi // M, replica * M + gi % M), stage_of(c))
            if not by_branch:
                policy, lp, ps = policies[0], lps[0], pss[0]

                def fwd(wF):
                    return lax.switch(pos, variants[0], wF, x_in, t_in, mb, ctx)
                wF, ps = policy.forward_weights(lp, ps, gi, me)
                pss = (ps,)
                if policy.forward_is_current is None:
                    out = fwd(wF)
                else:
                    # stages predicting by 0 read lp itself (no weight-sized axpy); the others predict inside
                    # each position's branch, beside the forward that reads the prediction: made outside and
                    # passed in, the predicted weights were materialised (spectrain 1.28-1.35x -> 1.19-1.24x of
                    # micro_momentum, pipeoptim 0.95 -> 0.89x of micro_adamw, one-process A/B, BUILD_NOTES)
                    def predicted(v):
                        return lambda lp_, ps_, *a: variants[0][v](policy.forward_weights(lp_, ps_, gi, me)[0], *a)
                    out = lax.cond(policy.forward_is_current(me), lambda: fwd(lp), lambda: lax.switch(
                        pos, [predicted(v) for v in range(len(variants[0]))], lp, ps, x_in, t_in, mb, ctx))
            else:     # one branch per chunk, stored version and position: the chosen version is never copied
                ch = choices(g, *per_chunk(lps, pss))
                brs, start = [], []
                for cc, (_, cands) in enumerate(ch):
                    start.append(len(brs))
                    n = len(variants[cc])
                    brs += [(lambda cc, w, v: (lambda cs, *a: variants[cc][v](candidate(cs, cc, w), *a)))(cc, w, v)
                            for w in range(len(cands)) for v in range(n)]
                k = pick(c, [kk for kk, _ in ch])
                idx = pick(c, [start[cc] + k * len(variants[cc]) for cc in range(K)]) + pos
                out = lax.switch(idx, brs, operands(ch, lps, pss), x_in, t_in, mb, ctx)
            cr, loss, send = f_account(c, slot, out, cr, loss)
            return (pss, cr, loss), send

        def f_account(c, slot, out, cr, loss):
            """One forward's outputs into the state: residuals to their stash slot, the last stage's dL/dy and
            head gradient, the loss; returns the lane's message."""
            msg, res, dy, gq, l, t_out, gt, cnt = out
            last = is_last(c)
            cr = cr._replace(stash=[write(a, slot, r) for a, r in zip(cr.stash, res)])
            if slots:       # dL/dy leaves as the lane's message (kept in the plan's slot); post's gradient summed
                cr = cr._replace(gpost=jax.tree.map(lambda n, o: o + jnp.where(last, n, 0).astype(o.dtype), gq,
                                                    cr.gpost))
                send = (where(last, dy, msg), where(last, gt, t_out), jnp.where(last, cnt, 0.0))
            else:
                cr = cr._replace(dy_own=where(last, dy, cr.dy_own),
                                 gpost=jax.tree.map(lambda n, o: jnp.where(last, n, o), gq, cr.gpost),
                                 gtie=where(last, gt, cr.gtie), cnt_own=jnp.where(last, cnt, cr.cnt_own))
                send = (msg, t_out)
            # the metric: losses over their weight -- 1 each, or a (sum, count) loss's count on a ring
            weight = cnt if counting else jnp.ones((), jnp.float32)
            loss = (loss[0] + jnp.where(last, l, 0.0), loss[1] + last.astype(jnp.int32),
                    loss[2] + jnp.where(last, weight, 0.0))
            return cr, loss, send

        def f_lanes_paired(t, rr, is_f, cf, gf, sf, x_in, t_in, ops):
            """The F lane and its F2 pair lane (Chimera's forward doubling on the ordered placement): one doubled
            forward where both run (the plan pairs forwards of one stage position), the F lane alone where only
            it does.  A sum-only policy's current weights (no version choice)."""
            is_f2, cf2, gf2 = op_of(t, me, KF2)
            x2_in, t2_in = (read(a, rr[KF2, _R["in"]]) for a in ops[2].mbuf[:2])
            s2 = rr[KF2, _R["stash"]]
            nothing = (blank(), blank_tie(), jnp.full((), jnp.nan if nan_bubbles else 0, jnp.float32))

            def single(ops):
                (pss, cr, loss), send = f_cond(is_f, cf, gf, sf, x_in, t_in, ops=ops)
                return (pss, cr, loss), send, nothing

            def double(ops):
                lps, pss, cr, loss = ops
                pos = pick(cf, [jnp.asarray(remap[cc])[position(cc)] for cc in range(K)])
                brs, start = [], []
                for cc in range(K):
                    start.append(len(brs))
                    brs += [(lambda cc, v: lambda lps_, *a: doubles[cc][v](lps_[cc], *a))(cc, v)
                            for v in range(len(doubles[cc]))]
                idx = pick(cf, start) + pos
                oa, ob = lax.switch(idx, brs, lps, (x_in, x2_in), (t_in, t2_in), (mb_of(gf), mb_of(gf2)))
                cr, loss, send_a = f_account(cf, sf, oa, cr, loss)
                cr, loss, send_b = f_account(cf, s2, ob, cr, loss)
                return (pss, cr, loss), send_a, send_b
            return f_cond(is_f2, ops=ops, branches=(double, single))

        def f_cond(pred, *args, ops, branches=None):
            """``lax.cond(pred, f_lane, f_idle, *args, ops)`` (or ``branches(ops)``) with only what a forward
            writes as the conditional's outputs -- the stash, the last stage's registers, the loss (and the
            policy states where a forward may change them): the rest of the in-flight state (ring of
            micro-batches, message buffers) and a sum-only policy's gradient sums stay operands, which XLA does
            not copy; passed through, they were (+6-13% on the flushing schedules, HLO temp +4 MiB)."""
            lps, pss, cr, loss = ops

            def slim(fn):
                def run(*a):
                    (pss_, cr_, loss_), *sends = fn(*a)
                    return ((() if fused else pss_), tuple(getattr(cr_, f) for f in _F_OUT), loss_), *sends
                return run
            if branches is None:
                out = lax.cond(pred, slim(f_lane), slim(f_idle), *args, ops)
            else:
                out = lax.cond(pred, slim(branches[0]), slim(branches[1]), ops)
            (pss_out, fields, loss), *sends = out
            cr = cr._replace(**dict(zip(_F_OUT, fields)))
            return (pss if fused else pss_out, cr, loss), *sends

        def f_idle(c, g, slot, x_in, t_in, ops):
            lps, pss, cr, loss = ops
            nothing = (blank(), blank_tie()) + ((jnp.full((), jnp.nan if nan_bubbles else 0, jnp.float32),)
                                                if slots else ())
            return (pss, cr, loss), nothing

        def bwd(w, res, dy):
            """``(dw, dx, frontier)`` of a backward; split: ``dw`` is None (W computes it) and the frontier is
            what W reads (none where W recomputes)."""
            if not split:
                return (*sop.backward(w, res, dy), ())
            if wsp is not None:
                return (None, *wsp.input_part(w, res, dy))
            return None, sop.backward(w, res, dy)[1], ()

        def b_lane(c, g, slot, dy_in, t_in, ops):
            lps, pss, cr = ops
            gi = base + g
            res = [read(a, slot) for a in cr.stash]
            last, first = is_last(c), is_first(c)
            dy = dy_in if slots else where(last, cr.dy_own, dy_in)
            policy, (lp,), (ps,) = policies[0], *(v[:1] for v in per_chunk(lps, pss))
            pre_p = None
            if not by_branch and policy.backward_is_current is not None:
                # stages predicting by 0 read lp itself: no weight-sized axpy
                dw, dx, front = lax.cond(policy.backward_is_current(me), lambda: bwd(lp[0], res, dy),
                                         lambda: bwd(policy.backward_weights(lp, ps, gi, me)[0], res, dy))
            elif not by_branch:
                w, pre_p, _ = policy.backward_weights(lp, ps, gi, me)
                dw, dx, front = bwd(w, res, dy)
            else:
                ch = choices(g, *per_chunk(lps, pss))
                brs, start = [], []
                for cc, (_, cands) in enumerate(ch):
                    start.append(len(brs))
                    brs += [(lambda cc, v: (lambda cs, r, d: bwd(candidate(cs, cc, v)[0], r, d)))(cc, v)
                            for v in range(len(cands))]
                idx = pick(c, [start[cc] + ch[cc][0] for cc in range(K)])
                dw, dx, front = lax.switch(idx, brs, operands(ch, lps, pss), res, dy)
            dx = cast(dx, x_aval)
            dpre = zero_like(lp[1])
            # the tied arrays' last-stage gradient of this micro-batch, on its way to stage 0
            t_grad = t_in if slots else where(last, cr.gtie, t_in)
            if jax.tree.leaves(lp[1]):
                def pre_grad():
                    q0 = pre_p if pre_p is not None else policy.backward_weights(lp, ps, gi, me)[1]
                    return ties.add_to_pre(sop.pre_grad(q0, mb_of(g), dx), t_grad)
                dpre = lax.cond(first, pre_grad, lambda: zero_like(lp[1]))
            # a lane plan's stream summed post's gradient at its forwards (None: nothing to add here)
            dpost = None if slots else jax.tree.map(lambda a, q: jnp.where(last, a, 0).astype(q.dtype), cr.gpost, lp[2])
            grad = (dw, dpre, dpost)
            if ring:        # the previous worker's partial sum of this chunk (none on the first worker)
                grad = jax.tree.map(lambda p_, a: jnp.where(replica > 0, p_, jnp.zeros_like(p_)) + a.astype(p_.dtype),
                                    jax.tree.map(lambda b: read(b, c), cr.reduce.partial), grad)
            return grad, (where(first, blank(), dx), where(first, blank_tie(), t_grad)), front

        def b_idle(c, g, slot, dy_in, t_in, ops):
            lps, pss, cr = ops
            if ring:        # the last sum passes through (a fresh fill would be a weight-sized write per tick)
                return cr.reduce.gbuf, (blank(), blank_tie()), ()
            return zero_like(lps[0]), (blank(), blank_tie()), ()

        def b_apply(c, g, grad, cnt, lp, os_, ps):
            # the update, in a conditional of its own: one that also ran the backward (reading the weights
            # it then updates) made XLA copy the weights twice per tick (HLO-checked, BUILD_NOTES)
            gi = base + g
            policy = policies[c]
            if policy.finish is not None:       # local sums, reduced once after the call
                return policy.update(grad, lp, os_, ps, gi, me, count=cnt if counting else None)
            if counting:        # sums over replicas; the policy divides the step's sum by the step's count
                return policy.update(psum_over(grad, mesh, RED), lp, os_, ps, gi, me, count=cnt)
            return policy.update(pmean_over(grad, mesh, RED), lp, os_, ps, gi, me)

        ring_f = [(d, (d + 1) % D) for d in range(D)]
        ring_b = [(d, (d - 1) % D) for d in range(D)]

        def send(x, pairs):
            """A lane's message to the next (previous) device: its bits, or APC-compressed activation/gradient.
            One device (chunks wrapping around on it): the message stays -- a collective over a one-device group
            is still a rendezvous of every device on XLA CPU (BUILD_NOTES, "Collectives over one device")."""
            if D == 1:
                return x
            if len(x) == 3 and not counting:
                # (message, tied arrays, count): a count only matters to (sum, count) losses (XLA drops an unused
                # one too; this does not rely on it)
                return tuple(send(x[:2], pairs)) + (x[2],)
            if not apc:
                return ppermute_bits(x, STAGE, pairs)
            head, rest = x[0], x[1:]
            return (apc_unpack(lax.ppermute(apc_pack(head), STAGE, pairs), head),) + tuple(
                ppermute_bits(rest, STAGE, pairs))

        def deliver(li, rr, msg, mbuf):
            """A lane plan's stream: lane ``li``'s message kept on the device and/or sent on the plan's channels
            (one ``ppermute`` each), written to the slots the plan gave it (``rr``: this device's route row)."""
            if periodic.plan.keeps[li]:
                mbuf = write(mbuf, rr[_R["keep"]], msg)
            for ch in periodic.plan.channels[li]:
                fwd = ch == SEND_PLUS
                mbuf = write(mbuf, rr[_R["recv_p" if fwd else "recv_m"]], send(msg, ring_f if fwd else ring_b))
            return mbuf

        def errors_of(c, g, runs, pss):
            """1 where the op would read a version its chunk's policy no longer holds."""
            ok = [p.held(ps, base + g, me) if p.held is not None else jnp.asarray(True)
                  for p, ps in zip(policies, pss)]
            return (runs & ~pick(c, ok)).astype(jnp.int32)

        def b_lanes_summing(cb, gb, sb, dy_in, tb_in, cnt, is_b, lps, oss, pss, cr):
            """Policies that only sum gradients (``finish``): one predicate conditional per chunk runs the
            backward and adds its gradient to the chunk's sums in place -- a weight-sized gradient handed out
            of the backward's conditional to an update's was written and read again every tick (+25% on a
            flushing schedule, measured against the deleted lane executor)."""
            pss, send_b, fb = list(pss), None, cr.front
            for c in range(K):
                def run(g, slot, dy, t_in, n, ps, fb, c=c):
                    grad, snd, front = b_lane(c, g, slot, dy, t_in,
                                              (lps, tuple(pss[:c]) + (ps,) + tuple(pss[c + 1:]), cr))
                    if wsp is not None:     # the frontier into the micro-batch's slot beside its residuals
                        fb = [write(a, slot, f) for a, f in zip(fb, front)]
                    return b_apply(c, g, grad, n, lps[c], oss[c], ps)[2], fb, snd

                def idle(g, slot, dy, t_in, n, ps, fb):
                    return ps, fb, (blank(), blank_tie())
                pss[c], fb, snd = lax.cond(is_b & (cb == c), run, idle, gb, sb, dy_in, tb_in, cnt, pss[c], fb)
                send_b = snd if send_b is None else where(cb == c, snd, send_b)
            return tuple(pss), cr._replace(front=fb), send_b

        def w_lanes(t, rw, lps, oss, pss, cr):
            """ZB's W lane: the weight gradient of the micro-batch whose B ran earlier, from its residuals and
            its dL/dy (kept in their slots until now) and, split at the frontier, the per-layer output
            gradients its B kept; added to the chunk's sums (one predicate conditional per chunk)."""
            is_w, cw, gw = op_of(t, me, KW)
            pss = list(pss)
            for c in range(K):
                def run(g, rw, ps, c=c):
                    res = [read(a, rw[_R["stash"]]) for a in cr.stash]
                    dy = read(cr.mbuf[0], rw[_R["in"]])
                    if wsp is not None:
                        dw = wsp.weight_part(lps[c][0], res, dy, [read(a, rw[_R["stash"]]) for a in cr.front])
                    else:
                        dw = sop.backward(lps[c][0], res, dy)[0]
                    return policies[c].update((dw, None, None), lps[c], oss[c], ps, base + g, me)[2]
                pss[c] = lax.cond(is_w & (cw == c), run, lambda g, rw, ps: ps, gw, rw, pss[c])
            return tuple(pss)

        def land_stacked(j, new, cur, lp_st, ps_st, extra=()):
            """Ring: chunk ``j`` of the stacked state gets version ``new``, its policy retiring ``cur`` (written by
            dynamic-update-slice: XLA updates stacked buffers in place, where a conditional swapping per-chunk
            buffers copied the weights every tick -- HLO-checked)."""
            put = lambda st, v: jax.tree.map(lambda a, b: lax.dynamic_update_index_in_dim(a, b, j, 0), st, v)
            ps_j = policies[0].retire(cur, view(ps_st, j))
            return (put(lp_st, new), put(ps_st, ps_j)) + tuple(put(a, b) for a, b in extra)

        def receive_arrived(lps, pss, rs):
            """Ring: the stage the last worker sent last tick lands (its current version retired)."""
            cur = jax.tree.map(lambda a: read(a, rs.bchunk), lps)      # sliced outside the conditional
            return lax.cond(rs.bok, lambda lp_, ps_, cur_: land_stacked(rs.bchunk, rs.bnew, cur_, lp_, ps_),
                            lambda lp_, ps_, cur_: (lp_, ps_), lps, pss, cur)

        def ring_exchange(t, lps, oss, pss, rs, is_b, cb, g_sum, cnt, may_update):
            """Ring: the last worker updates from its complete sum; every worker sends its sum on to the next
            and keeps what the previous one sent; the updated stage goes from the last worker to the others
            (only in ticks where it may complete a sum: no collective inside a conditional)."""
            n_sum = jnp.where(replica > 0, read(rs.pcnt, cb), 0.0) + cnt
            n_sum = jnp.where(is_b, n_sum, rs.gcnt)
            if may_update:      # the last worker completes sums only in these ticks
                # the stage and its optimizer state sliced outside the conditional, written back in place
                cur, o_cur = jax.tree.map(lambda a: read(a, cb), (lps, oss))

                def apply(lp_, os_, ps_, cur_, o_):
                    new, o_new = policies[0].apply_sum(g_sum, n_sum, cur_, o_, counting=counting)
                    lp_, ps_, os_ = land_stacked(cb, new, cur_, lp_, ps_, ((os_, o_new),))
                    return lp_, os_, ps_

                lps, oss, pss = lax.cond(is_b & (replica == W - 1), apply, lambda lp_, os_, ps_, c_, o_: (lp_, os_, ps_),
                                         lps, oss, pss, cur, o_cur)
            rs = rs._replace(gbuf=g_sum, gcnt=n_sum)
            if W > 1:
                got, got_n = ppermute_bits((g_sum, n_sum), DATA, [(i, i + 1) for i in range(W - 1)])
                runs_s, c_s, _ = op_of(t, 0, 1, r=replica - 1)
                slot = jnp.where(runs_s & (replica > 0), c_s, K)
                rs = rs._replace(partial=jax.tree.map(lambda a, v: write(a, slot, v), rs.partial, got),
                                 pcnt=write(rs.pcnt, slot, got_n))
                l_runs, l_c, _ = op_of(t, 0, 1, r=W - 1)
                if may_update:
                    new = jax.tree.map(lambda a: read(a, l_c), lps)
                    if broadcast == "balanced":
                        arrived = balanced_broadcast(new, W, replica, DATA)
                    else:
                        arrived = None
                        for dst in range(W - 1):
                            m = ppermute_bits(new, DATA, [(W - 1, dst)])
                            arrived = m if arrived is None else where(replica == dst, m, arrived)
                    rs = rs._replace(bnew=arrived)
                rs = rs._replace(bchunk=l_c, bok=l_runs & (replica < W - 1))
            return lps, oss, pss, rs

        def tick(st, t, flags=True):
            """One tick.  ``flags`` (static, per scan segment): whether an in-scan landing may happen in it; on a
            ring, (may land an arrived stage, may complete a sum)."""
            lps, oss, pss, cr, loss = st
            # a lane plan's phase: the lanes some device uses in these ticks (the others are not compiled here)
            run = [li in flags for li in range(len(kinds))] if slots else [True] * len(kinds)
            rr = jnp.asarray(routes)[t % T, me] if slots else None     # this device's route rows
            if ring:            # stacked chunks: the lanes read static views of them
                if flags[0]:
                    lps, pss = receive_arrived(lps, pss, cr.reduce)
                stacks = (lps, oss, pss)
            is_f, cf, gf = op_of(t, me, 0)
            is_b, cb, gb = op_of(t, me, KB)
            err = errors_of(cf, gf, is_f, per_chunk(lps, pss)[1])
            if run[0]:
                if slots:       # the plan's slots: what each lane reads and where its stash goes
                    x_in, t_in = (read(a, rr[0, _R["in"]]) for a in cr.mbuf[:2])
                    sf = rr[0, _R["stash"]]
                else:
                    x_in, t_in, sf = cr.recv_f, cr.tie_f, slot_of(cf, gf)
                if K > 1 and not slots:   # device 0's later chunks read the last device's output from the wrap buffer
                    wx, wt = jax.tree.map(lambda a: read(a, gf % C), cr.wrap_f)
                    on_wrap = (me == 0) & (cf > 0)
                    x_in, t_in = where(on_wrap, wx, x_in), where(on_wrap, wt, t_in)
                if paired and run[KF2]:     # F2 pairs with F: one forward of the two micro-batches where both run
                    (pss, cr, loss), send_f, send_f2 = f_lanes_paired(t, rr, is_f, cf, gf, sf, x_in, t_in,
                                                                      (lps, pss, cr, loss))
                    cr = cr._replace(mbuf=deliver(KF2, rr[KF2], send_f2, deliver(0, rr[0], send_f, cr.mbuf)))
                else:
                    (pss, cr, loss), send_f = f_cond(is_f, cf, gf, sf, x_in, t_in, ops=(lps, pss, cr, loss))
                if slots:
                    if not (paired and run[KF2]):
                        cr = cr._replace(mbuf=deliver(0, rr[0], send_f, cr.mbuf))
                elif D > 1 or K > 1:
                    recv_f, tie_f = send(send_f, ring_f)
                    cr = cr._replace(recv_f=recv_f, tie_f=tie_f)
                    if K > 1:
                        runs_s, c_s, g_s = op_of(t, D - 1, 0)
                        slot = jnp.where((me == 0) & runs_s & (c_s < K - 1), g_s % C, C)
                        cr = cr._replace(wrap_f=jax.tree.map(lambda a, v: write(a, slot, v), cr.wrap_f, (recv_f, tie_f)))
            if run[KB]:
                err = err + errors_of(cb, gb, is_b, per_chunk(lps, pss)[1])
                if slots:
                    dy_in, tb_in, cnt = (read(a, rr[KB, _R["in"]]) for a in cr.mbuf)
                    sb = rr[KB, _R["stash"]]
                else:
                    dy_in, tb_in, cnt, sb = cr.recv_b, cr.tie_b, cr.cnt_b, slot_of(cb, gb)
                if K > 1 and not slots:   # the last device's earlier chunks read device 0's gradient from the wrap buffer
                    wd, wt, wc = jax.tree.map(lambda a: read(a, gb % C), cr.wrap_b)
                    on_wrap = (me == D - 1) & (cb < K - 1)
                    dy_in, tb_in, cnt = where(on_wrap, wd, dy_in), where(on_wrap, wt, tb_in), jnp.where(on_wrap, wc, cnt)
                if not slots:
                    cnt = jnp.where(is_last(cb), cr.cnt_own, cnt)
                if fused:
                    pss, cr, send_b = b_lanes_summing(cb, gb, sb, dy_in, tb_in, cnt, is_b, lps, oss, pss, cr)
                else:
                    grad, send_b, _ = lax.cond(is_b, b_lane, b_idle, cb, gb, sb, dy_in, tb_in, (lps, pss, cr))
                send_b = send_b + (jnp.where(is_b & ~is_first(cb), cnt,
                                             jnp.full((), jnp.nan if nan_bubbles else 0, jnp.float32)),)
                if ring:
                    lps, oss, pss, rs = ring_exchange(t, *stacks, cr.reduce, is_b, cb, grad, cnt, flags[1])
                    cr = cr._replace(reduce=rs)
                lps, oss, pss = (lps, oss, pss) if ring else (list(lps), list(oss), list(pss))
                for c in range(K if not (ring or fused) else 0):
                    # one conditional per chunk: each output is either its operand or a new value (no copies)
                    lps[c], oss[c], pss[c] = lax.cond(
                        is_b & (cb == c), lambda *a, c=c: b_apply(c, *a), lambda g, gr, n, *a: a, gb, grad, cnt,
                        lps[c], oss[c], pss[c])
                    if policies[c].apply_pending is not None:
                        lps[c] = lax.cond(is_b & (cb == c), policies[c].apply_pending, lambda lp, ps: lp, lps[c], pss[c])
                    if in_scan and flags:
                        lps[c], oss[c], pss[c] = lax.cond(
                            is_b & (cb == c) & policies[c].lands(base + gb),
                            lambda *a, c=c: policies[c].land(*a, counting=counting, b=(base + gb) // M),
                            lambda *a: a, lps[c], oss[c], pss[c])
                if slots:
                    cr = cr._replace(mbuf=deliver(KB, rr[KB], send_b, cr.mbuf))
                    if split and run[KW]:
                        pss = w_lanes(t, rr[KW], lps, oss, pss, cr)
                elif D > 1 or K > 1:
                    recv_b, tie_b, cnt_b = send(send_b, ring_b)
                    cr = cr._replace(recv_b=recv_b, tie_b=tie_b, cnt_b=cnt_b)
                    if K > 1:
                        runs_s, c_s, g_s = op_of(t, 0, 1)
                        slot = jnp.where((me == D - 1) & runs_s & (c_s > 0), g_s % C, C)
                        cr = cr._replace(wrap_b=jax.tree.map(lambda a, v: write(a, slot, v), cr.wrap_b,
                                                             (recv_b, tie_b, cnt_b)))
            cr = cr._replace(errors=cr.errors + err)
            if not ring:
                lps, oss, pss = tuple(lps), tuple(oss), tuple(pss)
            return (lps, oss, pss, cr, loss), None

        def land_between(st, tau):
            """The chunks whose batch completes by tick offset ``tau`` land it now (``lag`` calls after it was
            fed), outside any scan: a landing conditional in a scan made XLA copy the weights every tick."""
            if not any(tc == tau for _, tc in lands.values()):
                return st
            lps, oss, pss, cr, loss = st
            lps, oss, pss = list(lps), list(oss), list(pss)
            for c, (lag, tc) in lands.items():
                if tc != tau:
                    continue
                bk = t0 // T - lag
                lps[c], oss[c], pss[c] = lax.cond(
                    (bk >= 0) & (bk * M < n_fed),
                    lambda *a, c=c: policies[c].land(*a, counting=counting, b=base // M + bk),
                    lambda *a: a, lps[c], oss[c], pss[c])
            return tuple(lps), tuple(oss), tuple(pss), cr, loss

        def exchange_between(st, pairs):
            """Chimera §3.2: the replica gradients of the stages whose backwards are all done go home now
            (one ``ppermute`` for the group), where the transfer may overlap the rest of the pipeline; the sent
            sums are zeroed, so the exchange after the call adds nothing for them."""
            lps, oss, pss, cr, loss = st
            (get0, put0), (get1, put1) = policies[0].sums, policies[1].sums
            got = jax.tree.map(lambda a: lax.ppermute(a, STAGE, list(pairs)), get1(pss[1]))
            dst = jnp.isin(me, jnp.asarray([d for _, d in pairs]))
            src = jnp.isin(me, jnp.asarray([r for r, _ in pairs]))
            p0 = put0(pss[0], jax.tree.map(lambda a, b: jnp.where(dst, a + b, a), get0(pss[0]), got))
            p1 = put1(pss[1], jax.tree.map(lambda a: jnp.where(src, jnp.zeros_like(a), a), get1(pss[1])))
            return lps, oss, (p0, p1), cr, loss

        loss0 = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))
        st = (lps, oss, pss, carry, loss0)
        for a, b, flags in segments:
            if fused:       # sum-only policies never write the weights: they stay out of the loop's state
                def scan_tick(s_, t, fixed=st[:2], flags=flags):
                    return tick(fixed + s_, t, flags)[0][2:], None
                rest, _ = lax.scan(scan_tick, st[2:], t0 + jnp.arange(a, b, dtype=jnp.int32))
                st = st[:2] + rest
            else:
                st, _ = lax.scan(lambda s_, t: tick(s_, t, flags), st, t0 + jnp.arange(a, b, dtype=jnp.int32))
            st = land_between(st, b)
            if b in eager:
                st = exchange_between(st, eager[b])
        lps, oss, pss, carry, (lsum, lcount, lweight) = st
        carry = carry._replace(front=())
        if ring:        # every worker's own micro-batches: the call's losses over their summed weight
            lsum, lcount, lweight = lax.psum((lsum, lcount, lweight), (DATA, STAGE))
            loss = jnp.where(lweight > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan)
            errors = lax.psum(carry.errors, (DATA, STAGE))
        else:
            lsum, lcount, lweight = lax.psum((lsum, lcount, lweight), STAGE)
            lsum = pmean_over(lsum, mesh, RED)
            lcount = lax.pmax(lcount, DP_AXES)
            if counting:    # the summed loss over the summed counts of the call's micro-batches (global already)
                loss = jnp.where(lweight > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan)
            else:
                loss = jnp.where(lcount > 0, lsum / jnp.maximum(lcount, 1), jnp.nan)
            errors = lax.psum(carry.errors, STAGE)
        ex = lambda t: jax.tree.map(lambda a: a[None], t)
        q = t0 // T
        done = jnp.where(q < len(done_tab), jnp.asarray(done_tab)[jnp.minimum(q, len(done_tab) - 1)],
                         M * q + buf["done_steady"])
        done = jnp.clip(done, 0, n_fed)               # every op of these micro-batches has run
        counters = (t0 + T, base, n_fed)
        if slots:           # post's gradient, summed over the call's last-stage forwards, to the policy's sums
            w0, p0, _ = lps[0]
            g0 = (zero_like(w0), zero_like(p0), carry.gpost)
            pss = (policies[0].update(g0, *lps[0:1], oss[0], pss[0], base, me, count=0.0 if counting else None)[2],) \
                + tuple(pss[1:])
        reduce = (lambda t: psum_over(t, mesh, RED)) if counting else (lambda t: pmean_over(t, mesh, RED))
        if not ring:        # (sum, count) losses: the call's global count (a chunk may see some micro-batches only)
            total = lweight if counting else None
            pss = tuple(p.finish(ps, reduce, total) if p.finish is not None else ps for p, ps in zip(policies, pss))
        if not chunked:
            lps, oss, pss = lps[0], oss[0], pss[0]
        if replicas:        # each pipeline's own loss
            loss = loss[None]
        return ex(lps), ex(oss), ex(pss), ex(carry), counters, (loss, lcount, base + done, errors)

    # a ring's workers each hold a replica of their own (one per data index), AvgPipe's pipelines one per pipe
    # index; otherwise stage s's at index s
    own = P((DATA, STAGE)) if ring else P((PIPE, STAGE)) if replicas else P(STAGE)
    stage = lambda t: jax.tree.map(lambda _: own, t)
    dev = lambda t: jax.tree.map(lambda _: P(ALL), t)
    rep = lambda t: jax.tree.map(lambda _: P(), t)

    def fn(params, opt_state, pstate, carry, counters, batch, feed):
        in_specs = (stage(params), stage(opt_state), stage(pstate), dev(carry), rep(counters),
                    jax.tree.map(lambda _: P(DP_AXES), batch), P())
        out_specs = (stage(params), stage(opt_state), stage(pstate), dev(carry), rep(counters),
                     (P(PIPE) if replicas else P(), P(), P(), P()))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
            params, opt_state, pstate, carry, counters, batch, feed)

    return fn, x_aval
