"""Cyclic Data Parallelism, multi-device DP form (Fournier & Oyallon, §3.2 and §4.2; Figure 1(b)-(c)).

    cdp = jp.CyclicDataParallel(model, optimizer=optax.sgd(0.1, momentum=0.9), rule="v2",
                                mesh=jp.make_mesh(data=4))
    state = cdp.init()
    state, metrics = cdp.step(state, batch)      # one micro-batch per worker; 2N time steps
    state, metrics = cdp.drain(state)            # finish what is in flight

N workers on the mesh's ``data`` axis each hold the whole model (cut into N stages, one time step per stage's
forward or backward) and run micro-batch after micro-batch on their own data, worker ``i`` delayed by
``2i`` time steps: worker ``i``'s training step ``k`` runs F of stage ``j`` at tick ``2Nk + 2i + j`` and B of
stage ``j`` at ``2Nk + 2i + 2N - 1 - j``.  The program reads this timeline as data, from
:func:`jaxpipe.schedules.cyclic.period_table` (the pictures' :func:`~jaxpipe.schedules.cyclic.op_of`).
Nothing waits at a barrier and nothing flushes between calls.

Gradients are reduced by point-to-point ``ppermute``s spread over the step, never one all-reduce: when
worker ``i`` finishes stage ``j``'s backward it adds its gradient to the partial sum worker ``i - 1`` sent
it (two ticks earlier) and sends the sum on to ``i + 1``; worker ``N - 1`` completes the sum, applies the
update (it alone runs the optimizer and holds its state) and sends the updated stage directly to every other
worker, which lands it at the start of the next tick (every worker keeps a full replica; the replicas stay
bit-identical without running the optimizer N times).  Whether a sum completes in a tick depends on the tick
only, so the sends run under a predicate every worker agrees on: on N of the 2N ticks.

Update rules (eq. CDP): micro-batch ``i`` of step ``t`` reads stage ``j`` at version
* ``v1``: ``t - 1`` everywhere (eq. CDP-v1, PipeDream-2BW's rule),
* ``v2``: ``t`` on stages ``j >= N - 1 - i`` (0-based; the paper's "j >= N - i + 1" 1-based) and ``t - 1``
  before them (eq. CDP-v2).  In this timeline the sum for stage ``j`` of step ``t - 1`` is complete at
  tick ``2Nt + 2N - 3 - j`` and arrives everywhere one tick later, exactly when worker ``i``'s forward of
  stage ``j`` needs it iff ``i + j >= N - 1``: the rule is what the schedule allows, as the paper says.
The backward reads the version its forward read; so a stage keeps the previous version until its last
reader (two versions, as in the pipeline form).  Both equal the serial reference of
:mod:`jaxpipe.optim.reference` (``cdp_v1`` / ``cdp_v2`` with M = N micro-batches) -- tested.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from .distributed import global_batch
from .errors import ConfigError
from .model import PipelineModel
from .model import microbatch_key
from .runtime.common import cast, full, ppermute_bits, read, where, write
from .runtime.stage import StageOps, stage_residuals
from .schedules import cyclic as cyc
from .axes import DATA, PIPE, STAGE

RULES = ("v1", "v2")
BROADCASTS = ("direct", "balanced")


class CyclicState(NamedTuple):
    params: Any       # (w [W, S, ...], pre [W, S, ...], post [W, S, ...]): each worker's replica, per stage
    shadow: Any       # the previous version of every stage, same layout
    versions: Any     # [W, S] int32: updates applied to each stage on each worker
    opt_state: Any    # the optimizer's state per worker and stage (worker N - 1's is the one used)
    carry: Any        # in-flight state per worker (stash, activation, dL/dy, partial sums, micro-batches)
    counters: Any     # (tick, base, fed) int32: ticks since the (re)start, first step index, steps fed since
    errors: Any       # [W] int32: reads of a version a worker no longer held (must stay 0)


class CyclicDataParallel:
    """Cyclic Data Parallelism over the mesh's ``data`` axis (see the module docstring)."""

    def __init__(self, model: PipelineModel, optimizer: optax.GradientTransformation, rule: str = "v2",
                 mesh=None, *, check_inputs: bool = True, seed: int = 0, nan_bubbles: bool = False,
                 broadcast: str = "direct"):
        self.seed = seed
        if broadcast not in BROADCASTS:
            raise ConfigError(f"CyclicDataParallel broadcast={broadcast!r}: choose 'direct' (worker N - 1 sends the "
                              f"updated stage to each other worker: (N - 1) x the stage per step from one worker) "
                              f"or 'balanced' (scattered in N - 1 chunks, then all-gathered among the receivers: "
                              f"no worker sends more than the stage, as in the paper's Table 1)")
        self.broadcast = broadcast
        if not isinstance(model, PipelineModel):
            raise ConfigError(f"model must be a jp.PipelineModel cut into N stages, got {type(model).__name__}")
        if rule not in RULES:
            raise ConfigError(f"CyclicDataParallel rule={rule!r}: choose 'v1' (eq. CDP-v1, one step of delay "
                              f"everywhere) or 'v2' (eq. CDP-v2, fresh parameters where the stage allows)")
        if optimizer is None:
            raise ConfigError("CyclicDataParallel updates inside the cycle: give optimizer=optax.sgd(...) or "
                              "another optax optimizer")
        if mesh is None:
            from .runtime.mesh import make_mesh
            mesh = make_mesh(data=model.num_stages)
        if mesh.shape.get(STAGE, 1) != 1 or mesh.shape.get(PIPE, 1) != 1:
            raise ConfigError(f"CyclicDataParallel runs N workers on the 'data' axis, each with the whole model; "
                              f"the mesh has stage={mesh.shape.get('stage')} pipe={mesh.shape.get('pipe')}: "
                              f"use jp.make_mesh(data=N)")
        N = mesh.shape[DATA]
        if model.num_stages != N:
            raise ConfigError(f"Cyclic Data Parallelism cuts the model into as many stages as workers (one time "
                              f"step per stage, workers 2 steps apart): the model has {model.num_stages} stages "
                              f"and the mesh {N} workers; build the model with {N} stages or use "
                              f"jp.make_mesh(data={model.num_stages})")
        self.model, self.opt, self.rule, self.mesh, self.N = model, optimizer, rule, mesh, N
        self.check_inputs = bool(check_inputs)
        # a debugging aid (as ``jp.Pipeline``'s): in-flight buffers start NaN (the ring's message buffer too,
        # which idle backward lanes resend), so a bubble read into a result shows as a non-finite number
        self.nan_bubbles = bool(nan_bubbles)
        from .tying import Ties
        # tied arrays: held once, in stage 0's pre; a worker's micro-batch reads the version its stage-0 forward
        # read (kept in the worker's carry) and its head gradient joins that micro-batch's stage-0 gradient
        self.ties = Ties(model)
        self._fns = {}

    # ------------------------------------------------------------------ state
    def init(self) -> CyclicState:
        N, (w, pre, post) = self.N, self.ties.strip(self.model.params)
        per_stage = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (N,) + jnp.shape(a)), t)
        lp = (w, per_stage(pre), per_stage(post))                   # [S, ...]
        opt = jax.vmap(self.opt.init)(lp)
        workers = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (N,) + a.shape).copy(), t)
        sh = NamedSharding(self.mesh, P(DATA))
        params, shadow, opt = jax.device_put((workers(lp), workers(lp), workers(opt)), sh)
        versions = jax.device_put(jnp.zeros((N, N), jnp.int32), sh)
        rep = NamedSharding(self.mesh, P())
        counters = jax.device_put(tuple(jnp.zeros((), jnp.int32) for _ in range(3)), rep)
        return CyclicState(params, shadow, versions, opt, None, counters,
                           jax.device_put(jnp.zeros((N,), jnp.int32), sh))

    def params(self, state: CyclicState):
        """The model's parameters ``(stage, pre, post)`` (worker 0's replica; all replicas are equal once
        every update has arrived, e.g. after ``drain``)."""
        w, pre, post = jax.tree.map(lambda a: a[0], state.params)
        return self.ties.fill((w, jax.tree.map(lambda a: a[0], pre), jax.tree.map(lambda a: a[self.N - 1], post)))

    def _mb_example(self, batch):
        return jax.tree.map(lambda l: jax.ShapeDtypeStruct((np.shape(l)[0] // self.N,) + tuple(np.shape(l)[1:]),
                                                           l.dtype), batch)

    def _check_batch(self, batch):
        sizes = {int(np.shape(l)[0]) for l in jax.tree.leaves(batch)}
        if len(sizes) != 1 or next(iter(sizes)) % self.N:
            raise ConfigError(f"the batch's leading size {sorted(sizes)} must be one size divisible by the "
                              f"{self.N} workers (one micro-batch each); use a multiple of {self.N}")

    def _empty_carry(self, batch):
        model, N = self.model, self.N
        mb = self._mb_example(batch)
        w0 = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), model.stage_params)
        xa = jax.eval_shape(model.pre, model.pre_params, mb)
        model.check_activation(xa, model.stage_output_aval(w0, xa, mb))
        _, res = stage_residuals(model, w0, full(xa, 0),
                                 jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), mb))
        blank = jnp.nan if self.nan_bubbles else 0

        def z(shape, dtype):
            return jnp.full((N,) + tuple(shape), blank if jnp.issubdtype(dtype, jnp.floating) else 0, dtype)
        lp0 = (w0, model.pre_params, self.ties.strip(model.params)[2])
        tied = self.ties.pre_leaves(model.pre_params)
        carry = dict(
            tie=jax.tree.map(lambda a: z(jnp.shape(a), a.dtype), tied),
            gtie=jax.tree.map(lambda a: z(jnp.shape(a), a.dtype), tied),
            cnt=z((), jnp.float32), pcnt=z((N,), jnp.float32),     # (sum, count) losses: own / partial counts
            stash=[z((N,) + tuple(a.shape), a.dtype) for a in res],
            act=full(xa, blank, (N,)), dy=full(xa, blank, (N,)),
            gpost=jax.tree.map(lambda a: z(jnp.shape(a), jnp.asarray(a).dtype), lp0[2]),
            partial=jax.tree.map(lambda a: z((N,) + jnp.shape(a), jnp.asarray(a).dtype), lp0),
            gbuf=(jax.tree.map(lambda a: z(jnp.shape(a), jnp.asarray(a).dtype), lp0), z((), jnp.float32)),
            bcast=(jax.tree.map(lambda a: z(jnp.shape(a), jnp.asarray(a).dtype), lp0),
                   z((), jnp.int32), z((), jnp.bool_)),
            ring=jax.tree.map(lambda a: z((2,) + tuple(a.shape), a.dtype), mb))
        return jax.device_put(carry, NamedSharding(self.mesh, P(DATA))), xa

    # ------------------------------------------------------------------ program
    def _program(self, batch):
        key = (jax.tree.structure(batch), tuple((np.shape(l), str(l.dtype)) for l in jax.tree.leaves(batch)))
        if key in self._fns:
            return self._fns[key]
        model, opt, N, v2 = self.model, self.opt, self.N, self.rule == "v2"
        seed, ties, balanced = self.seed, self.ties, self.broadcast == "balanced"
        _, xa = self._empty_carry(batch)

        def body(params, shadow, versions, opt_state, carry, counters, errors, batch, feed):
            sq = lambda t: jax.tree.map(lambda a: a[0], t)
            lp, sh, ver, os_, c, err = sq(params), sq(shadow), sq(versions), sq(opt_state), sq(carry), sq(errors)
            t0, base, n_fed = counters
            me = lax.axis_index(DATA)
            # this call's micro-batch (one per worker) goes to ring slot (base + n_fed) mod 2
            c["ring"] = jax.tree.map(lambda r, b: write(r, (base + n_fed) % 2, b), c["ring"], batch)
            ops, _ = StageOps.build(model, jax.tree.map(lambda a: a[0], lp[0]), full(xa, 0),
                                    jax.tree.map(lambda a: a[0], c["ring"]))
            # (sum, count) losses: gradients of the sums are reduced, each with the workers' summed count, and
            # a stage's update divides by that count (the step's exact masked mean) instead of by N
            summed = model.reduction(xa, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                                       c["ring"])) == "sum"
            n_fed = n_fed + feed.astype(jnp.int32)
            stage_of = lambda t, j: jax.tree.map(lambda a: read(a, j), t)
            put = lambda t, j, v: jax.tree.map(lambda a, b: write(a, j, b), t, v)

            def update(st, j, g_sum, cur_o):
                # worker N - 1 (where every sum completes) runs the optimizer; stage j's weights and optimizer
                # state are sliced outside the cond (``cur_o``): new values read from buffers that the same
                # branch updates in place made XLA copy the whole stacked model
                lp, sh, ver, os_ = st
                cur, o = cur_o
                g_sum, n = g_sum
                g = jax.tree.map(lambda a: a / (n.astype(a.dtype) if summed else N), g_sum)
                u, o = opt.update(g, o, cur)
                lp, sh, ver, _ = land(st, j, optax.apply_updates(cur, u), cur)
                return lp, sh, ver, put(os_, j, o)

            def land(st, j, new, cur):
                # the other workers receive the updated stage and keep the one it replaces (no optimizer:
                # the replicas stay bit-identical without running it N times)
                lp, sh, ver, os_ = st
                return (put(lp, j, new), put(sh, j, cur), ver.at[j].add(1), os_)

            def choice(st, j, gk, err):
                """0: the stage's current weights, 1: its shadow (the version the rule reads), and the count of
                version-read errors."""
                lp, sh, ver, _ = st
                v = jnp.where(j >= N - 1 - me, gk, gk - 1) if v2 else gk - 1
                v = jnp.maximum(v, 0)
                have = ver[j]
                fresh = have == v
                return jnp.where(fresh, 0, 1), err + (~fresh & (have - 1 != v)).astype(jnp.int32)

            def fwd_variant(k, first, last):
                # small outputs only: activation, residuals, dL/dy, head gradient, loss
                def f(cands, j, x_in, mb, ctx, t_reg):
                    w, pre_p, post_p = stage_of(cands[k], j)
                    t_mine = ties.pre_leaves(pre_p) if first else t_reg      # the micro-batch's tied version
                    y, res, head = ops.forward(w, x_in, mb, pre_p, ties.post_with(post_p, t_mine), first, last, ctx)
                    if not last:
                        return cast(y, xa), res, full(xa, 0), \
                            jax.tree.map(jnp.zeros_like, post_p), (jnp.zeros((), jnp.float32),) * 2, \
                            cast(t_mine, t_reg), jax.tree.map(jnp.zeros_like, t_reg)
                    l, n, gq, dy = head
                    gq, gt = ties.take_post(gq)
                    return (cast(y, xa), res, cast(dy, xa), gq, (l.astype(jnp.float32), jnp.asarray(n, jnp.float32)),
                            cast(t_mine, t_reg), gt)
                return f

            def bwd_variant(k):
                def b(cands, j, res, dy):
                    return ops.backward(stage_of(cands[k], j)[0], res, dy)
                return b

            flags = [(False, False), (True, False), (False, True), (True, True)]
            fwd_variants = [fwd_variant(k, *f) for k in range(2) for f in flags]
            bwd_variants = [bwd_variant(k) for k in range(2)]

            def f_lane(st, c, j, k, gk, err, loss, pos):
                lp, sh, _, _ = st
                kk, err = choice(st, j, gk, err)
                mb = jax.tree.map(lambda a: read(a, gk % 2), c["ring"])
                ctx = ops.context(mb, microbatch_key(seed, gk, me), j)     # worker me's micro-batch of step gk
                y, res, dy, gq, l, t_mine, gt = lax.switch(kk * 4 + pos, fwd_variants, (lp, sh), j, c["act"], mb, ctx,
                                                           c["tie"])
                last = j == N - 1
                c = {**c, "stash": [write(a, j, r) for a, r in zip(c["stash"], res)], "act": y,
                     "tie": t_mine, "gtie": where(last, gt, c["gtie"]), "cnt": jnp.where(last, l[1], c["cnt"]),
                     "dy": where(last, dy, c["dy"]),
                     "gpost": jax.tree.map(lambda n, o: jnp.where(last, n, o), gq, c["gpost"])}
                # the metric: summed losses and their counts (exact mean), or the micro-batch means and their number
                l_add, n_add = l if summed else (l[0], jnp.ones((), jnp.float32))
                return c, err, (loss[0] + jnp.where(last, l_add, 0.0), loss[1] + jnp.where(last, n_add, 0.0),
                                loss[2] + last.astype(jnp.int32))

            def b_lane(st, c, j, k, gk, err):
                lp, sh, _, _ = st
                kk, err = choice(st, j, gk, err)
                res = [read(a, j) for a in c["stash"]]
                dw, dx = lax.switch(kk, bwd_variants, (lp, sh), j, res, c["dy"])
                dx = cast(dx, xa)
                pre_p = jax.tree.map(lambda a, b: jnp.where(kk == 1, read(b, j), read(a, j)), lp[1], sh[1])
                dpre = jax.tree.map(jnp.zeros_like, pre_p)
                if jax.tree.leaves(pre_p):
                    mb = jax.tree.map(lambda a: read(a, gk % 2), c["ring"])
                    dpre = lax.cond(j == 0, lambda: ties.add_to_pre(ops.pre_grad(pre_p, mb, dx), c["gtie"]),
                                    lambda: jax.tree.map(jnp.zeros_like, pre_p))
                dpost = jax.tree.map(lambda a: jnp.where(j == N - 1, a, jnp.zeros_like(a)), c["gpost"])
                # ring reduction: the partial sum from worker me - 1, plus this worker's gradient
                g = jax.tree.map(lambda p, a: jnp.where(me > 0, p, jnp.zeros_like(p)) + a.astype(p.dtype),
                                 stage_of(c["partial"], j), (dw, dpre, dpost))
                n = jnp.where(me > 0, read(c["pcnt"], j), 0.0) + c["cnt"]
                return (g, n), dx, err

            def b_idle(st, c, j, k, gk, err):
                # the last message buffer passes through (a fresh zero/NaN fill would be a weight-sized write
                # every forward tick); what it holds is not read: the receiver knows no backward ran
                return c["gbuf"], c["dy"], err

            table = jnp.asarray(cyc.period_table(N))

            def role(t, w):
                """(active, is_f, stage, step) of worker ``w``'s op at tick ``t``: every worker can compute any
                worker's, so messages carry no indices or flags (each would be one more collective-permute, a
                rendezvous of every device, per tick)."""
                row = table[jnp.mod(t, 2 * N), w]
                k = jnp.floor_divide(t, 2 * N) + row[2]
                return (k >= 0) & (k < n_fed), row[0] == 1, row[1], k

            def tick_fn(may_land, may_update):
                """One tick; ``may_land`` / ``may_update``: whether this phase of the period can land an arrived
                stage / complete a sum on worker N - 1 (static: the ticks that cannot skip the weight-sized
                slices those conditionals need, which every worker would otherwise pay every tick)."""
                return lambda s, t: tick(s, t, may_land, may_update)

            def tick(s, t, may_land, may_update):
                st, c, err, loss = s
                # an updated stage that arrived from worker N - 1: land it first
                new_in, j_in, ok = c["bcast"]
                if may_land:
                    st = lax.cond(ok & (me < N - 1), lambda s, cur: land(s, j_in, new_in, cur), lambda s, cur: s, st,
                                  stage_of(st[0], j_in))
                active, is_f, j, k = role(t, me)
                pos = (j == 0).astype(jnp.int32) + 2 * (j == N - 1).astype(jnp.int32)
                # F lane and B lane: predicate conds around small switches (docs/design.md §2; a multi-way switch that
                # passes the model through copies it every tick)
                c, err, loss = lax.cond(active & is_f, f_lane, lambda st, c, j, k, gk, err, loss, pos: (c, err, loss),
                                        st, c, j, k, base + k, err, loss, pos)
                sent = active & ~is_f
                g, dx, err = lax.cond(sent, b_lane, b_idle, st, c, j, k, base + k, err)
                c = {**c, "dy": dx, "gbuf": g}
                if may_update:
                    st = lax.cond(sent & (me == N - 1), lambda s, cur: update(s, j, g, cur), lambda s, cur: s, st,
                                  (stage_of(st[0], j), stage_of(st[3], j)))
                # partial sums travel me -> me + 1; the complete sum goes from N - 1 straight to every worker
                if N > 1:
                    ring = [(i, i + 1) for i in range(N - 1)]
                    got = ppermute_bits(g if summed else g[0], DATA, ring)
                    got_g, got_n = got if summed else (got, None)
                    s_active, s_f, s_j, _ = role(t, me - 1)            # what worker me - 1 sent (nothing if me = 0)
                    got_ok = s_active & ~s_f & (me > 0)
                    c = {**c, "partial": lax.cond(got_ok, lambda q: put(q, s_j, got_g), lambda q: q, c["partial"])}
                    if summed:
                        c["pcnt"] = jnp.where(got_ok, c["pcnt"].at[s_j].set(got_n), c["pcnt"])
                    # whether worker N - 1 completed a sum this tick, and of which stage, is known to every worker:
                    # the broadcast runs under a predicate they agree on, on N of the 2N ticks
                    l_active, l_f, l_j, _ = role(t, N - 1)
                    done_any = l_active & ~l_f

                    def bcast():
                        new = stage_of(st[0], l_j)
                        if balanced:
                            return balanced_broadcast(new, N, me, DATA)
                        acc = None
                        for dst in range(N - 1):
                            m = ppermute_bits(new, DATA, [(N - 1, dst)])
                            acc = m if acc is None else jax.tree.map(lambda a, b: jnp.where(me == dst, b, a), acc, m)
                        return acc

                    # on the ticks that may complete a sum the sends run unconditionally (in the steady state
                    # every such tick completes one), so no collective sits inside a conditional (BUILD_NOTES,
                    # "The CI crash in the CDP test"); what arrives when nothing completed is never landed (the
                    # flag below is false)
                    arrived = bcast() if may_update else c["bcast"][0]
                    c = {**c, "bcast": (arrived, l_j, done_any & (me < N - 1))}
                return (st, c, err, loss), None

            loss0 = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
            carry = ((lp, sh, ver, os_), c, err, loss0)
            for a, b, flags in phase_segments(N):    # a call is one period: t0 is a multiple of 2N
                carry, _ = lax.scan(tick_fn(*flags), carry, t0 + jnp.arange(a, b, dtype=jnp.int32))
            st, c, err, (lsum, lweight, lcount) = carry
            lp, sh, ver, os_ = st
            lsum, lweight, lcount = lax.psum((lsum, lweight, lcount), DATA)
            ex = lambda t: jax.tree.map(lambda a: a[None], t)
            return (ex(lp), ex(sh), ex(ver), ex(os_), ex(c), (t0 + 2 * N, base, n_fed), ex(err),
                    (lsum, lweight, lcount))

        d = lambda t: jax.tree.map(lambda _: P(DATA), t)
        r = lambda t: jax.tree.map(lambda _: P(), t)

        def run(state: CyclicState, batch, feed):
            args = (state.params, state.shadow, state.versions, state.opt_state, state.carry, state.counters,
                    state.errors)
            specs = tuple(d(a) for a in args[:5]) + (r(state.counters), d(state.errors))
            out = jax.shard_map(body, mesh=self.mesh, in_specs=specs + (d(batch), P()),
                                out_specs=specs + ((P(), P(), P()),), check_vma=False)(*args, batch, feed)
            lsum, lweight, lcount = out[7]
            metrics = {"loss": jnp.where(lcount > 0, lsum / jnp.where(lweight > 0, lweight, 1.0), jnp.nan),
                       "losses_computed": lcount, "version_errors": jnp.sum(out[6])}
            return CyclicState(*out[:7]), metrics

        self._fns[key] = jax.jit(run, donate_argnums=(0,))
        return self._fns[key]

    # ------------------------------------------------------------------ public
    def prepare(self, state: CyclicState, batch) -> CyclicState:
        """The state with the in-flight buffers allocated (``Pipeline.prepare``): a checkpoint template."""
        self._check_batch(batch)
        if state.carry is None:
            state = state._replace(carry=self._empty_carry(
                global_batch(batch, NamedSharding(self.mesh, P(DATA))))[0])
        return state

    def step(self, state: CyclicState, batch):
        """Feed one micro-batch per worker (the batch's rows split over the workers in order) and run 2N
        time steps.  Metrics: ``loss`` (mean of the losses computed in this call; a (sum, count) loss: their
        summed values over their summed counts), ``losses_computed``,
        ``version_errors`` (always 0 unless the timeline is broken)."""
        self._check_batch(batch)
        if self.check_inputs:
            from .checks import require_finite
            require_finite(batch, "CyclicDataParallel(..., check_inputs=False)")
        batch = global_batch(batch, NamedSharding(self.mesh, P(DATA)))
        if state.carry is None:
            state = state._replace(carry=self._empty_carry(batch)[0])
        return self._program(batch)(state, batch, jnp.asarray(True))

    def drain(self, state: CyclicState):
        """Run without new data until every step in flight finished and every update arrived (2N - 1 ticks
        after the last feed: one more call), then reset the counters so the next step restarts the cycle."""
        if state.carry is None:
            return state, {}
        dummy = jax.tree.map(lambda r: jnp.zeros((r.shape[0] * r.shape[2],) + r.shape[3:], r.dtype),
                             state.carry["ring"])
        dummy = jax.device_put(dummy, NamedSharding(self.mesh, P(DATA)))
        state, m = self._program(dummy)(state, dummy, jnp.asarray(False))
        t, base, fed = state.counters
        return state._replace(counters=(jnp.zeros_like(t), base + fed, jnp.zeros_like(fed))), m


