"""Cyclic Data Parallelism, multi-device DP form (Fournier & Oyallon, §3.2 and §4.2; Figure 1(b)-(c)).

    cdp = jp.CyclicDataParallel(model, optimizer=optax.sgd(0.1, momentum=0.9), rule="v2",
                                mesh=jp.make_mesh(data=4))
    state = cdp.init()
    state, metrics = cdp.step(state, batch)      # one micro-batch per worker; 2N time steps
    state, metrics = cdp.drain(state)            # finish what is in flight

N workers on the mesh's ``data`` axis each hold the whole model (cut into N stages, one time step per stage's
forward or backward) and run micro-batch after micro-batch on their own data, worker ``i`` delayed by
``2i`` time steps: worker ``i``'s training step ``k`` runs F of stage ``j`` at tick ``2Nk + 2i + j`` and B of
stage ``j`` at ``2Nk + 2i + 2N - 1 - j``.  It runs on the one no-flush executor
(``runtime/executor.py``), which reads this timeline as data from :func:`jaxpipe.schedules.cyclic.stream`
(every stage a chunk of the worker's device, worker ``i`` ``2i`` ticks late; replayed against the pictures'
:func:`~jaxpipe.schedules.cyclic.op_of` in the tests) in its ring-reduction mode, with one weight policy per
stage (:func:`jaxpipe.optim.policies.cyclic_dp`).  Nothing waits at a barrier and nothing flushes between
calls.

Gradients are reduced by point-to-point ``ppermute``s spread over the step, never one all-reduce: when
worker ``i`` finishes stage ``j``'s backward it adds its gradient to the partial sum worker ``i - 1`` sent
it (two ticks earlier) and sends the sum on to ``i + 1``; worker ``N - 1`` completes the sum, applies the
update (it alone runs the optimizer and holds its state) and sends the updated stage directly to every other
worker (``broadcast="balanced"``: scattered and all-gathered, :func:`jaxpipe.runtime.common.balanced_broadcast`),
which lands it at the start of the next tick (every worker keeps a full replica, its stages stacked and
written in place; the replicas stay bit-identical without running the optimizer N times).  Whether a sum
completes in a tick depends on the tick only, so the broadcast is compiled into those ticks alone: no
collective inside a conditional.

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
from .optim.policies import cyclic_dp
from .runtime.executor import make_stream_program
from .runtime.inflight import empty_carry
from .runtime.common import cast, full, read, write
from .runtime.common import balanced_broadcast
from .runtime.stage import StageOps, stage_residuals
from .schedules import cyclic as cyc
from .axes import AXES, DATA, PIPE, STAGE

__all__ = ["BROADCASTS", "RULES", "CyclicDataParallel", "CyclicState", "balanced_broadcast", "single_device_dp_grad",
           "single_device_grad"]

RULES = ("v1", "v2")
BROADCASTS = ("direct", "balanced")


class CyclicState(NamedTuple):
    params: Any        # (w [W, S, ...], pre [W, S, ...], post [W, S, ...]): each worker's replica, per stage
    opt_state: Any     # the optimizer's state per worker and stage (worker N - 1's is the one used)
    policy_state: Any  # per worker and stage: the previous version and the updates applied (policies.cyclic_dp)
    carry: Any         # in-flight state per worker (stash, messages, ring partial sums, broadcast, micro-batches)
    counters: Any      # (tick, base, fed) int32: ticks since the (re)start, first step index, steps fed since
    step: Any = None


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
        # tied arrays: held once, in stage 0's pre; a micro-batch reads the version its stage-0 forward read
        # (carried with its activation) and its head gradient joins that micro-batch's stage-0 gradient
        self.ties = Ties(model)
        self.periodic = cyc.stream(N)
        self.policies = tuple(cyclic_dp(optimizer, N, j, rule) for j in range(N))
        self._fns = {}

    # ------------------------------------------------------------------ state
    def _chunks(self):
        """Every stage's local parameters (w_j, pre, post), stacked: ``[worker, stage, ...]`` (one replica per
        worker; the executor's ring reduction keeps a worker's stages stacked and writes them in place)."""
        N, (w, pre, post) = self.N, self.ties.strip(self.model.params)
        per = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (N,) + jnp.shape(a)), t)
        lp = (w, per(pre), per(post))
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (N,) + a.shape).copy(), lp)

    def init(self) -> CyclicState:
        chunks = self._chunks()
        opt = jax.vmap(jax.vmap(self.opt.init))(chunks)
        ps = jax.vmap(jax.vmap(self.policies[0].init))(chunks)
        sh = NamedSharding(self.mesh, P((DATA, STAGE)))
        rep = NamedSharding(self.mesh, P())
        counters = jax.device_put(tuple(jnp.zeros((), jnp.int32) for _ in range(3)), rep)
        return CyclicState(*jax.device_put((chunks, opt, ps), sh), None, counters,
                           jax.device_put(jnp.zeros((), jnp.int32), rep))

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
        """``(carry, activation avals)`` of an empty cycle, placed one entry per worker."""
        model, mb = self.model, self._mb_example(batch)
        w0 = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), model.stage_params)
        xa = jax.eval_shape(model.pre, model.pre_params, mb)
        model.check_activation(xa, model.stage_output_aval(w0, xa, mb))
        _, res = stage_residuals(model, w0, full(xa, 0), jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), mb))
        lp = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), self._chunks())
        carry = empty_carry(model, self.periodic, 1, self.N, mb, xa, res, self.nan_bubbles, ring_lp=lp,
                            replicas=self.N)
        return jax.device_put(carry, NamedSharding(self.mesh, P(AXES))), xa

    # ------------------------------------------------------------------ program
    def _program(self, batch):
        key = (jax.tree.structure(batch), tuple((np.shape(l), str(l.dtype)) for l in jax.tree.leaves(batch)))
        if key in self._fns:
            return self._fns[key]
        fn, _ = make_stream_program(self.model, self.policies, self.opt, 1, 1, self.mesh, self._mb_example(batch),
                              nan_bubbles=self.nan_bubbles, periodic=self.periodic, seed=self.seed,
                              broadcast=self.broadcast)

        def run(state: CyclicState, batch, feed):
            params, opt_state, ps, carry, counters, (loss, lcount, _, errors) = fn(
                state.params, state.opt_state, state.policy_state, state.carry, state.counters, batch, feed)
            metrics = {"loss": loss, "losses_computed": lcount, "version_errors": errors}
            return CyclicState(params, opt_state, ps, carry, counters, state.step + feed.astype(jnp.int32)), metrics

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
        """Run without new data until every step in flight finished and every update arrived (the last
        worker's backward of the last step ends 2N - 1 + 2(N - 1) ticks after its feed, and its update lands
        a tick later: the stream's latency in calls), then reset the counters so the next step restarts the
        cycle.  Metrics: those of the drain's calls together."""
        if state.carry is None:
            return state, {}
        dummy = jax.tree.map(lambda r: jnp.zeros((r.shape[0] * r.shape[2],) + r.shape[3:], r.dtype),
                             state.carry.ring)
        dummy = jax.device_put(dummy, NamedSharding(self.mesh, P(DATA)))
        span = self.periodic.replica_delay * (self.N - 1) + 1       # + 1: the broadcast lands a tick later
        calls = max(1, int(self.periodic.buffers(1, span)["latency"]))
        lsum, lcount, errors = 0.0, 0, 0
        for _ in range(calls):
            state, m = self._program(dummy)(state, dummy, jnp.asarray(False))
            n = int(m["losses_computed"])
            lsum, lcount, errors = lsum + (float(m["loss"]) * n if n else 0.0), lcount + n, int(m["version_errors"])
        t, base, fed = state.counters
        m = {"loss": lsum / lcount if lcount else float("nan"), "losses_computed": lcount, "version_errors": errors}
        return state._replace(counters=(jnp.zeros_like(t), base + fed, jnp.zeros_like(fed))), m


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
