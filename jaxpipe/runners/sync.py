"""The runner of the flushing schedules (gpipe, 1f1b, interleaved_1f1b, zb_h1, chimera): the one executor runs
the schedule's lane plan as a stream of one call (:func:`jaxpipe.schedules.periodic.one_call`) under the
``gradient`` policy; the step's gradient, then one optimizer update (``jaxpipe.runners``' protocol)."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..errors import ConfigError
from ..schedules.layout import exchange_perms, layout_index, stream_options
from ..runtime.gradient import make_stream_grad_fn
from ..schedules.periodic import one_call
from ..sharding import branches_refused, like_params, guard_collectives
from ..checks.on_device import STATUS, gate, pop_status
from ..runtime import chunk_state


class PipelineState(NamedTuple):
    """The train state of a synchronous pipeline.

    Attributes:
        params: ``(stage_params, pre_params, post_params)`` on the mesh.
        opt_state: the optimizer's state.
        step: the number of updates applied."""

    params: Tuple[Any, Any, Any]
    opt_state: Any
    step: jax.Array


def _mean(divisor):
    """The gradients' mean from what the program returns: sums over the micro-batches where ``divisor`` is
    set, divided where they are read -- inside the update's conditional and the norm, where the division fuses
    instead of writing the mean gradient once more.  ``loss_and_grad``'s program divides
    each micro-batch's gradient as it adds it, so its ``divisor`` is None."""
    return (lambda g: g) if divisor is None else (lambda g: jax.tree.map(lambda a: a / divisor, g))


