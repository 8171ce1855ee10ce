"""The runner of Cyclic Data Parallelism's DP form (``jp.CyclicDataParallel``; Fournier & Oyallon §3.2): N
workers on the mesh's ``data`` axis, each with every stage, the one executor's ring-reduction mode on the
stream of :func:`jaxpipe.schedules.cyclic.stream`.  Behind the same protocol as the no-flush runner
(:class:`~.no_flush.InFlightRunner`): the same state (:class:`~.no_flush.AsyncState`), the same in-flight
set-up and drain loop; only what differs is here (one replica of every stage per worker, the ring's buffers,
the drain's length)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..axes import AXES, DATA, STAGE
from ..runtime.buffers import host_zeros
from ..runtime.executor import make_stream_program
from ..runtime.inflight import empty_carry
from ..runtime.stage import stage_residuals
from ..sharding import param_specs, per_stage_shardings, guard_collectives
from .no_flush import AsyncState, InFlightRunner, computed_loss_bad, drain_calls, zero_counts


class CyclicRunner(InFlightRunner):
    """``ctx`` (a :class:`~jaxpipe.runners.RunContext`) with ``schedule`` the expanded cyclic stream and
    ``options`` ``{"policies": one cyclic_dp policy per stage, "broadcast": ...}``."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.N = ctx.mesh.shape[DATA]
        self.periodic = ctx.schedule.periodic
        self.policies = ctx.options["policies"]
        self.ties = ctx.ties
        self._fns = {}

    def _chunks(self, params=None):
        """Every stage's local parameters (w_j, pre, post), stacked: ``[worker, stage, ...]`` (one replica per
        worker; the executor's ring reduction keeps a worker's stages stacked and writes them in place), from
        ``params`` (the model's, ties stripped: the default)."""
        N, (w, pre, post) = self.N, self.ties.strip(self.ctx.model.params) if params is None else params
        per = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (N,) + jnp.shape(a)), t)
        lp = (w, per(pre), per(post))
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (N,) + a.shape), lp)

    def init(self) -> AsyncState:
        mesh = self.ctx.mesh

        def build(stripped):
            chunks = self._chunks(stripped)
            return (
                chunks,
                jax.vmap(jax.vmap(self.ctx.optimizer.init))(chunks),
                jax.vmap(jax.vmap(self.policies[0].init))(chunks),
            )

        # one replica per worker, its stages stacked; over the model axes as the model's param_specs say; one
        # program (a new array per leaf: the step donates the state, the model's arrays must survive it)
        stripped = self.ctx.ties.strip(self.ctx.model.params)
        local = jax.eval_shape(lambda p: (jax.tree.map(lambda a: a[0], p[0]), p[1], p[2]), stripped)
        specs = param_specs(self.ctx.model, mesh, self.ties)
        sh = per_stage_shardings(jax.eval_shape(build, stripped), (local, specs), mesh, lead=(DATA, STAGE))
        return AsyncState(*jax.jit(build, out_shardings=sh)(stripped), None, *zero_counts(mesh))

    def params(self, state: AsyncState):
        """Worker 0's replica (all replicas are equal once every update has arrived, e.g. after ``drain``)."""
        w, pre, post = jax.tree.map(lambda a: a[0], state.params)
        return self.ties.fill(
            (w, jax.tree.map(lambda a: a[0], pre), jax.tree.map(lambda a: a[self.N - 1], post))
        )

    def _mb(self, batch):
        return jax.tree.map(
            lambda l: jax.ShapeDtypeStruct((np.shape(l)[0] // self.N,) + tuple(np.shape(l)[1:]), l.dtype),
            batch,
        )

    def empty_carry(self, batch):
        """``(carry, activation avals)`` of an empty cycle, placed one entry per worker."""
        model, mb = self.ctx.model, self._mb(batch)
        w0 = host_zeros(
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), model.stage_params)
        )
        xa = jax.eval_shape(model.pre, model.pre_params, mb)
        model.check_activation(xa, model.stage_output_aval(w0, xa, mb))
        _, res = stage_residuals(model, w0, host_zeros(xa), host_zeros(mb))
        lp = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), jax.eval_shape(self._chunks))
        # the buffers from one program (made one by one, a program per leaf)
        carry = jax.jit(
            lambda: empty_carry(
                model,
                self.periodic,
                1,
                self.N,
                mb,
                xa,
                res,
                self.ctx.nan_bubbles,
                ring_lp=lp,
                replicas=self.N,
            ),
            out_shardings=NamedSharding(self.ctx.mesh, P(AXES)),
        )()
        return carry, xa

    def _ensure_carry(self, state: AsyncState, batch) -> AsyncState:
        return state if state.carry is not None else state._replace(carry=self.empty_carry(batch)[0])

    def _fn(self, batch):
        key = (jax.tree.structure(batch), tuple((np.shape(l), str(l.dtype)) for l in jax.tree.leaves(batch)))
        if key in self._fns:
            return self._fns[key]
        ctx = self.ctx
        fn, _ = make_stream_program(
            ctx.model,
            self.policies,
            ctx.optimizer,
            1,
            1,
            ctx.mesh,
            self._mb(batch),
            nan_bubbles=ctx.nan_bubbles,
            periodic=self.periodic,
            seed=ctx.seed,
            broadcast=ctx.options["broadcast"],
        )

        def run(state: AsyncState, batch, feed):
            params, opt_state, ps, carry, counters, (loss, lcount, _, errors) = fn(
                state.params, state.opt_state, state.policy_state, state.carry, state.counters, batch, feed
            )
            metrics = {"loss": loss, "losses_computed": lcount, "version_errors": errors}
            return AsyncState(
                params, opt_state, ps, carry, counters, state.step + feed.astype(jnp.int32)
            ), metrics

        # reported, not kept: a conditional around the ring's in-place landings makes XLA copy the stacked
        # stages (jaxpipe.checks.on_device); the next call raises, and a checkpoint of this state is refused
        self._fns[key] = jax.jit(ctx.checks.guard(run, ctx.mesh, computed_loss_bad), donate_argnums=(0,))
        self._fns[key] = guard_collectives(self._fns[key], self.ctx.mesh)
        return self._fns[key]

    def drain(self, state: AsyncState):
        """Every step in flight finished and every update arrived: the last worker's backward of the last step
        ends 2N - 1 + 2(N - 1) ticks after its feed, and its update lands a tick later (the stream's latency
        in calls); then the counters reset so the next step restarts the cycle."""
        if state.carry is None:
            return state, {}
        dummy = self.ctx.shard_batch(
            jax.tree.map(
                lambda r: jnp.zeros((r.shape[0] * r.shape[2],) + r.shape[3:], r.dtype), state.carry.ring
            )
        )
        span = self.periodic.replica_delay * (self.N - 1) + 1  # + 1: the broadcast lands a tick later
        calls = max(1, int(self.periodic.buffers(1, span)["latency"]))
        state, loss, n, m = drain_calls(self._fn(dummy), state, dummy, calls, pending=self.ctx.pending)
        return state, {"loss": loss, "losses_computed": n, "version_errors": int(m["version_errors"])}
