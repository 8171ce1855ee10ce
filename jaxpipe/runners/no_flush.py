"""Train state and compiled programs of the asynchronous schedules (used by ``jp.Pipeline``).

The state carries the whole pipeline between calls (docs/design.md §3, "no-flush methods"):
per-stage weights (each stage with its own copy of ``pre``/``post``; stage 0's ``pre`` and stage D-1's
``post`` are the trained ones), per-stage optimizer and policy state, the in-flight residuals, messages
and recent micro-batches, and the counters ``(tick, base, fed)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..errors import ConfigError
from ..optim.policies import make_policy
from ..runtime.executor import ALL, make_stream_program
from ..runtime.inflight import empty_carry
from ..runtime.buffers import full, host_zeros
from ..runtime.stage import stage_residuals
from ..axes import STAGE, pipeline_devices
from ..sharding import is_P, like_params, param_specs, per_stage_shardings, guard_collectives
from ..checks.on_device import pop_status


class AsyncState(NamedTuple):
    params: Any  # (w [D, ...], pre [D, ...], post [D, ...]): stage s's local parameters at index s
    # (several chunks per device -- WPipe's groups --: a tuple of those, chunk c = stages c D..)
    opt_state: Any  # the wrapped optimizer's state per stage (leading axis D; per chunk, as params)
    policy_state: Any  # weight stash / shadow copy / last update, per stage (leading axis D; per chunk)
    carry: Any  # AsyncCarry: in-flight residuals, messages, recent micro-batches (one per device)
    counters: Any  # (tick, base, fed) int32: ticks since the (re)start, first micro-batch index, fed since
    step: jax.Array  # calls of step()


class InFlightRunner:
    """The protocol half every no-flush runner shares: its state carries micro-batches between calls; a
    program is compiled per batch structure (``_fn``) and the in-flight buffers are sized from the first
    batch (``_ensure_carry``)."""

    in_flight = True

    def prepare(self, state, batch):
        return self._ensure_carry(state, self.ctx.shard_batch(batch))

    def step(self, state, batch):
        batch = self.ctx.shard_batch(batch)
        state = self._ensure_carry(state, batch)
        state, metrics = self._fn(batch)(state, batch, jnp.asarray(True))
        metrics, status = pop_status(metrics)
        self.ctx.pending.put(status, batch, "step()")
        return state, metrics

    def lower(self, what: str, state, batch):
        if what != "step":
            raise ConfigError(f"{self.ctx.schedule.name} never flushes: only the 'step' program exists")
        batch = self.ctx.shard_batch(batch)
        state = self._ensure_carry(state, batch)
        return self._fn(batch).lower(state, batch, jnp.asarray(True))

    def loss_and_grad(self, state, batch):
        raise ConfigError(
            f"{self.ctx.schedule.name} is asynchronous (never flushes): its stages update their weights "
            "inside the "
            f"pipeline (per micro-batch or per group), so there is no single gradient of a batch; use "
            f"step(), or a synchronous schedule (gpipe, 1f1b) for loss_and_grad"
        )


class AsyncRunner(InFlightRunner):
    """Builds and caches the step/drain programs of one asynchronous ``Pipeline``."""

    def __init__(self, ctx):
        self.ctx = ctx
        model, D = ctx.model, ctx.mesh.shape[STAGE]
        self.D, self.M = D, ctx.num_microbatches
        if ctx.optimizer is None:
            raise ConfigError(
                f"{ctx.schedule.name} updates the weights inside the pipeline: give "
                f"Pipeline(..., optimizer=optax.sgd(0.1, momentum=0.9)) or another optax optimizer"
            )
        self.ties = ctx.ties  # tied arrays: held once, in stage 0's pre (jaxpipe.tying)
        self.K = ctx.schedule.periodic.chunks  # model chunks per device (stage c D + d on device d)
        lp_example = jax.eval_shape(self._local, self.ties.strip(model.params))
        opt_example = jax.eval_shape(ctx.optimizer.init, lp_example)
        self.policy = make_policy(
            ctx.method.policy,
            ctx.optimizer,
            D,
            self.M,
            opt_example,
            {k: ctx.options[k] for k in ctx.method.policy_keys},
        )
        self.policies = (self.policy,) if hasattr(self.policy, "_fields") else tuple(self.policy)
        if len(self.policies) != self.K:
            raise ConfigError(
                f"{ctx.schedule.name}: {len(self.policies)} weight policies for {self.K} chunks"
            )
        # what the simulator and the picture report: the versions the policies (with their options) keep
        ctx.schedule.weight_versions = [sum(v) for v in zip(*(p.versions(D) for p in self.policies))]
        self._fns = {}

    @staticmethod
    def _local(params):
        """One stage's local parameter set from the model's (stage 0's slice)."""
        w, pre, post = params
        return (jax.tree.map(lambda a: a[0], w), pre, post)

    # ------------------------------------------------------------------ state
    def init(self) -> AsyncState:
        ctx, D = self.ctx, self.D

        def build(params):
            w, pre, post = params
            stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (D,) + jnp.shape(a)), t)
            chunks = tuple(
                (jax.tree.map(lambda a: a[c * D : (c + 1) * D], w), stack(pre), stack(post))
                for c in range(self.K)
            )
            opt_state = tuple(jax.vmap(ctx.optimizer.init)(lp) for lp in chunks)
            # NaN mode: a scratch state (PipeDream's stash) starts as NaN, so a read before its write shows
            pstate = tuple(
                full(jax.vmap(p.init)(lp), jnp.nan)
                if ctx.nan_bubbles and p.scratch_state
                else jax.vmap(p.init)(lp)
                for p, lp in zip(self.policies, chunks)
            )
            if self.K == 1:
                return chunks[0], opt_state[0], pstate[0]
            return chunks, opt_state, pstate

        # one program (a new array per leaf: the step donates the state, the model's arrays must survive it)
        stripped = self.ties.strip(ctx.model.params)
        sh = self._state_shardings(*jax.eval_shape(build, stripped))
        params, opt_state, pstate = jax.jit(build, out_shardings=sh)(stripped)
        return AsyncState(params, opt_state, pstate, None, *zero_counts(ctx.mesh))

    def _state_shardings(self, params, opt_state, pstate):
        """Per stage, and over the model axes as the parameter each leaf belongs to (:mod:`jaxpipe.sharding`):
        the parameters by structure, the optimizer state by ``optax.tree_map_params``, the policy state
        (stashes, shadows, accumulators) by the trailing shape of the parameter it holds a copy of."""
        ctx, on = self.ctx, lambda spec: NamedSharding(self.ctx.mesh, spec)
        specs = param_specs(ctx.model, ctx.mesh, self.ties)
        chunk_sh = tuple(jax.tree.map(lambda s: on(P(STAGE, *s)), t, is_leaf=is_P) for t in specs)
        params_sh = chunk_sh if self.K == 1 else tuple(chunk_sh for _ in range(self.K))
        one = (lambda t: (t,)) if self.K == 1 else (lambda t: t)
        opt_sh = tuple(
            like_params(ctx.optimizer, o, p, sh, ctx.mesh, P(STAGE))
            for o, p, sh in zip(one(opt_state), one(params), one(params_sh))
        )
        local = jax.eval_shape(self._local, self.ties.strip(ctx.model.params))  # (shapes: nothing compiled)
        ps_sh = per_stage_shardings(pstate, (local, specs), ctx.mesh)
        return params_sh, opt_sh[0] if self.K == 1 else opt_sh, ps_sh

    def _ensure_carry(self, state: AsyncState, batch) -> AsyncState:
        if state.carry is not None:
            return state
        ctx = self.ctx
        mb = self._mb(batch)
        n_dev = pipeline_devices(ctx.mesh)
        w0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), ctx.model.stage_params)
        x_aval = jax.eval_shape(ctx.model.pre, ctx.model.pre_params, mb)
        mask, res_avals = stage_residuals(ctx.model, host_zeros(w0), host_zeros(x_aval), host_zeros(mb))
        # the buffers from one program, placed one entry per device (made one by one, a program per leaf)
        carry = jax.jit(
            lambda: empty_carry(
                ctx.model, ctx.schedule.periodic, self.M, n_dev, mb, x_aval, res_avals, ctx.nan_bubbles
            ),
            out_shardings=NamedSharding(ctx.mesh, P(ALL)),
        )()
        return state._replace(carry=carry)

    def _mb(self, batch):
        per = self.ctx.data_parallel * self.M
        return jax.tree.map(
            lambda l: jax.ShapeDtypeStruct(
                (np.shape(l)[0] // per,) + tuple(np.shape(l)[1:]),
                jnp.asarray(l).dtype if not hasattr(l, "dtype") else l.dtype,
            ),
            batch,
        )

    # ------------------------------------------------------------------ programs
    def _fn(self, batch_like):
        key = (
            jax.tree.structure(batch_like),
            tuple((tuple(np.shape(l)), str(l.dtype)) for l in jax.tree.leaves(batch_like)),
        )
        if key not in self._fns:
            ctx = self.ctx
            fn, _ = make_stream_program(
                ctx.model,
                self.policy,
                ctx.optimizer,
                self.D,
                self.M,
                ctx.mesh,
                self._mb(batch_like),
                nan_bubbles=ctx.nan_bubbles,
                periodic=ctx.schedule.periodic,
                seed=ctx.seed,
                apc=bool(ctx.options.get("apc")),
            )

            def run(state: AsyncState, batch, feed):
                params, opt_state, pstate, carry, counters, (loss, lcount, done, errors) = fn(
                    state.params,
                    state.opt_state,
                    state.policy_state,
                    state.carry,
                    state.counters,
                    batch,
                    feed,
                )
                step = state.step + feed.astype(jnp.int32)
                metrics = {
                    "loss": loss,
                    "losses_computed": lcount,
                    "microbatches_finished": done,
                    "microbatches_fed": counters[1] + counters[2],
                    "version_errors": errors,
                    "step": step,
                }
                return AsyncState(params, opt_state, pstate, carry, counters, step), metrics

            self._fns[key] = jax.jit(ctx.checks.guard(run, ctx.mesh, computed_loss_bad), donate_argnums=(0,))
            self._fns[key] = guard_collectives(self._fns[key], self.ctx.mesh)
        return self._fns[key]

    def drain(self, state: AsyncState):
        """Run the step program without new micro-batches until every micro-batch in flight finished (its last
        op ran: ``microbatches_finished`` reaches ``microbatches_fed``), then reset the counters so the next
        step refills the pipeline."""
        if state.carry is None:
            return state, {}
        per = self.ctx.data_parallel * self.M
        dummy = self.ctx.shard_batch(
            jax.tree.map(
                lambda r: jnp.zeros((r.shape[2] * per,) + tuple(r.shape[3:]), r.dtype), state.carry.ring
            )
        )
        # at most the stream's latency in calls (Periodic.buffers); fewer where the last feed finished earlier
        bound = max(1, self.ctx.schedule.periodic.buffers(self.M)["latency"])
        done = lambda m: int(m["microbatches_finished"]) >= int(m["microbatches_fed"])
        state, loss, n, m = drain_calls(self._fn(dummy), state, dummy, bound, done, self.ctx.pending)
        return state, {**m, "loss": loss, "losses_computed": n}

    def params(self, state: AsyncState):
        """The model's parameters: the chunks' stages in model order, stage 0's pre, the last stage's post."""
        chunks = state.params if self.K > 1 else (state.params,)
        w = jax.tree.map(lambda *a: jnp.concatenate(a), *(lp[0] for lp in chunks))
        pre, post = chunks[0][1], chunks[-1][2]
        return self.ties.fill(
            (w, jax.tree.map(lambda a: a[0], pre), jax.tree.map(lambda a: a[self.D - 1], post))
        )


def zero_counts(mesh):
    """``(counters, count)`` of a new :class:`AsyncState` (three int32 zeros, one), replicated, from one
    program."""
    zero = lambda: jnp.zeros((), jnp.int32)
    return jax.jit(
        lambda: (tuple(zero() for _ in range(3)), zero()), out_shardings=NamedSharding(mesh, P())
    )()


def computed_loss_bad(metrics):
    """A no-flush call's loss is bad where losses were computed and their mean is not finite (a call that
    computed none reports NaN by design)."""
    return (metrics["losses_computed"] > 0) & ~jnp.isfinite(metrics["loss"])


def drain_calls(run, state, dummy, bound: int, done=None, pending=None):
    """Call ``run`` without feeding at most ``bound`` times (fewer once ``done(metrics)``), then reset the
    counters so the next step refills the pipeline.  Returns ``(state, mean loss of the losses computed, their
    number, the last call's metrics)``."""
    lsum, lcount = 0.0, 0
    for _ in range(bound):
        state, m = run(state, dummy, jnp.asarray(False))
        m, status = pop_status(m)
        if pending is not None:  # drain reads every call's metrics anyway: check each call at once
            pending.put(status, dummy, "drain()")
            pending.check()
        n = int(m["losses_computed"])
        lsum, lcount = lsum + (float(m["loss"]) * n if n else 0.0), lcount + n
        if done is not None and done(m):
            break
    t, base, fed = state.counters
    state = state._replace(counters=(jnp.zeros_like(t), base + fed, jnp.zeros_like(fed)))
    return state, (lsum / lcount if lcount else float("nan")), lcount, m
