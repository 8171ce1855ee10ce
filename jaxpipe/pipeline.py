"""``jp.Pipeline``: a model, a schedule, an optimizer and a mesh, compiled into one train step."""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from . import schedules
from .checks import check_integer_inputs, require_finite
from .errors import ConfigError
from .model import PipelineModel
from .runtime.common import DP_AXES
from .runtime.executor import make_grad_fn


class PipelineState(NamedTuple):
    """Train state: parameters ``(stage, pre, post)``, optimizer state, and the number of updates applied."""
    params: Tuple[Any, Any, Any]
    opt_state: Any
    step: jax.Array


class Pipeline:
    """Train ``model`` with ``schedule`` over ``mesh``.

    >>> pipe = jp.Pipeline(model, schedule="1f1b", num_microbatches=8, optimizer=optax.adamw(1e-3), mesh=mesh)
    >>> state = pipe.init()
    >>> state, metrics = pipe.step(state, batch)

    ``nan_bubbles=True`` is a debugging aid: buffers start as NaN and idle ticks send NaN, so anything a bubble
    leaks into the result shows up as NaN.

    Schedule options: ``chimera={"pipelines", "concat", "eager_reduce"}``, ``virtual=`` (interleaved_1f1b),
    ``zb={"max_deferred_w"}`` (zb_h1), ``avgpipe={"alpha", "advance", "memory_limit"}`` (needs a mesh with
    ``pipes=N``), ``wpipe={"recompute"}`` (the model has 2 x stage-axis partitions).  ``skip_nonfinite=True`` (synchronous
    schedules): a step whose loss or gradient norm is NaN/Inf leaves parameters and optimizer state unchanged
    (``metrics["skipped"]``).  ``check_inputs`` (default on): a batch holding NaN or Inf is refused before it
    reaches the pipeline.  ``wpipe`` and the
    asynchronous schedules never flush: use ``drain`` before reading final parameters.

    ``placement`` (flushing schedules): ``"lanes"`` (default) runs an F lane and a B lane in every tick, so a
    tick costs f + b, at up to 2D - 1 micro-batches in flight on stage 0; ``"ordered"`` runs the schedule's own
    one action per tick and keeps its memory bound (1F1B: D - d on stage d) at max(f, b) per tick
    (``jaxpipe.schedules.lanes``).  ``recompute=True`` stashes each stage's input only and recomputes the
    stage's forward in its backward (``jax.checkpoint``): less activation memory for one more forward.
    """

    def __init__(self, model: PipelineModel, schedule: str = "1f1b", num_microbatches: int = 1,
                 optimizer: Optional[optax.GradientTransformation] = None, mesh=None, *,
                 nan_bubbles: bool = False, chimera: Optional[dict] = None, virtual: Optional[int] = None,
                 zb: Optional[dict] = None, avgpipe: Optional[dict] = None, wpipe: Optional[dict] = None,
                 skip_nonfinite: bool = False, check_inputs: bool = True, placement: str = "lanes",
                 recompute: bool = False, seed: int = 0, precision=None):
        if not isinstance(model, PipelineModel):
            raise ConfigError(f"model must be a jp.PipelineModel, got {type(model).__name__}")
        if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            hint = (f"{getattr(optimizer, '__module__', '')}.{getattr(optimizer, '__name__', '')} is the function "
                    f"that builds one; call it, e.g. optax.adam(1e-3)" if callable(optimizer) else
                    "give an optax GradientTransformation, e.g. optax.adamw(1e-3)")
            raise ConfigError(f"optimizer={optimizer!r} is not an optax optimizer: {hint}")
        if schedule not in schedules.available():
            raise ConfigError(f"unknown schedule {schedule!r}; available: {', '.join(schedules.available())}")
        from .precision import Precision, with_precision
        if precision is not None and not isinstance(precision, Precision):
            raise ConfigError(f"precision={precision!r}: give jp.Precision(params='float32', compute='bfloat16')")
        self.precision = precision
        if precision is not None:
            model = with_precision(model, precision)
            if precision.loss_scale != 1 and schedules.method(schedule).updates_inside:
                raise ConfigError(f"Precision(loss_scale={precision.loss_scale}) unscales the gradients before the "
                                  f"update, which {schedule} applies inside the pipeline; use loss_scale=1 (bfloat16 "
                                  f"needs none) or a synchronous schedule")
        if mesh is None:
            from .runtime.mesh import make_mesh
            mesh = make_mesh(stages=model.num_stages)
        missing = [a for a in ("pipe", "data", "stage") if a not in mesh.axis_names]
        if missing:
            raise ConfigError(f"mesh needs axes ('pipe', 'data', 'stage'), it lacks {missing}; build it with "
                              f"jp.make_mesh(stages=..., data=...)")
        D = mesh.shape["stage"]
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
            raise ConfigError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
        from .schedules.lanes import PLACEMENTS
        if placement not in PLACEMENTS:
            raise ConfigError(f"placement={placement!r}: use 'lanes' (an F and a B lane in every tick: a tick costs "
                              f"f + b, stage 0 holds up to 2D - 1 micro-batches) or 'ordered' (the schedule's own "
                              f"one action per tick: its memory bound, e.g. D for 1F1B, at max(f, b) per tick)")
        if not isinstance(recompute, bool):
            raise ConfigError(f"recompute must be True or False, got {recompute!r}")
        self.placement, self.recompute = placement, recompute
        self.model, self.mesh, self.optimizer = model, mesh, optimizer
        self.num_microbatches = num_microbatches
        try:
            options = schedules.options_for(schedule, model.num_stages, D, chimera=chimera, virtual=virtual, zb=zb,
                                            avgpipe=avgpipe)
            self.schedule = schedules.build(schedule, num_stages=D, num_microbatches=num_microbatches, **options)
        except schedules.ScheduleError as e:
            raise ConfigError(str(e)) from None
        if self.schedule.num_model_stages != model.num_stages:
            per = self.schedule.num_model_stages // D
            raise ConfigError(
                f"the model has {model.num_stages} stages (leading axis of stage_params) but the mesh's 'stage' "
                f"axis has {D} devices and {schedule} puts {per} stage(s) on each, {self.schedule.num_model_stages} "
                f"in all; stack {self.schedule.num_model_stages} stages' parameters or use "
                f"jp.make_mesh(stages={max(model.num_stages // max(per, 1), 1)}, ...)")
        if wpipe is not None:
            unknown = set(wpipe) - {"recompute"}
            if schedule != "wpipe" or unknown:
                raise ConfigError(f"wpipe={wpipe!r}: " + (f"unknown option(s) {sorted(unknown)}; known: ['recompute']"
                                                          if unknown else f"an option of schedule 'wpipe', not {schedule!r}"))
        # Recomputation: the stash keeps each stage's input only and the backward recomputes the rest --
        # WPipe-R (§3.3) on request; Chimera's forward doubling always (it holds two micro-batches'
        # activations per forward tick, §3.5)
        if (recompute or (schedule == "wpipe" and (wpipe or {}).get("recompute")) or
                (schedule == "chimera" and options.get("concat") == "forward_doubling")):
            import dataclasses
            self.model = model = dataclasses.replace(model, stage_fn=jax.checkpoint(model.stage_fn))
        from .runtime.common import exchange_perms, layout_index
        self._layout = layout_index(self.schedule)
        # one stage per device in the model's order (replicas fetched inside the program), or a gather
        self._identity_layout = exchange_perms(self.schedule) is not None
        # where every model stage sits in exactly one device-local chunk (interleaved 1F1B), the state holds
        # the stage parameters in that order (``a[layout]``), so no step gathers weights across devices;
        # params() gives them back in the model's order
        self._stored = (not self._identity_layout and
                        sorted(self._layout.tolist()) == list(range(self.schedule.num_model_stages)))
        self._inverse = np.argsort(self._layout)
        self.nan_bubbles = nan_bubbles
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"seed={seed!r}: give an int (the stage keys of a context model derive from it)")
        self.seed = seed
        self.skip_nonfinite = bool(skip_nonfinite)
        self.check_inputs = bool(check_inputs)
        if skip_nonfinite and schedules.method(schedule).updates_inside:
            raise ConfigError(f"skip_nonfinite=True needs one update per step to skip; {schedule} updates inside "
                              f"the pipeline (per micro-batch or per pipeline replica). Use a synchronous schedule "
                              f"(gpipe, 1f1b, interleaved_1f1b, zb_h1, chimera) or stop on a non-finite loss")
        self._compiled: Dict[Any, Any] = {}
        self._async = self._avg = None
        from .tying import Ties
        self._ties = Ties(model)
        if schedule == "wpipe":
            from .wpipe_pipeline import WPipeRunner
            self._async = WPipeRunner(self)
        if schedule == "avgpipe":
            from .avgpipe_pipeline import AvgPipeRunner
            self._avg = AvgPipeRunner(self, avgpipe)
        if schedules.is_async(schedule):
            from .async_pipeline import AsyncRunner
            self._async = AsyncRunner(self)
        stage_sh = jax.tree.map(lambda _: NamedSharding(mesh, P("stage")), model.stage_params)
        rep = lambda t: jax.tree.map(lambda _: NamedSharding(mesh, P()), t)
        _, _, post_state = self._ties.strip(model.params)
        self.param_shardings = (stage_sh, rep(model.pre_params), rep(post_state))

    # ------------------------------------------------------------------ public API
    @property
    def lane_plan(self):
        """What the executor runs: the schedule placed on lanes (``jaxpipe.schedules.lanes.LanePlan``)."""
        if getattr(self, "_lane_plan", None) is None:
            from .runtime.executor import lane_plan
            self._lane_plan = lane_plan(self.schedule, self.placement)
        return self._lane_plan

    @property
    def data_parallel(self) -> int:
        return self.mesh.shape["pipe"] * self.mesh.shape["data"]

    @property
    def is_async(self) -> bool:
        """True for the no-flush schedules (pipedream, pipedream_2bw, spectrain, pipeoptim, cdp_v1, cdp_v2,
        wpipe)."""
        return self._async is not None

    def init(self):
        """Parameters placed on the mesh (stage leaves sharded over ``stage``), optimizer state, step 0.

        Asynchronous schedules return an ``AsyncState`` that also carries the pipeline's in-flight state."""
        if self._async is not None:
            return self._async.init()
        if self._avg is not None:
            return self._avg.init()
        # A copy made by jit: step() donates the state, and the model's own arrays must survive that.
        lay = jnp.asarray(self._layout)
        to_state = lambda p: (jax.tree.map(lambda a: a[lay], p[0]) if self._stored else jax.tree.map(jnp.copy, p[0]),
                              *jax.tree.map(jnp.copy, p[1:]))
        params = jax.jit(to_state, out_shardings=self.param_shardings)(self._ties.strip(self.model.params))
        rep = NamedSharding(self.mesh, P())
        opt_state = None
        if self.optimizer is not None:
            # Optimizer state shaped like a stage leaf (Adam's moments, momentum) lives with its stage: left
            # to jit, it came out replicated and every device updated every stage (measured: +20% per step).
            stage_avals = {(tuple(a.shape), a.dtype) for a in jax.tree.leaves(params[0])}
            stage_sh = NamedSharding(self.mesh, P("stage"))
            shapes = jax.eval_shape(self.optimizer.init, params)
            out_sh = jax.tree.map(lambda a: stage_sh if (tuple(a.shape), a.dtype) in stage_avals else rep, shapes)
            opt_state = jax.jit(self.optimizer.init, out_shardings=out_sh)(params)
        return PipelineState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), rep))

    def prepare(self, state, batch):
        """The state with every buffer allocated: the no-flush schedules create their in-flight pipeline state
        (``carry``) on the first step, sized from the batch; ``prepare`` does it now (a no-op otherwise), so
        the state has its final structure -- what ``jp.Checkpointer.restore`` needs as a template."""
        if self._async is not None:
            return self._async._ensure_carry(state, self.shard_batch(batch))
        return state

    def params(self, state: PipelineState):
        """``(stage_params, pre_params, post_params)`` as the model gave them (stage leaves stacked)."""
        if self._async is not None:
            return self._async.params(state)
        if self._avg is not None:
            return self._avg.params(state)
        if self._stored:
            inv = jnp.asarray(self._inverse)
            return self._ties.fill((jax.tree.map(lambda a: a[inv], state.params[0]),) + tuple(state.params[1:]))
        return self._ties.fill(state.params)

    def device_layout(self, state: PipelineState):
        """Stage parameters as the executor holds them: ``[D, chunks, ...]`` (device d, local chunk c holds
        model stage ``schedule.stage_of_chunk()[d, c]``; Chimera: two replicas per device)."""
        D = self.mesh.shape["stage"]
        lay = jnp.asarray(self._layout)
        return jax.tree.map(lambda a: a[lay].reshape((D, -1) + a.shape[1:]), self.params(state)[0])

    def loss_and_grad(self, state: PipelineState, batch):
        """Mean loss over the batch and its gradient ``(g_stage, g_pre, g_post)``; no update."""
        if self._async is not None:
            raise ConfigError(f"{self.schedule.name} is asynchronous: every stage updates its weights after each "
                              f"micro-batch, so there is no single gradient of a batch; use step(), or a "
                              f"synchronous schedule (gpipe, 1f1b) for loss_and_grad")
        if self._avg is not None:
            raise ConfigError("avgpipe trains one replica per 'pipe' index, each with its own gradient; use "
                              "step() (metrics['pipe_losses'] has each pipeline's loss)")
        self._check_values(batch)
        return self._fn("grad", batch)(state.params, batch, state.step)

    def _check_state(self, state):
        """A clear error for a state that is not this pipeline's: None, the parameters, another schedule's or
        another configuration's (optimizer, model)."""
        if state is None:
            raise ConfigError("state is None: start from state = pipe.init() (or a restored checkpoint)")
        want = self.__dict__.get("_state_example")
        if want is None:
            want = self._state_example = jax.eval_shape(self.init)
        if type(state) is not type(want):
            what = ("the model's parameters" if isinstance(state, tuple) and len(state) == 3 and
                    not hasattr(state, "_fields") else f"a {type(state).__name__}")
            raise ConfigError(f"step() got {what}; it needs this pipeline's train state ({type(want).__name__}, from "
                              f"pipe.init() or the previous step) -- a state of another schedule or runner "
                              f"does not fit {self.schedule.name!r}")
        for field in ("params", "opt_state"):
            a, b = getattr(state, field), getattr(want, field)
            sa, sb = jax.tree.structure(a), jax.tree.structure(b)
            shapes = [(tuple(np.shape(x)), tuple(np.shape(y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
            if sa != sb or any(x != y for x, y in shapes):
                raise ConfigError(
                    f"this state's {field} do not match this pipeline's ({'structure differs' if sa != sb else 'shapes differ'}): "
                    f"it was made by a Pipeline with another model, optimizer or schedule. Use this pipeline's "
                    f"pipe.init(), or restore a checkpoint written by the same configuration")

    def _check_inflight(self, state, batch):
        """A no-flush pipeline keeps earlier micro-batches in flight: every step must feed the same shapes."""
        ring = getattr(getattr(state, "carry", None), "ring", None)
        if ring is None or not isinstance(batch, dict):
            return
        per = self.data_parallel * self.num_microbatches
        for (k, r), b in zip(jax.tree_util.tree_flatten_with_path(ring)[0], jax.tree.leaves(batch)):
            mb = (np.shape(b)[0] // per,) + tuple(np.shape(b)[1:])
            if tuple(r.shape[-len(mb):]) != mb:
                raise ConfigError(
                    f"this {self.schedule.name} pipeline holds micro-batches shaped {list(r.shape[-len(mb):])} in "
                    f"flight (batch entry {jax.tree_util.keystr(k)}), and this batch gives {list(mb)}: a no-flush "
                    f"pipeline needs the same batch shapes every step. Keep the batch size, or drain() and start "
                    f"a fresh state with pipe.init()")

    def step(self, state: PipelineState, batch):
        """One optimizer step on ``batch``; returns ``(state, metrics)`` (metrics: loss, grad_norm, step).

        Asynchronous schedules feed the batch's M micro-batches into the running pipeline and run 2M ticks;
        metrics: ``loss`` (mean over the micro-batches whose loss was computed in this call, NaN if none),
        ``losses_computed``, ``microbatches_fed``, ``microbatches_finished`` (backward done on every stage).
        """
        self._check_values(batch)
        self._check_state(state)
        self._check_inflight(state, batch)
        if self._async is not None:
            return self._async.step(state, self.shard_batch(batch))
        if self._avg is not None:
            return self._avg.step(state, self.shard_batch(batch))
        if self.optimizer is None:
            raise ConfigError("Pipeline.step needs an optimizer: Pipeline(..., optimizer=optax.adamw(1e-3))")
        return self._fn("step", batch, state)(state, batch)

    def drain(self, state):
        """Asynchronous schedules: finish every micro-batch in flight (2D - 1 ticks, no new data).

        The next ``step`` refills the pipeline.  Synchronous schedules flush every step: returns the state."""
        if self._async is None:
            return state, {}
        return self._async.drain(state)

    def shard_batch(self, batch):
        """Place a global batch on the mesh (leading axis split over ``pipe`` x ``data``)."""
        self._check_batch(batch)
        from .distributed import global_batch
        return global_batch(batch, NamedSharding(self.mesh, P(DP_AXES)))

    def lower(self, what: str, state: PipelineState, batch):
        """The lowered ``"grad"`` or ``"step"`` program (for ``.compile().memory_analysis()``)."""
        if self._async is not None:
            if what != "step":
                raise ConfigError(f"{self.schedule.name} is asynchronous: only the 'step' program exists")
            return self._async.lower(state, self.shard_batch(batch))
        if self._avg is not None:
            return self._avg.lower(state, self.shard_batch(batch))
        fn = self._fn(what, batch, state if what == "step" else None)
        return fn.lower(*((state.params, batch, state.step) if what == "grad" else (state, batch)))

    # ------------------------------------------------------------------ internals
    def _check_batch(self, batch):
        if not isinstance(batch, dict):
            raise ConfigError(f"the batch is a {type(batch).__name__}; give a dict of arrays with a leading batch "
                              f"axis, e.g. {{'x': float32[n, ...], 'y': int32[n]}} (pre/post_loss read it by key)")
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ConfigError(f"the batch {batch!r} has no arrays: give a pytree of arrays with a leading batch "
                              f"axis, e.g. {{'x': float32[n, ...], 'y': int32[n]}}")
        scalars = [k for k, v in jax.tree_util.tree_flatten_with_path(batch)[0] if np.ndim(v) == 0]
        if scalars:
            raise ConfigError(f"batch entry {jax.tree_util.keystr(scalars[0])} is a scalar: every entry needs a "
                              f"leading batch axis (one row per example)")
        sizes = {int(jnp.shape(l)[0]) for l in leaves}
        if sizes == {0}:
            raise ConfigError("the batch has 0 rows: a step needs at least one example per micro-batch and replica "
                              "(an empty batch would give a NaN loss and still update the optimizer state)")
        if len(sizes) != 1:
            raise ConfigError(f"every batch leaf needs the same leading (batch) size; found {sorted(sizes)}")
        n = sizes.pop()
        units = self.schedule.M          # backward halving splits each micro-batch in two
        per = self.data_parallel * units
        if n % per:
            lo, hi = (n // per) * per, (n // per + 1) * per
            what = f"{self.num_microbatches} micro-batches" + (
                f" halved into {units} (backward_halving)" if units != self.num_microbatches else "")
            raise ConfigError(
                f"batch size {n} does not split into {self.data_parallel} data-parallel replica(s) x "
                f"{what} of equal size; use a multiple of {per} (e.g. {lo or hi} or {hi}) or change "
                f"num_microbatches")

    def _check_values(self, batch):
        self._check_keys(batch)
        if self.check_inputs:
            require_finite(batch, "Pipeline(..., check_inputs=False)")
            check_integer_inputs(self.model, batch, "Pipeline(..., check_inputs=False)")

    def _check_keys(self, batch):
        """Trace the unpipelined loss once per batch structure: a key or shape the model reads and the batch
        lacks is reported here, by name, instead of deep inside the pipelined program."""
        self._check_batch(batch)
        example = jax.tree.map(lambda l: jax.ShapeDtypeStruct(np.shape(l)[:1] and (1,) + tuple(np.shape(l)[1:]),
                                                              np.asarray(l).dtype if not hasattr(l, "dtype") else l.dtype), batch)
        key = (jax.tree.structure(example), tuple(jax.tree.leaves(example)))
        checked = self.__dict__.setdefault("_keys_checked", set())
        if key in checked:
            return
        try:
            m = self.model
            x = jax.eval_shape(m.pre, m.pre_params, example)
            w0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(jnp.shape(a))[1:], jnp.result_type(a)), m.stage_params)
            m.check_activation(x, m.stage_output_aval(w0, x, example))     # structure before the loss
            jax.eval_shape(lambda p, b: m.loss(p, b, key=jax.random.PRNGKey(0)), m.params, example)
        except KeyError as e:
            if isinstance(batch, dict) and e.args and e.args[0] in batch:
                raise                                   # not a missing batch entry: the model's own KeyError
            keys = list(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ConfigError(f"the model reads batch[{e.args[0]!r}], which the batch lacks (it has {keys}); give "
                              f"the batch that entry or a model whose pre/post_loss reads the batch's keys") from None
        checked.add(key)

    def _scaled(self, scale: float):
        """The model the executor runs: ``post_loss`` times ``scale`` (static loss scaling; 1: the model)."""
        if scale == 1.0:
            return self.model
        import dataclasses
        post = self.model.post_loss

        def scaled(p, x, b):
            out = post(p, x, b)
            return (out[0] * scale, out[1]) if isinstance(out, (tuple, list)) else out * scale
        return dataclasses.replace(self.model, post_loss=scaled)

    def _fn(self, what: str, batch, state: Optional[PipelineState] = None):
        self._check_batch(batch)
        example = jax.tree.map(lambda l: jax.ShapeDtypeStruct(np.shape(l), getattr(l, "dtype", None) or np.asarray(l).dtype), batch)
        # The step returns the state with the shardings it came in with, so the second call does not compile
        # again (XLA would otherwise pick its own output shardings for the optimizer state).
        state_sh = None if state is None else jax.tree.map(
            lambda a: a.sharding if isinstance(a, jax.Array) else NamedSharding(self.mesh, P()), state)
        key = (what, jax.tree.structure(example), tuple(jax.tree.leaves(example)),
               None if state_sh is None else (jax.tree.structure(state_sh), tuple(jax.tree.leaves(state_sh))))
        if key not in self._compiled:
            scale = 1.0 if self.precision is None else float(self.precision.loss_scale)
            grad_fn = make_grad_fn(self._scaled(scale), self.schedule, self.mesh, example,
                                   nan_bubbles=self.nan_bubbles, lanes=self.lane_plan)

            lay, identity = jnp.asarray(self._layout), self._identity_layout
            lay_sh = jax.tree.map(lambda _: NamedSharding(self.mesh, P("stage")), self.model.stage_params)

            stored, inv = self._stored, jnp.asarray(self._inverse)

            seed = self.seed

            ties = self._ties

            def lg(params, b, step):
                loss, grads = lg_full(ties.fill(params), b, step)
                if scale != 1.0:                    # static loss scaling: undo it before anyone sees it
                    loss, grads = jax.tree.map(lambda a: (a / scale).astype(a.dtype), (loss, grads))
                return loss, ties.fold(grads)       # one gradient per tied array: the sum of its uses

            def lg_full(params, b, step):
                stage_p, pre_p, post_p = params
                step_key = jax.random.fold_in(jax.random.PRNGKey(seed), step)   # model.microbatch_key's prefix
                if identity or stored:
                    return grad_fn(stage_p, pre_p, post_p, b, step_key)
                # the executor's layout: device-major chunks (Chimera: each device holds two replicas;
                # interleaved: stages d, d + D, ...); gradients of replicas are summed back per stage
                local = jax.lax.with_sharding_constraint(jax.tree.map(lambda a: a[lay], stage_p), lay_sh)
                loss, (g_local, g_pre, g_post) = grad_fn(local, pre_p, post_p, b, step_key)
                g_stage = jax.tree.map(lambda a, g: jnp.zeros_like(a).at[lay].add(g), stage_p, g_local)
                return loss, (g_stage, g_pre, g_post)

            if what == "grad":
                def grad_in_model_order(params, b, step):
                    loss, (g, g_pre, g_post) = lg(params, b, step)
                    return loss, (jax.tree.map(lambda a: a[inv], g) if stored else g, g_pre, g_post)
                self._compiled[key] = jax.jit(grad_in_model_order)
            else:
                opt, skip = self.optimizer, self.skip_nonfinite

                def step(state: PipelineState, b):
                    loss, grads = lg(state.params, b, state.step)
                    updates, opt_state = opt.update(grads, state.opt_state, state.params)
                    params = optax.apply_updates(state.params, updates)
                    gnorm = optax.tree.norm(grads)
                    metrics = {"loss": loss, "grad_norm": gnorm, "step": state.step + 1}
                    if skip:
                        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
                        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
                        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
                        metrics["skipped"] = ~ok
                    return PipelineState(params, opt_state, state.step + 1), metrics

                rep = NamedSharding(self.mesh, P())
                self._compiled[key] = jax.jit(step, donate_argnums=(0,), out_shardings=(
                    state_sh, {"loss": rep, "grad_norm": rep, "step": rep, **({"skipped": rep} if skip else {})}))
        return self._compiled[key]
