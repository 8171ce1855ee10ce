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
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..errors import ConfigError
from ..model import microbatch_key
from ..tying import Ties
from .common import ROUTE_COLUMNS, eager_points, full, pmean_over, psum_over, read, write
from .landing import landing_points, landing_segments, ring_phases
from .stage import StageOps
from .wsplit import split_backward
from .call_base import CallBase
from .lanes_backward import BackwardLanes
from .lanes_forward import ForwardLanes
from .ring import RingReduce
from .ticks import Ticks
from ..axes import AXES, DATA, DP_AXES, PIPE, STAGE
from ..schedules.lanes import L as _L

ALL = AXES


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
    sx = _static(model, policy, D, M, mesh, mb_example, nan_bubbles, periodic, seed, apc, broadcast, replicas)
    _phases(sx)

    def body(params, opt_state, pstate, carry, counters, batch, feed):
        return _Call(sx, params, opt_state, pstate, carry, counters, batch, feed).run()

    # a ring's workers each hold a replica of their own (one per data index), AvgPipe's pipelines one per pipe
    # index; otherwise stage s's at index s
    own = P((DATA, STAGE)) if sx.ring else P((PIPE, STAGE)) if replicas else P(STAGE)
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

    return fn, sx.x_aval


def _static(model, policy, D, M, mesh, mb_example, nan_bubbles, periodic, seed, apc, broadcast, replicas):
    """What the program knows before tracing: the policies, the stream's tables and buffer sizes, the
    activation's shapes, how losses are normalised.  A namespace of these names (read as ``self.<name>`` by
    the lanes)."""
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
    return SimpleNamespace(
        model=model, D=D, M=M, mesh=mesh, nan_bubbles=nan_bubbles, seed=seed, apc=apc, broadcast=broadcast,
        replicas=replicas, chunked=chunked, policies=policies, K=K, periodic=periodic, by_branch=by_branch,
        ring=ring, W=W, units=units, RED=RED, n_red=n_red, buf=buf, C=C, S=S, S_off=S_off, x_aval=x_aval,
        summed=summed, model_key=model_key, counting=counting, ties=ties, tie_avals=tie_avals)


def _phases(sx):
    """The scans of a call (``sx.segments``: tick ranges with their static flags), where accumulating
    policies land, the plan's routing columns and eager-reduction points, and the chunk positions compiled."""
    periodic, M, D, policies, ring, W, K, buf = sx.periodic, sx.M, sx.D, sx.policies, sx.ring, sx.W, sx.K, sx.buf
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
    routes = np.asarray(periodic.plan.table[..., [_L[k] for k in ROUTE_COLUMNS]]) if slots else None
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
    sx.__dict__.update(
        T=T, in_scan=in_scan, segments=segments, lands=lands, stg=stg, n_st=n_st, slots=slots, routes=routes,
        fused=fused, kinds=kinds, KB=KB, KW=KW, KF2=KF2, split=split, paired=paired, w_frontier=w_frontier,
        eager=eager, used_pos=used_pos, remap=remap, done_tab=done_tab)


