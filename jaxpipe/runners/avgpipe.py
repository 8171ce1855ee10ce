"""Train state and programs of AvgPipe (Xu et al.): N parallel pipelines with elastic averaging (used by
``jp.Pipeline(model, schedule="avgpipe", mesh=jp.make_mesh(pipes=N, stages=D), avgpipe={...})``).

Each index of the mesh's ``pipe`` axis runs its own pipeline on its own batch (the global batch's rows are
split over ``pipe`` x ``data`` like data parallelism) and trains its own replica; gradients are averaged
over ``data`` only.  The replicas are then updated by :func:`jaxpipe.optim.elastic.elastic_averaging`
around the reference model, which is what ``Pipeline.params`` returns.

Advance forward propagation (§4.2, Algorithm 1): ``advance="auto"`` starts as 1F1B and, after each step
timed at the current ``advance``, tries one more forward in advance while the step gets faster (by more
than ``tolerance``) and the compiled program's memory stays under ``memory_limit``; it then keeps the
fastest.  Changing ``advance`` never changes the numbers (same gradient accumulation order): it is a pure
speed/memory trade-off, so the search cannot change what training computes.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import schedules
from ..errors import ConfigError
from .avgpipe_shared import check_shareable, from_executor, interleave_shares, shared_model, to_executor
from ..optim.elastic import check_alpha, elastic_averaging
from ..schedules.layout import lane_plan, stream_options
from ..sharding import branches_refused, is_P, param_specs, guard_collectives
from ..checks.on_device import STATUS, gate, pop_status
from ..runtime.gradient import make_stream_grad_fn
from ..schedules.periodic import one_call
from ..checks.values import is_int
from ..axes import DATA, PIPE, STAGE


class AvgPipeState(NamedTuple):
    params: Any  # (w [N, S, ...], pre [N, ...], post [N, ...]): one replica per pipe index
    opt_state: Any  # ElasticState: the wrapped optimizer's state per replica + the reference model
    step: jax.Array


class AvgPipeRunner:
    def __init__(self, ctx):
        opts = dict(ctx.options)
        self.ctx = ctx
        self.N = ctx.mesh.shape[PIPE]
        # shared=N: the paper's setting, N pipelines on the same stage devices
        # (jaxpipe.runners.avgpipe_shared)
        self.shared = opts.get("shared")
        if self.shared is not None:
            if not is_int(self.shared, 1):
                raise ConfigError(
                    f"avgpipe shared={self.shared!r}: give the number N >= 1 of parallel pipelines "
                    f"that share the stage devices, or None for one pipeline per 'pipe' index"
                )
            if self.N != 1:
                raise ConfigError(
                    f"avgpipe shared={self.shared} runs the pipelines on the same stage devices, and "
                    f"the mesh has pipes={self.N}: use jp.make_mesh(stages=D) (pipes=1), or drop "
                    f"'shared' to run one pipeline per 'pipe' index"
                )
            check_shareable(ctx.model, self.shared)
            self.N = int(self.shared)
        self.D = ctx.mesh.shape[STAGE]
        self.M = ctx.num_microbatches
        self.alpha = check_alpha(opts.get("alpha"), self.N)
        adv = opts.get("advance", "auto")
        self.auto = adv in ("auto", None)
        if not self.auto and not is_int(adv, 0):
            raise ConfigError(
                f"avgpipe advance={adv!r}: give a non-negative integer (forwards issued beyond "
                f"1F1B's warm-up: 0 = 1F1B, {max(self.M - 1, 0)} = all forwards first) or 'auto'"
            )
        self.advance = 0 if self.auto else min(adv, max(self.M - 1, 0))
        self.memory_limit = opts.get("memory_limit")
        if self.memory_limit is not None and (
            isinstance(self.memory_limit, bool)
            or not isinstance(self.memory_limit, (int, float))
            or self.memory_limit <= 0
        ):
            raise ConfigError(
                f"avgpipe memory_limit={self.memory_limit!r}: give bytes per device (> 0) or None"
            )
        self.tolerance = float(opts.get("tolerance", 0.02))
        if ctx.optimizer is None:
            raise ConfigError(
                "avgpipe trains each parallel model with the optimizer you give: "
                "Pipeline(..., optimizer=optax.adam(1e-3)) or another optax optimizer"
            )
        self.tx = elastic_averaging(ctx.optimizer, self.N, self.alpha)
        self._fns: Dict[Any, Any] = {}
        self._calls: Dict[int, int] = {}
        self.log: List[dict] = []  # Algorithm 1's decisions: advance, seconds, temp bytes, verdict
        self._best = None  # (seconds, advance)
        self.settled = not self.auto

    # ------------------------------------------------------------------ state
    def _shardings(self):
        mesh, model = self.ctx.mesh, self.ctx.model
        rep_axis = None if self.shared is not None else PIPE  # shared: every replica on every stage device
        # each replica over its stages, and over the model axes as the model's param_specs say
        s, pre, post = param_specs(model, mesh, self.ctx.ties)
        on = lambda lead: lambda spec: NamedSharding(mesh, P(*lead, *spec))
        return (
            jax.tree.map(on((rep_axis, STAGE)), s, is_leaf=is_P),
            jax.tree.map(on((rep_axis,)), pre, is_leaf=is_P),
            jax.tree.map(on((rep_axis,)), post, is_leaf=is_P),
        )

    def init(self) -> AvgPipeState:
        N = self.N
        stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (N,) + jnp.shape(a)), t)
        # tied arrays (jaxpipe.tying): held once per replica, at their pre path
        params = jax.jit(stack, out_shardings=self._shardings())(self.ctx.ties.strip(self.ctx.model.params))
        # each replica's optimizer state lives with the replica (over 'pipe' x 'stage'), not replicated
        example = jax.eval_shape(self.ctx.optimizer.init, jax.tree.map(lambda a: a[0], params))
        pipe_sh = NamedSharding(self.ctx.mesh, P(PIPE) if self.shared is None else P())
        inner_sh = optax.tree_map_params(
            self.ctx.optimizer,
            lambda _, sh: sh,
            example,
            self._shardings(),
            transform_non_params=lambda _: pipe_sh,
        )
        opt_state = jax.jit(self.tx.init)(params)
        opt_state = opt_state._replace(inner=jax.device_put(opt_state.inner, inner_sh))
        # the reference model is laid out like the model (stage leaves over 'stage'), not gathered anywhere
        opt_state = opt_state._replace(ref=jax.device_put(opt_state.ref, self.ctx.param_shardings))
        rep = NamedSharding(self.ctx.mesh, P())
        return AvgPipeState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), rep))

    def params(self, state: AvgPipeState):
        """The reference model (the mean of the replicas), in the model's layout."""
        return self.ctx.ties.fill(state.opt_state.ref)

    # ------------------------------------------------------------------ programs
    def schedule(self, advance: int):
        return schedules.build("avgpipe", self.D, self.M, advance=advance)

    def _fn(self, advance: int, batch, state):
        """The jitted, state-donating step that advances the pipelines by ``advance``, compiled once per batch
        shapes."""
        example = jax.tree.map(lambda l: jax.ShapeDtypeStruct(np.shape(l), l.dtype), batch)
        state_sh = jax.tree.map(lambda a: a.sharding, state)
        key = (advance, jax.tree.structure(example), tuple(jax.tree.leaves(example)))
        if key not in self._fns:
            step = self._step(self._replica_grads(advance, example, state))
            rep = NamedSharding(self.ctx.mesh, P())
            names = ("loss", "grad_norm", "step") + (("pipe_losses",) if self.shared is None else ())
            self._fns[key] = guard_collectives(
                jax.jit(
                    step, donate_argnums=(0,), out_shardings=(state_sh, {k: rep for k in names + (STATUS,)})
                ),
                self.ctx.mesh,
            )
        return self._fns[key]

    def _replica_grads(self, advance: int, example, state):
        """``replica_grads(params, batch, step) -> (losses, grads)``: each pipeline's loss and gradient on
        its share of a batch of ``example``'s shapes (shared weights: the replicas' mean loss, not separated
        per replica)."""
        ctx, N, M = self.ctx, self.N, self.M
        sched = self.schedule(advance)
        stream, options = one_call(lane_plan(sched)), stream_options(sched)
        n_dp = ctx.mesh.shape[PIPE] * ctx.mesh.shape[DATA]
        microbatch = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] // (n_dp * M),) + tuple(a.shape[1:]), a.dtype),
            example,
        )
        common = dict(nan_bubbles=ctx.nan_bubbles, seed=ctx.seed, **options)
        if self.shared is None:
            # tied arrays travel inside the program; their gradients come back folded into pre's
            grad_fn = make_stream_grad_fn(ctx.model, stream, ctx.mesh, microbatch, M, replicas=True, **common)
            return lambda params, b, step: grad_fn(*params, b, step)
        model = shared_model(ctx.model, N, jax.eval_shape(to_executor, state.params))
        grad_fn = make_stream_grad_fn(model, stream, ctx.mesh, microbatch, M, **common)

        def replica_grads(params, b, step):
            total, grads = grad_fn(*to_executor(params), interleave_shares(b, N, M), step)
            return total / N, from_executor(grads)

        return replica_grads

    def _step(self, replica_grads):
        """The step: the batch's checks, each pipeline's loss and gradient, its update where the checks
        passed and every loss and gradient norm is finite, the metrics."""
        ctx, tx, checks = self.ctx, self.tx, self.ctx.checks

        def step(state: AvgPipeState, b):
            inputs, ok_in, b = checks.checked(b, ctx.mesh)
            losses, grads = replica_grads(state.params, b, state.step)
            gnorm = jax.vmap(optax.tree.norm)(grads)
            finite = jnp.all(jnp.isfinite(losses)) & jnp.all(jnp.isfinite(gnorm))
            applied = ok_in & finite  # as the synchronous runner: no update from a failed check

            def update(params, opt_state):
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            params, opt_state = gate(
                applied, update, (state.params, state.opt_state), branches_refused(ctx.mesh)
            )
            count = state.step + applied.astype(state.step.dtype)
            metrics = {
                "loss": jnp.mean(losses),
                "grad_norm": gnorm,
                "step": count,
                STATUS: checks.status(inputs, ~finite),
            }
            if self.shared is None:  # shared: one summed loss, no per-pipeline split
                metrics["pipe_losses"] = losses
            return AvgPipeState(params, opt_state, count), metrics

        return step

    in_flight = False  # every pipeline flushes each step

    def prepare(self, state, batch):
        return state

    def drain(self, state):
        return state, {}

    def loss_and_grad(self, state, batch):
        raise ConfigError(
            "avgpipe trains one replica per 'pipe' index, each with its own gradient; use step() "
            "(metrics['pipe_losses'] has each pipeline's loss)"
        )

    def lower(self, what: str, state, batch):
        if what != "step":
            raise ConfigError(
                "avgpipe: only the 'step' program exists (one gradient per replica, then the elastic average)"
            )
        batch = self.ctx.shard_batch(batch)
        return self._fn(self.advance, batch, state).lower(state, batch)

    def temp_bytes(self, state, batch, advance: int) -> int:
        # ``batch`` is already on the mesh (called from step's tuning)
        lowered = self._fn(advance, batch, state).lower(state, batch)
        return int(lowered.compile().memory_analysis().temp_size_in_bytes)

    def step(self, state: AvgPipeState, batch):
        batch = self.ctx.shard_batch(batch)
        a = self.advance
        fn = self._fn(a, batch, state)
        n = self._calls.get(a, 0)
        self._calls[a] = n + 1
        if self.settled or n == 0:  # the first call of a program compiles: not a timing
            state, m = self._call(fn, state, batch)
            return state, {**m, "advance": a}
        t0 = time.perf_counter()
        state, m = self._call(fn, state, batch)
        jax.block_until_ready(m["loss"])
        self._decide(a, time.perf_counter() - t0, state, batch)
        return state, {**m, "advance": a}

    def _call(self, fn, state, batch):
        state, m = fn(state, batch)
        m, status = pop_status(m)
        self.ctx.pending.put(status, batch, "step()")
        return state, m

    def _decide(self, a: int, seconds: float, state, batch):
        """Algorithm 1, lines 8-10: one more forward in advance while faster and memory allows."""
        entry = {"advance": a, "seconds": seconds}
        if self._best is not None and seconds > self._best[0] * (1.0 - self.tolerance):
            entry["verdict"] = f"not faster than advance={self._best[1]}: keep it"
            self.advance, self.settled = self._best[1], True
            self.log.append(entry)
            return
        self._best = (seconds, a)
        nxt = a + 1
        if nxt > max(self.M - 1, 0):
            entry["verdict"] = "all forwards already in advance (AFAB): keep it"
            self.settled = True
        elif self.memory_limit is not None and self.temp_bytes(state, batch, nxt) > self.memory_limit:
            entry["verdict"] = f"advance={nxt} would exceed memory_limit: keep {a}"
            self.settled = True
        else:
            entry["verdict"] = f"faster: try advance={nxt}"
            self.advance = nxt
        self.log.append(entry)