def balanced_broadcast(x, N: int, me, axis):
    """``x`` (a pytree) of worker ``N - 1`` on every other worker, no worker sending more than ``x``'s size:
    worker ``N - 1`` scatters ``x`` in ``N - 1`` chunks (chunk ``r`` to worker ``r``), then the receivers
    all-gather them along a ring (``N - 2`` shifts; each sends ``(N - 2) / (N - 1)`` of ``x``).  The direct
    alternative sends ``(N - 1)`` copies from one worker.  Exact (a permutation of bytes; leaves of mixed
    float dtypes travel in their common dtype and come back exactly).  Worker ``N - 1``'s result is garbage."""
    from jax.flatten_util import ravel_pytree
    flat, unravel = ravel_pytree(x)
    R, n = N - 1, flat.shape[0]
    size = -(-n // R)
    chunks = jnp.pad(flat, (0, size * R - n)).reshape(R, size)
    mine = jnp.zeros((size,), flat.dtype)
    for r in range(R):
        got = lax.ppermute(chunks[r], axis, [(N - 1, r)])
        mine = jnp.where(me == r, got, mine)
    out = jnp.zeros((R, size), flat.dtype).at[jnp.minimum(me, R - 1)].set(mine)
    for shift in range(1, R):
        got = lax.ppermute(mine, axis, [(i, (i + shift) % R) for i in range(R)])
        out = out.at[jnp.mod(me - shift, R)].set(got)
    return unravel(out.reshape(-1)[:n])


def phase_segments(N: int):
    """The 2N ticks of a call cut into ``(start, stop, (may_land, may_update))`` runs of equal flags: worker
    N - 1 completes a stage's sum (runs a backward) at phases ``(s - 2(N - 1)) mod 2N >= N``, i.e. ``N - 2 ..
    2N - 3``, and the other workers land it one tick later."""
    upd = set(cyc.update_phases(N))
    land = {(s + 1) % (2 * N) for s in upd} if N > 1 else set()
    segs = []
    for s in range(2 * N):
        flags = (s in land, s in upd)
        if segs and segs[-1][2] == flags:
            segs[-1] = (segs[-1][0], s + 1, flags)
        else:
            segs.append((s, s + 1, flags))
    return segs


def single_device_grad(model: PipelineModel, num_workers: int, cyclic: bool = True):
    """``fn(params, mbs) -> (loss_sum, grads_sum)`` over a stream ``mbs`` of ``[K, N, ...]`` micro-batches
    (step k, worker i) run on ONE device in the cyclic order (Table 1, "Single-GPU DP + Cyclic"), with fixed
    parameters: N workers interleaved two ticks apart, each tick every worker runs one stage's F or B,
    activations kept in a pool of N (N + 1)/2 stage slots (:func:`jaxpipe.schedules.cyclic.pool_slot`)
    instead of N x N.  A memory demonstration that also computes the right numbers (tested against
    ``jax.grad``).  ``cyclic=False`` runs the same program with every worker in step (DP's order: no delay,
    a pool of N x N slots), so XLA's temp bytes of the two differ only by the order.
    :func:`single_device_dp_grad` is plain ``jax.grad`` over each step's N micro-batches, for reference."""
    N = num_workers
    delay = 2 if cyclic else 0
    size = cyc.pool_size(N) if cyclic else N * N
    pool_slot = cyc.pool_slot if cyclic else (lambda N, i, j, k: i * N + j)
    pool_size = lambda N: size
    if model.num_stages != N:
        raise ConfigError(f"the model has {model.num_stages} stages; cyclic order needs one per worker ({N})")
    pre = model.pre

    def fn(params, mbs):
        w_all, pre_p, post_p = params
        K = jax.tree.leaves(mbs)[0].shape[0]
        mb0 = jax.tree.map(lambda a: a[0, 0], mbs)
        xa = jax.eval_shape(pre, pre_p, mb0)
        w0 = jax.tree.map(lambda a: a[0], w_all)
        _require_mean_loss(model, xa, mb0)
        ops, res = StageOps.build(model, w0, full(xa, 0), mb0)
        pool = [jnp.zeros((pool_size(N) + 1,) + tuple(a.shape), a.dtype) for a in res]
        regs = full(xa, 0, (N,))
        gpost_regs = jax.tree.map(lambda a: jnp.zeros((N,) + jnp.shape(a), jnp.asarray(a).dtype), post_p)
        g0 = jax.tree.map(jnp.zeros_like, params)

        # Branches return small new values; the pool and the registers are written outside the switch
        # (a branch returning the whole pool makes XLA copy it every tick).  Slot pool_size is scratch.
        def f_op(first, last):
            def f(i, j, k, x_in, r_in, dy_in, g, loss):
                w = jax.tree.map(lambda a: read(a, j), w_all)
                mb = jax.tree.map(lambda a: a[k, i], mbs)
                y, r, head = ops.forward(w, x_in, mb, pre_p, post_p, first, last,
                                         ops.context(mb, microbatch_key(0, k, i), j))
                dy, gq = full(xa, 0), jax.tree.map(jnp.zeros_like, post_p)
                if last:
                    l, _, gq, d = head
                    dy, loss = cast(d, xa), loss + l
                return r, cast(y, xa), dy, gq, g, loss
            return f

        def b_op(first, last):
            def b(i, j, k, x_in, r_in, dy_in, g, loss):
                w = jax.tree.map(lambda a: read(a, j), w_all)
                dw, dx = ops.backward(w, r_in, dy_in)
                gw, gpre, gpo = g
                gw = jax.tree.map(lambda a, v: a.at[j].add(v), gw, dw)
                if first:
                    mb = jax.tree.map(lambda a: a[k, i], mbs)
                    dpre = ops.pre_grad(pre_p, mb, cast(dx, xa))
                    gpre = jax.tree.map(jnp.add, gpre, dpre)
                return (r_in, x_in, cast(dx, xa), jax.tree.map(jnp.zeros_like, post_p),
                        (gw, gpre, gpo), loss)
            return b

        def idle(i, j, k, x_in, r_in, dy_in, g, loss):
            return r_in, x_in, dy_in, jax.tree.map(jnp.zeros_like, post_p), g, loss

        flags = [(False, False), (True, False), (False, True), (True, True)]
        branches = [idle] + [f_op(*f) for f in flags] + [b_op(*f) for f in flags]

        def tick(c, t):
            pool, act, dy, gpost, g, loss = c
            for i in range(N):
                tau = t - delay * i
                k = jnp.floor_divide(tau, 2 * N)
                p = jnp.mod(tau, 2 * N)
                is_f = p < N
                j = jnp.where(is_f, p, 2 * N - 1 - p)
                pos = (j == 0).astype(jnp.int32) + 2 * (j == N - 1).astype(jnp.int32)
                ok = (tau >= 0) & (k < K)
                kk = jnp.clip(k, 0, K - 1)
                br = jnp.where(ok, jnp.where(is_f, 1 + pos, 5 + pos), 0)
                slot = pool_slot(N, i, j, kk)
                r_in = [read(a, slot) for a in pool]
                r, y, d, gq, g, loss = lax.switch(br, branches, i, j, kk, read(act, i), r_in, read(dy, i), g, loss)
                f_last = ok & is_f & (j == N - 1)
                b_last = ok & ~is_f & (j == N - 1)
                # the head's gradient joins with the backward of the last stage
                g = (g[0], g[1], jax.tree.map(lambda a, v: a + jnp.where(b_last, v[i], 0), g[2], gpost))
                gpost = jax.tree.map(lambda a, v: a.at[i].set(jnp.where(f_last, v, a[i])), gpost, gq)
                pool = [write(a, jnp.where(ok & is_f, slot, pool_size(N)), v) for a, v in zip(pool, r)]
                act, dy = write(act, i, y), write(dy, i, d)
            return (pool, act, dy, gpost, g, loss), None

        c = (pool, regs, regs, gpost_regs, g0, jnp.zeros((), jnp.float32))
        c, _ = lax.scan(tick, c, jnp.arange(2 * N * K + 2 * N - 2, dtype=jnp.int32))
        return c[5], c[4]

    return fn


def single_device_dp_grad(model: PipelineModel, num_workers: int):
    """``fn(params, mbs) -> (loss_sum, grads_sum)`` the standard way on one device: each step's N micro-
    batches forward and backward together (Table 1, "Single-GPU DP": N B Psi_A of activations at the peak),
    a scan over the K steps."""
    def fn(params, mbs):
        def one(g, step_mbs):
            def loss(p):
                return jnp.sum(jax.vmap(lambda mb: model.loss(p, mb))(step_mbs))
            l, gg = jax.value_and_grad(loss)(params)
            return jax.tree.map(jnp.add, g, gg), l
        g, ls = lax.scan(one, jax.tree.map(jnp.zeros_like, params), mbs)
        return jnp.sum(ls), g
    return fn


def _require_mean_loss(model, x_aval, mb):
    """The cyclic programs update from a step's micro-batch gradients averaged over the workers; a (sum,
    count) post_loss would silently become a mean of micro-batch means there: refuse it."""
    mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), mb)
    if model.reduction(x_aval, mb) == "sum":
        raise ConfigError("CyclicDataParallel averages the workers' micro-batch gradients, and post_loss returns a "
                          "(sum, count) pair: the normalisation would silently be the mean of micro-batch means. "
                          "Return a scalar mean loss, or train with a synchronous schedule (gpipe, 1f1b, ...), "
                          "which divides by the exact global count")