class _Call(CallBase, ForwardLanes, BackwardLanes, RingReduce, Ticks):
    """One trace of the program on one device: the static facts (``_static``, ``_phases``) as attributes,
    this call's traced values (device and replica index, the stage's ops, counters, micro-batch reader), the
    lanes (:mod:`.lanes_forward`, :mod:`.lanes_backward`), the ring reduction (:mod:`.ring`) and the ticks and
    their scans (:mod:`.ticks`)."""

    def __init__(self, sx, params, opt_state, pstate, carry, counters, batch, feed):
        self.__dict__.update(vars(sx))
        sq = lambda t: jax.tree.map(lambda a: a[0], t)
        lps, oss, pss, carry = sq(params), sq(opt_state), sq(pstate), sq(carry)
        if not self.chunked:
            lps, oss, pss = (lps,), (oss,), (pss,)
        self.t0, self.base, n_fed = counters
        self.me = lax.axis_index(STAGE)
        self.replica = lax.axis_index(PIPE) * self.mesh.shape[DATA] + lax.axis_index(DATA)
        self.sop, avals = StageOps.build(self.model, (self.views(lps) if self.ring else lps)[0][0],
                                         full(self.x_aval, 0), jax.tree.map(lambda a: a[0], carry.ring))
        if len(avals) != len(carry.stash):
            raise RuntimeError(f"stage_fn's pullback stashes {len(avals)} residuals inside the program but "
                               f"{len(carry.stash)} were allocated; stage_fn must trace the same way every time")
        self.wsp = None
        if self.w_frontier:      # W from the frontier B keeps (none where the stage cannot be split: W recomputes)
            self.wsp = split_backward(self.sop.backward, lps[0][0], full(avals, 0), full(self.x_aval, 0), avals)
        if self.wsp is not None:     # in the plan's stash slots (last: scratch), for this call only
            carry = carry._replace(front=full(self.wsp.frontier_avals, jnp.nan if self.nan_bubbles else 0,
                                              (self.periodic.plan.stash_capacity + 1,)))
        # this call's micro-batches go to ring slots (base + n_fed + j) mod C; counted only when fed
        M, C, base = self.M, self.C, self.base
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        if self.slots:       # a stream of one call reads its own batch (micro-batch g of the call), kept nowhere
            self.mb_of = lambda g: jax.tree.map(lambda a: read(a, g), batch)
        else:
            carry = carry._replace(ring=lax.fori_loop(0, M, lambda j, r: jax.tree.map(
                lambda rb, b: write(rb, (base + n_fed + j) % C, b[j]), r, batch), carry.ring))
            ring_buf = carry.ring
            self.mb_of = lambda g: jax.tree.map(lambda a: read(a, (base + g) % C), ring_buf)
        self.n_fed = n_fed + M * feed.astype(jnp.int32)
        self.ctab, self.unit_tab = jnp.asarray(self.periodic.call_table(M)), jnp.asarray(self.units)
        self.s_off, self.s_cap = jnp.asarray(self.S_off[:-1], jnp.int32), jnp.asarray(self.S, jnp.int32)
        self.variants = [[self.forward_at(bool(p & 1), bool(p & 2)) for p in self.used_pos[c]]
                         for c in range(self.K)]
        self.doubles = [[self.double_at(bool(p & 1), bool(p & 2)) for p in self.used_pos[c]]
                        for c in range(self.K)] if self.paired else None
        self.ring_f = [(d, (d + 1) % self.D) for d in range(self.D)]
        self.ring_b = [(d, (d - 1) % self.D) for d in range(self.D)]
        self.state = (lps, oss, pss, carry)

    # small readers shared by the lanes
    def view(self, stack, c):
        return jax.tree.map(lambda a: a[c], stack)

    def views(self, stack):
        return tuple(self.view(stack, c) for c in range(self.K))

    def zero_like(self, t):
        return jax.tree.map(jnp.zeros_like, t)

    def blank(self):
        return full(self.x_aval, jnp.nan if self.nan_bubbles else 0)

    def blank_tie(self):
        return full(self.tie_avals, jnp.nan if self.nan_bubbles else 0)

    def x_like(self):
        return full(self.x_aval, 0)

    def slot_of(self, c, g):
        return self.s_off[c] + g % self.s_cap[c]

    def stage_of(self, c):
        """The model stage of this device's chunk ``c``."""
        return jnp.asarray(self.stg)[c, self.me]

    def is_first(self, c):
        return self.stage_of(c) == 0

    def is_last(self, c):
        return self.stage_of(c) == self.n_st - 1

    def run(self):
        """The call: the scans of its phases (landings and eager exchanges between them), then the metrics,
        the counters, and a gradient policy's reduction."""
        lps, oss, pss, carry = self.state
        M, T, policies, mesh, RED = self.M, self.T, self.policies, self.mesh, self.RED
        loss0 = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))
        st = self.scan_phases((lps, oss, pss, carry, loss0))
        lps, oss, pss, carry, (lsum, lcount, lweight) = st
        carry = carry._replace(front=())
        if self.ring:        # every worker's own micro-batches: the call's losses over their summed weight
            lsum, lcount, lweight = lax.psum((lsum, lcount, lweight), (DATA, STAGE))
            loss = jnp.where(lweight > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan)
            errors = lax.psum(carry.errors, (DATA, STAGE))
        else:
            lsum, lcount, lweight = lax.psum((lsum, lcount, lweight), STAGE)
            lsum = pmean_over(lsum, mesh, RED)
            lcount = lax.pmax(lcount, DP_AXES)
            if self.counting:    # the summed loss over the summed counts of the call's micro-batches (global already)
                loss = jnp.where(lweight > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan)
            else:
                loss = jnp.where(lcount > 0, lsum / jnp.maximum(lcount, 1), jnp.nan)
            errors = lax.psum(carry.errors, STAGE)
        ex = lambda t: jax.tree.map(lambda a: a[None], t)
        q = self.t0 // T
        done_tab = self.done_tab
        done = jnp.where(q < len(done_tab), jnp.asarray(done_tab)[jnp.minimum(q, len(done_tab) - 1)],
                         M * q + self.buf["done_steady"])
        done = jnp.clip(done, 0, self.n_fed)               # every op of these micro-batches has run
        counters = (self.t0 + T, self.base, self.n_fed)
        if self.slots:           # post's gradient, summed over the call's last-stage forwards, to the policy's sums
            w0, p0, _ = lps[0]
            g0 = (self.zero_like(w0), self.zero_like(p0), carry.gpost)
            pss = (policies[0].update(g0, *lps[0:1], oss[0], pss[0], self.base, self.me,
                                      count=0.0 if self.counting else None)[2],) + tuple(pss[1:])
        reduce = (lambda t: psum_over(t, mesh, RED)) if self.counting else (lambda t: pmean_over(t, mesh, RED))
        if not self.ring:        # (sum, count) losses: the call's global count (a chunk may see some micro-batches only)
            total = lweight if self.counting else None
            pss = tuple(p.finish(ps, reduce, total) if p.finish is not None else ps for p, ps in zip(policies, pss))
        if not self.chunked:
            lps, oss, pss = lps[0], oss[0], pss[0]
        if self.replicas:        # each pipeline's own loss
            loss = loss[None]
        return ex(lps), ex(oss), ex(pss), ex(carry), counters, (loss, lcount, self.base + done, errors)