class SyncRunner:
    in_flight = False  # a step ends with an empty pipeline

    def __init__(self, ctx):
        self.ctx = ctx
        self._layout = layout_index(ctx.schedule)
        # one stage per device in the model's order (replicas fetched inside the program), or a gather
        self._identity_layout = exchange_perms(ctx.schedule) is not None
        # where every model stage sits in exactly one device-local chunk (interleaved 1F1B), the state holds
        # the stage parameters in that order (``a[layout]``), so no step gathers weights across devices;
        # params() gives them back in the model's order
        self._stored = not self._identity_layout and sorted(self._layout.tolist()) == list(
            range(ctx.schedule.num_model_stages)
        )
        self._inverse = np.argsort(self._layout)
        # several chunks a device: each stage leaf held as one array per chunk (chunk_state: no step slices
        # the chunks out of one stack or stacks their gradients back)
        self._chunks = ctx.schedule.num_model_stages // ctx.schedule.D if self._stored else 1
        self._compiled: Dict[Any, Any] = {}
        #: the flushing schedule as a stream of one call (its lane plan: what the executor runs)
        self.stream = one_call(ctx.lane_plan)

    def init(self) -> PipelineState:
        ctx = self.ctx
        # A copy made by jit: step() donates the state, and the model's own arrays must survive that.
        order = self.stage_order()
        to_state = lambda p: (
            jax.tree.map(order[1] if order else jnp.copy, p[0]),
            *jax.tree.map(jnp.copy, p[1:]),
        )
        rep = NamedSharding(ctx.mesh, P())
        stripped = ctx.ties.strip(ctx.model.params)
        opt = ctx.optimizer if ctx.optimizer is not None else optax.identity()  # (no state: an empty tuple)

        # Optimizer state of a parameter (Adam's moments, momentum) lives with it -- its stage, its model-axis
        # shards: left to jit, it came out replicated and every device updated every stage (measured: +20% per
        # step).  Parameters, optimizer state and the step count come from one program (three compiles were a
        # third of a small test's)
        def make(p):
            q = to_state(p)
            return q, opt.init(q), jnp.zeros((), jnp.int32)

        p_shapes, o_shapes, _ = jax.eval_shape(make, stripped)
        p_sh = self._state_shardings()
        out_sh = like_params(opt, o_shapes, p_shapes, p_sh, ctx.mesh)
        params, opt_state, count = jax.jit(make, out_shardings=(p_sh, out_sh, rep))(stripped)
        return PipelineState(params, opt_state if ctx.optimizer is not None else None, count)

    def _state_shardings(self):
        """The parameters' shardings as the state holds them (a stage leaf's for each of its chunks)."""
        stage, *rest = self.ctx.param_shardings
        return (chunk_state.repeat(stage, self._chunks) if self._chunks > 1 else stage, *rest)

    def stage_order(self):
        """``(to_model, from_model)``: one stage leaf of the state in the model's order (``[stages, ...]``)
        and back -- the layouts that are not the model's own (chunks a device, a device-local order); None
        where the state holds the model's order."""
        return chunk_state.layout_order(self._layout, self._chunks) if self._stored else None

    def state_layout(self) -> Optional[dict]:
        """How the state holds the stage leaves where not in the model's order, for a checkpoint to record:
        ``{"layout": [model stage of each held position], "chunks": K}`` (:meth:`stage_order` is its
        function form); None where the state holds the model's order."""
        if not self._stored:
            return None
        return {"layout": [int(i) for i in self._layout], "chunks": int(self._chunks)}

    def prepare(self, state, batch):
        return state

    def _model_order(self, stage):
        """The state's stage parameters (or their gradients) in the model's order."""
        order = self.stage_order()
        return stage if order is None else jax.tree.map(order[0], stage, is_leaf=chunk_state.is_chunks)

    def params(self, state: PipelineState):
        return self.ctx.ties.fill((self._model_order(state.params[0]),) + tuple(state.params[1:]))

    def loss_and_grad(self, state: PipelineState, batch):
        loss, grads, status = self._fn("grad", batch)(state.params, batch, state.step)
        self.ctx.pending.put(status, batch, "loss_and_grad()")
        return loss, grads

    def step(self, state: PipelineState, batch):
        if self.ctx.optimizer is None:
            raise ConfigError("Pipeline.step needs an optimizer: Pipeline(..., optimizer=optax.adamw(1e-3))")
        state, metrics = self._fn("step", batch, state)(state, batch)
        metrics, status = pop_status(metrics)
        self.ctx.pending.put(status, batch, "step()")
        return state, metrics

    def drain(self, state):
        return state, {}

    def lower(self, what: str, state: PipelineState, batch):
        fn = self._fn(what, batch, state if what == "step" else None)
        return fn.lower(*((state.params, batch, state.step) if what == "grad" else (state, batch)))

    def _scaled(self, scale: float):
        """The model the executor runs: ``post_loss`` times ``scale`` (static loss scaling; 1: the model)."""
        if scale == 1.0:
            return self.ctx.model
        import dataclasses

        post = self.ctx.model.post_loss

        def scaled(p, x, b):
            out = post(p, x, b)
            return (out[0] * scale, out[1]) if isinstance(out, (tuple, list)) else out * scale

        return dataclasses.replace(self.ctx.model, post_loss=scaled)

    def _fn(self, what: str, batch, state: Optional[PipelineState] = None):
        """The jitted program for ``what`` (``"grad"``: ``loss_and_grad``; ``"step"``), compiled once per
        batch shapes and state shardings."""
        example = jax.tree.map(
            lambda l: jax.ShapeDtypeStruct(np.shape(l), getattr(l, "dtype", None) or np.asarray(l).dtype),
            batch,
        )
        # The step returns the state with the shardings it came in with, so the second call does not compile
        # again (XLA would otherwise pick its own output shardings for the optimizer state).
        state_sh = (
            None
            if state is None
            else jax.tree.map(
                lambda a: a.sharding if isinstance(a, jax.Array) else NamedSharding(self.ctx.mesh, P()), state
            )
        )
        key = (
            what,
            jax.tree.structure(example),
            tuple(jax.tree.leaves(example)),
            None if state_sh is None else (jax.tree.structure(state_sh), tuple(jax.tree.leaves(state_sh))),
        )
        if key not in self._compiled:
            loss_and_sums, mean = self._gradient_sums(what, example)
            if what == "grad":
                self._compiled[key] = guard_collectives(
                    jax.jit(self._grad_program(loss_and_sums, mean)), self.ctx.mesh
                )
            else:
                self._compiled[key] = self._step_program(loss_and_sums, mean, state_sh)
        return self._compiled[key]

    def _gradient_sums(self, what: str, example):
        """``(loss_and_sums(params, batch, step) -> (loss, (stage, pre, post) sums), mean)``: the executor's
        loss and gradient sums of the stream on a batch of ``example``'s shapes, in the state's layout, the
        static loss scale undone; ``mean`` divides the sums as the executor left them."""
        scale = 1.0 if self.ctx.precision is None else float(self.ctx.precision.loss_scale)
        M, n_dp = self.ctx.schedule.M, self.ctx.data_parallel  # backward halving: M units
        microbatch = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] // (n_dp * M),) + tuple(a.shape[1:]), a.dtype),
            example,
        )
        grad_fn = make_stream_grad_fn(
            self._scaled(scale),
            self.stream,
            self.ctx.mesh,
            microbatch,
            M,
            nan_bubbles=self.ctx.nan_bubbles,
            seed=self.ctx.seed,
            perms=exchange_perms(self.ctx.schedule) if self._identity_layout else None,
            # loss_and_grad: each gradient divided as it is added (no pass after the loop); the step
            # divides inside its update, where it fuses
            divide=scale != 1.0 or what == "grad",
            **stream_options(self.ctx.schedule),
        )
        layout, in_place = jnp.asarray(self._layout), self._stored or self._identity_layout
        layout_sh = self.ctx.param_shardings[0]  # P("stage", *the leaf's model-axis spec)

        def in_executor_layout(params, b, step):
            stage_p, pre_p, post_p = params
            if in_place:
                return grad_fn(stage_p, pre_p, post_p, b, step)
            # the executor's layout: device-major chunks (Chimera: each device holds a replica per
            # pipeline); the gradients of a stage's replicas are summed back
            local = jax.lax.with_sharding_constraint(jax.tree.map(lambda a: a[layout], stage_p), layout_sh)
            loss, (g_local, g_pre, g_post) = grad_fn(local, pre_p, post_p, b, step)
            g_stage = jax.tree.map(lambda a, g: jnp.zeros_like(a).at[layout].add(g), stage_p, g_local)
            return loss, (g_stage, g_pre, g_post)

        def loss_and_sums(params, b, step):
            # tied arrays travel inside the program; their gradients come back folded into pre's
            loss, sums = in_executor_layout(params, b, step)
            if scale != 1.0:  # static loss scaling: undo it before anyone sees it
                loss, sums = jax.tree.map(lambda a: (a / scale).astype(a.dtype), (loss, sums))
            return loss, sums

        return loss_and_sums, _mean(grad_fn.divisor)

    def _grad_program(self, loss_and_sums, mean):
        """``loss_and_grad``'s function: the batch's checks, the loss, the mean gradients in the model's
        order, the checks' status."""
        checks = self.ctx.checks

        def grad_in_model_order(params, b, step):
            inputs, _, b = checks.checked(b, self.ctx.mesh)
            loss, sums = loss_and_sums(params, b, step)
            g, g_pre, g_post = mean(sums)
            status = checks.status(inputs)
            return loss, (self._model_order(g), g_pre, g_post), status

        return grad_in_model_order

    def _step_program(self, loss_and_sums, mean, state_sh):
        """The jitted, state-donating step: ``loss_and_sums``' loss and gradient sums, the update gated on the
        batch's checks and a finite loss, the metrics."""
        opt, skip, checks = self.ctx.optimizer, self.ctx.skip_nonfinite, self.ctx.checks
        by_select = branches_refused(self.ctx.mesh)

        def step(state: PipelineState, b):
            inputs, ok_in, b = checks.checked(b, self.ctx.mesh)
            loss, sums = loss_and_sums(state.params, b, state.step)
            gnorm = optax.tree.norm(mean(sums))
            finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
            applied = ok_in & finite  # never an update from a bad batch or a non-finite gradient

            def update(params, opt_state):
                updates, opt_state = opt.update(mean(sums), opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            # a conditional, not a select of new and old: XLA updates the donated buffers in place
            # (jaxpipe.checks.on_device)
            params, opt_state = gate(applied, update, (state.params, state.opt_state), by_select)
            # the counter counts updates, and steps skipped on request (skip_nonfinite)
            count = state.step + (ok_in & (finite | skip)).astype(state.step.dtype)
            metrics = {
                "loss": loss,
                "grad_norm": gnorm,
                "step": count,
                STATUS: checks.status(inputs, ~finite),
            }
            if skip:
                metrics["skipped"] = ~applied
            return PipelineState(params, opt_state, count), metrics

        rep = NamedSharding(self.ctx.mesh, P())
        fn = jax.jit(
            step,
            donate_argnums=(0,),
            out_shardings=(
                state_sh,
                {
                    "loss": rep,
                    "grad_norm": rep,
                    "step": rep,
                    STATUS: rep,
                    **({"skipped": rep} if skip else {}),
                },
            ),
        )
        return guard_collectives(fn, self.ctx.mesh)
