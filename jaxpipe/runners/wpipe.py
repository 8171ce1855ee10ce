"""Train state and programs of WPipe / 2GW (used by ``jp.Pipeline(model, schedule="wpipe", ...)``).

The model has 2D stages (leading axis of ``stage_params`` = 2 x the mesh's ``stage`` size): device ``d``
trains G0's partition ``d`` and G1's partition ``D + d``.  Like the asynchronous schedules, WPipe never
flushes: ``step`` feeds one batch and runs its 4M ticks, ``drain`` finishes what is in flight.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..errors import ConfigError
from ..runtime.common import full
from ..runtime.stage import stage_residuals
from ..runtime.wpipe_executor import ALL, empty_carry, make_wpipe_fn
from .no_flush import InFlightRunner
from ..axes import STAGE


class WPipeState(NamedTuple):
    params: Any       # ((w0, pre, post), (w1, pre, post)) per device: G0 and G1 chunks, leading axis D
    opt_state: Any    # the optimizer's state per chunk
    shadow0: Any      # G0's previous version
    versions: Any     # [D, 2] int32: updates applied to G0 and G1 on each device
    accs: Any         # gradient sums of the current batch per chunk
    errors: Any       # [D] int32: reads of a version no longer held (must stay 0)
    carry: Any        # WPipeCarry (None until the first step)
    counters: Any     # (tick, base, fed)
    step: jax.Array


class WPipeRunner(InFlightRunner):
    def __init__(self, ctx):
        self.ctx = ctx
        self.D, self.M = ctx.mesh.shape[STAGE], ctx.num_microbatches
        if ctx.optimizer is None:
            raise ConfigError("wpipe updates its two groups inside the pipeline: give Pipeline(..., "
                              "optimizer=optax.adam(1e-3)) or another optax optimizer")
        self._fns = {}

    def init(self) -> WPipeState:
        D, (w, pre, post) = self.D, self.ctx.ties.strip(self.ctx.model.params)   # tied: once, in pre
        stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (D,) + jnp.shape(a)).copy(), t)
        lp0 = (jax.tree.map(lambda a: a[:D], w), stack(pre), stack(post))
        lp1 = (jax.tree.map(lambda a: a[D:], w), stack(pre), stack(post))
        opt = self.ctx.optimizer
        oss = (jax.vmap(opt.init)(lp0), jax.vmap(opt.init)(lp1))
        accs = jax.tree.map(jnp.zeros_like, (lp0, lp1))
        sh = NamedSharding(self.ctx.mesh, P(STAGE))
        params, oss, shadow0, accs = jax.device_put(((lp0, lp1), oss, jax.tree.map(jnp.copy, lp0), accs), sh)
        versions = jax.device_put(jnp.zeros((D, 2), jnp.int32), sh)
        errors = jax.device_put(jnp.zeros((D,), jnp.int32), sh)
        rep = NamedSharding(self.ctx.mesh, P())
        counters = jax.device_put(tuple(jnp.zeros((), jnp.int32) for _ in range(3)), rep)
        return WPipeState(params, oss, shadow0, versions, accs, errors, None, counters,
                          jax.device_put(jnp.zeros((), jnp.int32), rep))

    def params(self, state: WPipeState):
        (w0, pre, _), (w1, _, post) = state.params
        w = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), w0, w1)
        return self.ctx.ties.fill((w, jax.tree.map(lambda a: a[0], pre), jax.tree.map(lambda a: a[self.D - 1], post)))

    def _mb(self, batch):
        per = self.ctx.data_parallel * self.M
        return jax.tree.map(lambda l: jax.ShapeDtypeStruct((np.shape(l)[0] // per,) + tuple(np.shape(l)[1:]),
                                                           l.dtype), batch)

    def _ensure_carry(self, state, batch):
        if state.carry is not None:
            return state
        model, mb = self.ctx.model, self._mb(batch)
        w0 = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), model.stage_params)
        xa = jax.eval_shape(model.pre, model.pre_params, mb)
        _, res = stage_residuals(model, w0, full(xa, 0),
                                 jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), mb))
        carry = empty_carry(model, self.D, self.M, self.ctx.mesh.size, mb, xa, res, self.ctx.nan_bubbles)
        return state._replace(carry=jax.device_put(carry, NamedSharding(self.ctx.mesh, P(ALL))))

    def _fn(self, batch):
        key = (jax.tree.structure(batch), tuple((np.shape(l), str(l.dtype)) for l in jax.tree.leaves(batch)))
        if key not in self._fns:
            fn, _ = make_wpipe_fn(self.ctx.model, self.ctx.optimizer, self.D, self.M, self.ctx.mesh,
                                  self._mb(batch), nan_bubbles=self.ctx.nan_bubbles, seed=self.ctx.seed,
                                  apc=bool(self.ctx.options.get("apc")))

            def run(state: WPipeState, batch, feed):
                out = fn(state.params, state.opt_state, state.shadow0, state.versions, state.accs, state.errors,
                         state.carry, state.counters, batch, feed)
                params, oss, shadow0, versions, accs, errors, carry, counters, (lsum, lcount) = out
                step = state.step + feed.astype(jnp.int32)
                metrics = {"loss": jnp.where(lcount > 0, lsum / jnp.maximum(lcount, 1), jnp.nan),
                           "losses_computed": lcount, "version_errors": jnp.sum(errors), "step": step}
                return WPipeState(params, oss, shadow0, versions, accs, errors, carry, counters, step), metrics

            self._fns[key] = jax.jit(run, donate_argnums=(0,))
        return self._fns[key]

    def drain(self, state):
        """One call without new data finishes every batch in flight (its last G0 backward ends 2M + 2D - 3
        ticks into the next period, within it as M >= D - 1); then the counters restart the stream."""
        if state.carry is None:
            return state, {}
        per = self.ctx.data_parallel * self.M
        dummy = self.ctx.shard_batch(jax.tree.map(
            lambda r: jnp.zeros((r.shape[3] * per,) + tuple(r.shape[4:]), r.dtype), state.carry.ring))
        state, m = self._fn(dummy)(state, dummy, jnp.asarray(False))
        t, base, fed = state.counters
        return state._replace(counters=(jnp.zeros_like(t), base + fed, jnp.zeros_like(fed))), m
