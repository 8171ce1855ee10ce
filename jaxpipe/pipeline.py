"""``jp.Pipeline``: a model, a schedule, an optimizer and a mesh, compiled into one train step."""

from __future__ import annotations

import sys
import time
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import distributed, host_memory, schedules
from .checks.batch import (
    check_dtypes,
    check_integer_inputs,
    check_integer_keys,
    require_finite_on_host,
    refuse_traced,
    require_live,
)
from .checks import arguments
from .errors import ConfigError
from .schedules.zb_costed import SearchTooLarge
from .model import PipelineModel
from .runners.sync import PipelineState
from .axes import DATA, PIPE, STAGE

#: seconds past which the first step says it measured op costs (once per model and backend): a 2048-wide
#: MLP stage of four layers took about 30 s on two emulated CPU devices
SLOW_FIRST_STEP_S = 10.0


class Pipeline:
    """Train ``model`` with ``schedule`` over ``mesh``: one ``shard_map`` program a step.

    >>> pipe = jp.Pipeline(model, schedule="1f1b", num_microbatches=8, optimizer=optax.adamw(1e-3), mesh=mesh)
    >>> state = pipe.init()
    >>> state, metrics = pipe.step(state, batch)

    ``wpipe`` and the asynchronous schedules never flush: use :meth:`drain` before reading the final
    parameters. The per-method keywords of the unreleased 0.1.0 (``chimera=``, ``virtual=``, ``zb=``,
    ``avgpipe=``, ``wpipe=``, ``recompute=``) are refused with their new spelling (CHANGELOG.md).

    Args:
        model: a :class:`PipelineModel` (``jp.models.from_nnx`` / ``from_linen`` make one from Flax
            modules).
        schedule: a method's name (``jp.schedules.available()``; the guide's "Choosing a schedule" table)
            or a built :class:`~jaxpipe.schedules.Schedule` of a registered method (its own options are
            used).
        num_microbatches: M, micro-batches per step and data replica.
        optimizer: an optax ``GradientTransformation`` (None: :meth:`loss_and_grad` only).
        mesh: ``jp.make_mesh(stages=D, data=..., pipes=..., fsdp=..., tensor=...)`` (default: one ``stage``
            device per model stage).
        nan_bubbles: a debugging aid: buffers start as NaN and idle ticks send NaN, so anything a bubble
            leaks into the result shows up as NaN.
        skip_nonfinite: synchronous schedules: a step whose loss or gradient norm is NaN or Inf leaves the
            parameters and optimizer state unchanged (``metrics["skipped"]``).
        check_inputs: refuse a batch holding NaN or Inf, or an id out of range, before it changes anything
            (default on).
        placement: flushing schedules: ``"auto"`` (default) takes whichever plan has the smaller lockstep
            step at the op costs (``jaxpipe.schedules.lanes.fastest_placement``; ``pipe.placement`` says
            which); ``"lanes"`` runs an F lane and a B lane in every tick (a tick costs f + b, up to 2D - 1
            micro-batches in flight on stage 0); ``"ordered"`` runs the schedule's own one action per tick
            and keeps its memory bound (1F1B: D - d on stage d; ZB-H1: D); ``"ordered2"`` runs the same
            order and memory in ticks of two rounds of lanes (fewer ticks: a V's device runs its forward
            down and its forward back up in one). Either way a tick's messages move in one exchange after
            all its lanes ran.
        seed: the root of a context model's dropout keys (``jp.microbatch_key``).
        precision: a :class:`Precision` (mixed precision, loss scaling).
        options: the schedule's options, checked against the method's schema
            (``jp.schedules.method(name).options`` lists them with their defaults): chimera ``pipelines``,
            ``concat``, ``eager_reduce``; interleaved_1f1b ``virtual``; zb_h1 ``max_deferred_w``,
            ``w_from``; avgpipe ``alpha``, ``advance``, ``memory_limit``, ``tolerance`` (a mesh with
            ``pipes=N``); wpipe ``recompute`` (the model has 2 x stage-axis partitions).
        batch_axes: the mesh axes the batch is split over (default ``("data",)``; FSDP: ``("data",
            "fsdp")``).
        residuals: what a stage keeps between its forward and its backward (the stash): ``"all"`` (default)
            every residual of its vjp; ``"inputs"`` its input only, the forward recomputed in the backward
            (``jax.checkpoint``); or a ``jax.checkpoint`` policy such as
            ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` (matmul outputs kept, the rest
            recomputed).
        op_costs: what ``placement="auto"`` ranks the plans at and ZB-H1 and ZB-V choose their ticks for
            (``jaxpipe.schedules.zb_costed``): ``None`` (default: ``$JAXPIPE_OP_COSTS``, else
            ``"measure"``); ``"measure"``: at the first step (or :meth:`lower`), one stage's forward,
            backward (split: its input and weight parts) and a tick's exchange measured on this backend,
            every pipeline device busy at once, on a micro-batch of the batch's shapes
            (``jaxpipe.tune.running_costs``; kept per model and backend, so a second run measures nothing;
            a flushing schedule on two or more stage devices, a mesh without tensor or FSDP axes);
            ``"unit"``: unit costs, nothing measured; or ``(f, b, w)`` as measured (any one unit,
            ``jaxpipe.tune.microbench.layer_costs``; a fourth value: what a tick's exchange costs).
            ``pipe.op_costs`` holds those the plans were chosen for. With measured costs, two plans
            predicted within 10% of each other (``jaxpipe.tune.running_costs.TIME_WITHIN``: the model's
            error) are timed instead: each plan's :meth:`loss_and_grad` program compiled and run on the
            first batch, called in turns for up to 5 s, the faster kept (its times cached as the costs
            are). Where the schedule is then predicted slower than 1F1B's on the same devices, a warning
            says so with both predictions.
        **removed: the keywords of the unreleased 0.1.0, refused by name.

    Raises:
        ConfigError: a value that cannot run, naming it, why, and what would work (an unknown schedule or
            option, a mesh without the stages the model needs, micro-batches that do not fit the schedule,
            an optimizer that is not an optax one, ...).
        TypeError: a keyword ``Pipeline`` does not take (a removed one names its new spelling)."""

    def __init__(
        self,
        model: PipelineModel,
        schedule: str = "1f1b",
        num_microbatches: int = 1,
        optimizer: Optional[optax.GradientTransformation] = None,
        mesh=None,
        *,
        nan_bubbles: bool = False,
        skip_nonfinite: bool = False,
        check_inputs: bool = True,
        placement: str = "auto",
        seed: int = 0,
        precision=None,
        options: Optional[dict] = None,
        batch_axes=("data",),
        residuals="all",
        op_costs=None,
        **removed,
    ):
        arguments.refuse_removed(schedule, removed)
        if not isinstance(model, PipelineModel):
            raise ConfigError(f"model must be a jp.PipelineModel, got {type(model).__name__}")
        arguments.check_optimizer(optimizer)
        built, schedule, options, mesh, model = _named_schedule(schedule, options, model, mesh)
        self.user_model, model = model, model.padded()  # uneven stages: held padded (jaxpipe.cuts)
        self.precision = precision
        model = _with_precision(model, precision, schedule)
        mesh = arguments.checked_mesh(mesh, model)
        distributed.no_cached_programs_where_they_deadlock()  # a job joined with jax.distributed directly
        D = mesh.shape[STAGE]
        arguments.check_scalars(num_microbatches, placement, seed)
        residuals = arguments.check_residuals(residuals)
        self.placement, self.recompute = placement, residuals == "inputs"
        self._auto_placement, self._batch_axes = placement == "auto", batch_axes
        self.model, self.mesh, self.optimizer = model, mesh, optimizer
        self.num_microbatches = num_microbatches
        self.method = schedules.method(schedule)
        self._built, self._user_options = built, dict(options or {})
        given, self._costs_pending = _op_costs_mode(op_costs, self.method, mesh)
        self.op_costs = given  # (f, b, w[, exchange]) the plans were chosen for; None: unit costs
        self._place(given)
        arguments.check_fit(built, self.schedule, model, D, num_microbatches, schedule)
        self.model = model = _recomputing(model, self.method, self.options, residuals)
        self.nan_bubbles = nan_bubbles
        self.seed = seed
        self.skip_nonfinite = bool(skip_nonfinite)
        self.check_inputs = bool(check_inputs)
        if skip_nonfinite and self.method.updates_inside:
            raise ConfigError(
                f"skip_nonfinite=True needs one update per step to skip; {schedule} updates inside "
                f"the pipeline (per micro-batch or per pipeline replica). Use a synchronous schedule "
                f"(gpipe, 1f1b, interleaved_1f1b, zb_h1, chimera) or stop on a non-finite loss"
            )
        self._build_runner()
        if given is not None:
            self._warn_if_slower((tuple(given) + (0.0,))[:4])
        host_memory.keep_freed_memory_for(mesh)  # once built: on CPU no per-step page faults (host_memory)

    def _place(self, costs) -> None:
        """The schedule built (zero-bubble's ticks chosen for ``costs`` where given, and where the search
        serves the pipeline's size: else the unit-time order) and its placement (``"auto"``: the plan with
        the smallest lockstep step at ``costs``, or at unit costs)."""
        options = dict(self._user_options)
        searched = costs is not None and "costs" in self.method.options and not options.get("costs")
        if searched:
            options["costs"] = tuple(costs)  # zb_h1, zb_v: ticks for the costs
        try:
            self._build_schedule(options)
        except SearchTooLarge:
            if not searched:
                raise
            self._build_schedule(self._user_options)  # past the search's size: the unit-time order
        if self._auto_placement:  # the plan with the smaller lockstep step (jaxpipe.schedules.lanes)
            from .schedules.lanes import fastest_placement

            self.placement = fastest_placement(self.schedule, costs) if self.method.flushes else "lanes"

    def _build_schedule(self, options) -> None:
        """``self.options`` and ``self.schedule`` for the options ``options`` (a ConfigError where they do
        not fit; :class:`~jaxpipe.schedules.zb_costed.SearchTooLarge` as it is)."""
        D, built = self.mesh.shape[STAGE], self._built
        try:
            self.options = self.method.resolve(dict(options), self.model.num_stages, D)
            self.schedule = built or schedules.build(
                self.method.name,
                num_stages=D,
                num_microbatches=self.num_microbatches,
                **self.method.builder_options(self.options),
            )
        except SearchTooLarge:
            raise
        except schedules.ScheduleError as e:
            raise ConfigError(str(e)) from None

    def _build_runner(self) -> None:
        from .runners import RunContext, make_runner
        from .tying import Ties
        from .sharding import check_model_axes_used, param_shardings

        model, mesh = self.model, self.mesh
        ties = Ties(model)
        ties.check_values(model)
        self.param_shardings = param_shardings(model, mesh, ties)
        self.batch_axes = check_model_axes_used(model, mesh, self._batch_axes)
        checks, pending = _step_checks(self, model)
        self.context = RunContext(
            model=model,
            mesh=mesh,
            schedule=self.schedule,
            method=self.method,
            options=self.options,
            optimizer=self.optimizer,
            num_microbatches=self.num_microbatches,
            ties=ties,
            nan_bubbles=self.nan_bubbles,
            seed=self.seed,
            precision=self.precision,
            skip_nonfinite=self.skip_nonfinite,
            placement=self.placement,
            param_shardings=self.param_shardings,
            batch_axes=self.batch_axes,
            checks=checks,
            pending=pending,
        )
        self._runner = make_runner(self.context)  # which one: the method's registry entry

    def _measure_costs(self, batch, state) -> None:
        """At the first step without hand-given ``op_costs``: one stage's F, B, W and a tick's exchange
        measured on this backend for ``batch``'s micro-batch (:mod:`jaxpipe.tune.running_costs`, cached per
        model and backend), the plans chosen again for them -- two plans predicted too close to rank are
        timed on ``state`` and ``batch`` (:meth:`_time_plans`) -- and a warning where the schedule is
        predicted slower than 1F1B's."""
        if not self._costs_pending:
            return
        self._costs_pending = False
        started = time.perf_counter()
        self._measure_and_place(batch, state)
        took = time.perf_counter() - started
        if took > SLOW_FIRST_STEP_S and jax.process_index() == 0:
            from .tune.measure_cache import default_path

            kept = default_path()
            print(
                f"jaxpipe: the first step took {took:.0f} s to measure this backend's op costs and to place "
                f"the {self.schedule.name} plan for them; they are kept "
                + (f"in {kept} for later runs" if kept else "for this process's later pipelines")
                + " (Pipeline(op_costs=(f, b, w)) skips the measurement)",
                file=sys.stderr,
                flush=True,
            )

    def _measure_and_place(self, batch, state) -> None:
        """:meth:`_measure_costs`' work: measure, place, time close plans, warn."""
        from .tune import running_costs

        mb = running_costs.microbatch_like(batch, self.data_parallel * self.num_microbatches)
        devices, split = self.mesh.shape[STAGE], self.schedule.has_w()
        copies = running_costs.held_copies(self.schedule)  # Chimera: its stage and a replica a device
        try:
            # 1F1B's stage, for the warning against it (the same costs where a device holds one stage)
            one_stage = running_costs.measured(self.model, mb, devices, split)
            measured = one_stage
            if copies > 1:  # priced by how often the device's plan switches between the stages it holds
                over = running_costs.measured(self.model, mb, devices, split, copies=copies)
                rate = running_costs.copy_switch_rate(self.schedule)
                measured = running_costs.held_stage_costs(one_stage, over, rate)
            layout = running_costs.layout_seconds(self.model, self.schedule)  # Chimera's replicas moved
        except Exception as e:  # noqa: BLE001 -- a model the probe cannot run alone: the unit-cost plan stays
            warnings.warn(
                f"jaxpipe: could not measure op costs on this backend ({type(e).__name__}: {e}); the "
                f"{self.schedule.name} plan stays ranked at unit costs (give Pipeline(op_costs=(f, b, w)) "
                f"to choose for your costs, or op_costs='unit' to skip the measurement)",
                stacklevel=3,
            )
            return
        self.op_costs = measured.op_costs()
        before = (self.schedule, self.placement)
        self._place(self.op_costs)
        if (
            self._auto_placement
            and self.method.flushes
            and running_costs.plans_too_close(self.schedule, self.op_costs)
        ):
            self._timed_placement(mb, state, batch)
        if (self.schedule, self.placement) != before:
            self.context, self._runner = self._runner_for(self.placement)
        self._warn_if_slower(self.op_costs, layout, one_stage.op_costs())

    def _timed_placement(self, mb, state, batch) -> None:
        """``self.placement``: the faster of the two plans as timed (:meth:`_time_plans`); where they cannot
        be timed, the one the model ranked first stays, and a warning says why."""
        from .tune import running_costs

        try:
            self.placement = running_costs.timed_placement(
                self.model, mb, self.schedule, lambda: self._time_plans(state, batch)
            )
        except Exception as e:  # noqa: BLE001 -- timing is a refinement: the model's choice still runs
            warnings.warn(
                f"jaxpipe: could not time the {self.schedule.name} schedule's two plans, predicted too close "
                f"to rank ({type(e).__name__}: {e}); its {self.placement} plan, ranked first by the model, "
                f"stays (give placement='ordered' or 'lanes' to choose)",
                stacklevel=4,
            )

    def _runner_for(self, placement: str):
        """``(context, runner)`` of this pipeline's schedule run in ``placement``'s plan."""
        import dataclasses

        from .runners import make_runner

        context = dataclasses.replace(
            self.context, schedule=self.schedule, options=self.options, placement=placement, _lane_plan=None
        )
        return context, make_runner(context)

    def _time_plans(self, state, batch, calls: Optional[int] = None) -> list:
        """Seconds of :meth:`loss_and_grad`'s program in the ordered plan and in the lanes plan, on ``state``
        and ``batch``: each compiled and run once, then timed in turns ``calls`` times (default: as many as
        fit :data:`~jaxpipe.tune.running_costs.PLAN_TIMING_BUDGET_S`, 3 to 15:
        :func:`~jaxpipe.tune.running_costs.plan_timing_rounds`), the least call each (a slow phase of the
        machine hits both alike; a loaded machine's slow calls drop out)."""
        import time

        from .tune.running_costs import plan_timing_rounds

        programs, first = [], []
        for placement in ("ordered", "lanes"):
            _, runner = self._runner_for(placement)
            compiled = runner.lower("grad", state, batch).compile()
            args = (state.params, batch, state.step)  # (as the runner's own call takes them)
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            first.append(time.perf_counter() - t0)
            programs.append((compiled, args))
        best = [float("inf")] * len(programs)
        for _ in range(plan_timing_rounds(sum(first)) if calls is None else calls):
            for i, (compiled, args) in enumerate(programs):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(*args))
                best[i] = min(best[i], time.perf_counter() - t0)
        return best

    def _warn_if_slower(self, costs, layout: float = 0.0, ref_costs=None) -> None:
        """Once: a warning where the schedule's plan is predicted slower than 1F1B's at ``costs`` (and
        ``layout`` seconds a step of Chimera's replicas moved, where measured; 1F1B's at ``ref_costs``, its
        one stage's, where given)."""
        if not self.method.flushes:
            return
        from .tune.running_costs import against_1f1b

        why = against_1f1b(self.schedule, self.placement, costs, layout, ref_costs)
        if why:
            warnings.warn(why, stacklevel=4)

    # ------------------------------------------------------------------ public API
    @property
    def lane_plan(self):
        """What the executor runs: the schedule placed on lanes (``jaxpipe.schedules.lanes.LanePlan``)."""
        return self.context.lane_plan

    @property
    def data_parallel(self) -> int:
        return self.context.data_parallel

    @property
    def is_async(self) -> bool:
        """True where the train state carries micro-batches between steps (pipedream, pipedream_2bw,
        spectrain, pipeoptim, cdp_v1, cdp_v2, wpipe): ``drain`` before reading final parameters."""
        return self._runner.in_flight

    def init(self):
        """Parameters placed on the mesh, the optimizer state and step 0.

        Stage leaves are sharded over ``stage``; no-flush schedules' state also carries the pipeline's
        in-flight state (sized at the first ``step``, or by :meth:`prepare`).

        Returns:
            A :class:`PipelineState` (no-flush schedules: their runner's state) to pass to :meth:`step`."""
        return self._runner.init()

    def prepare(self, state, batch):
        """The state with every buffer allocated, as the first step would leave it.

        The no-flush schedules create their in-flight pipeline state (``carry``) on the first step, sized
        from the batch; ``prepare`` does it now (a no-op otherwise), so the state has its final structure
        -- what :meth:`jaxpipe.Checkpointer.restore` needs as a template.

        Args:
            state: the state :meth:`init` returned.
            batch: a batch of the shape training will use.

        Returns:
            The state with its in-flight buffers allocated."""
        self._check_batch(batch)
        return self._runner.prepare(state, batch)

    def params(self, state):
        """The trained parameters, in the model's own layout.

        Reads every pending on-device check first (:meth:`check`).

        Args:
            state: a state of this pipeline.

        Returns:
            ``(stage_params, pre_params, post_params)`` as the model gave them (stage leaves stacked on a
            leading axis of size ``num_stages``; a model of blocks: ``[n_blocks, ...]``)."""
        self.check()
        require_live(state, "params()")
        return self._user_layout(self._runner.params(state))

    def _user_layout(self, params):
        """Stage parameters (or gradients) as the user's model holds them: a cut model's padding dropped."""
        stage, *rest = params
        return (self.user_model.user_layout(stage), *rest)

    def check(self):
        """Raise the error of a call whose on-device checks failed, waiting for every call dispatched so far.

        The checks: a batch with NaN or Inf or an id out of range, a non-finite loss. ``drain``, ``params``
        and ``Checkpointer.save`` call this first; ``step`` and ``loss_and_grad`` read the calls already
        done and wait only for the oldest of ``jaxpipe.checks.on_device.IN_FLIGHT`` unread ones (the host
        runs ahead of the device), so a failure is reported at the latest two calls later, naming its call
        (``step() #7``). A step that failed changed nothing, and the calls since ran on the state before
        it.

        Raises:
            ConfigError: the first failed call, with what failed and the likely cause."""
        self.context.pending.check()

    def check_saveable(self, state):
        """Refuse a state that may not be checkpointed.

        Args:
            state: the state about to be saved.

        Raises:
            ConfigError: the last call's checks failed, or ``state`` holds (or derives from) the effect of
                a refused step of a method whose state is not kept back
                (:class:`jaxpipe.checks.on_device.PendingStatus`)."""
        self.context.pending.require_saveable(state)

    def device_layout(self, state):
        """Stage parameters as the executor holds them.

        Args:
            state: a state of this pipeline.

        Returns:
            The stage leaves as ``[D, chunks, ...]``: device ``d``'s local chunk ``c`` holds model stage
            ``schedule.stage_of_chunk()[d, c]`` (Chimera: two replicas per device)."""
        from .schedules.layout import layout_index

        D = self.mesh.shape[STAGE]
        lay = jnp.asarray(layout_index(self.schedule))
        self.check()
        return jax.tree.map(lambda a: a[lay].reshape((D, -1) + a.shape[1:]), self._runner.params(state)[0])

    def loss_and_grad(self, state, batch):
        """The batch's loss and its gradient, without an update.

        Args:
            state: a state of this pipeline (not consumed).
            batch: a dict of arrays whose leading axis is the global batch (divisible by data x
                micro-batches).

        Returns:
            ``(loss, (g_stage, g_pre, g_post))``: the mean loss over the batch (a ``(sum, count)`` model:
            the masked mean) and its gradient in the layout of :meth:`params`.

        Raises:
            ConfigError: the batch does not fit the model (a missing field, a wrong shape, NaN or Inf, an
                id out of range), here or, for a check made on the device, at a later call."""
        require_live(state, "loss_and_grad()")
        self._check_values(batch)
        self.context.pending.poll()
        self._measure_costs(batch, state)
        loss, grads = self._runner.loss_and_grad(state, batch)
        return loss, self._user_layout(grads)

    def _check_state(self, state):
        """A clear error for a state that is not this pipeline's: None, the parameters, another schedule's or
        another configuration's (optimizer, model)."""
        if state is None:
            raise ConfigError("state is None: start from state = pipe.init() (or a restored checkpoint)")
        want = self.__dict__.get("_state_example")
        if want is None:
            want = self._state_example = jax.eval_shape(self.init)
        if type(state) is not type(want):
            what = (
                "the model's parameters"
                if isinstance(state, tuple) and len(state) == 3 and not hasattr(state, "_fields")
                else f"a {type(state).__name__}"
            )
            raise ConfigError(
                f"step() got {what}; it needs this pipeline's train state ({type(want).__name__}, from "
                f"pipe.init() or the previous step) -- a state of another schedule or runner "
                f"does not fit {self.schedule.name!r}"
            )
        fields = getattr(
            want, "_fields", ("params", "opt_state")
        )  # a no-flush state: its stashes and carry too
        for field in fields:
            a, b = getattr(state, field), getattr(want, field)
            if field == "carry" and (a is None or b is None):  # allocated by the first step (or prepare)
                continue
            sa, sb = jax.tree.structure(a), jax.tree.structure(b)
            shapes = [
                (tuple(np.shape(x)), tuple(np.shape(y)))
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
            ]
            if sa != sb or any(x != y for x, y in shapes):
                raise ConfigError(
                    f"this state's {field} do not match this pipeline's "
                    f"({'structure differs' if sa != sb else 'shapes differ'}): "
                    "it was made by a Pipeline with another model, optimizer or schedule (a no-flush state "
                    "holds "
                    "its method's weight versions and in-flight pipeline). Use this pipeline's "
                    "pipe.init(), or "
                    f"restore a checkpoint written by the same configuration"
                )

    def _check_inflight(self, state, batch):
        """A no-flush pipeline keeps earlier micro-batches in flight: every step must feed the same shapes."""
        ring = getattr(getattr(state, "carry", None), "ring", None)
        if ring is None or not isinstance(batch, dict):
            return
        per = self.data_parallel * self.num_microbatches
        for (k, r), b in zip(jax.tree_util.tree_flatten_with_path(ring)[0], jax.tree.leaves(batch)):
            mb = (np.shape(b)[0] // per,) + tuple(np.shape(b)[1:])
            if tuple(r.shape[-len(mb) :]) != mb:
                raise ConfigError(
                    f"this {self.schedule.name} pipeline holds micro-batches shaped "
                    f"{list(r.shape[-len(mb) :])} in "
                    f"flight (batch entry {jax.tree_util.keystr(k)}), and this batch gives {list(mb)}: a "
                    "no-flush "
                    "pipeline needs the same batch shapes every step. Keep the batch size, or drain() and "
                    "start "
                    f"a fresh state with pipe.init()"
                )

    def step(self, state: PipelineState, batch):
        """One optimizer step on ``batch``.

        Synchronous schedules flush: the gradient of the whole batch, then one update. Asynchronous
        schedules feed the batch's M micro-batches into the running pipeline and run 2M ticks. The state
        given is donated: keep the one returned.

        Args:
            state: the state :meth:`init` (or the previous step) returned; consumed.
            batch: a dict of arrays whose leading axis is the global batch (divisible by data x
                micro-batches).

        Returns:
            ``(state, metrics)``. Synchronous metrics: ``loss``, ``grad_norm``, ``step`` (and ``skipped``
            with ``skip_nonfinite=True``). Asynchronous metrics: ``loss`` (mean over the micro-batches
            whose loss was computed in this call, NaN if none), ``losses_computed``, ``microbatches_fed``,
            ``microbatches_finished`` (backward done on every stage).

        Raises:
            ConfigError: the batch is refused (NaN or Inf, an id out of range, a wrong shape) -- a check
                made on the device is raised by a later call, naming the step (``step() #7``); the refused
                step changed nothing."""
        require_live(state, "step()")
        self._check_values(batch)
        self._check_state(state)
        self._check_inflight(state, batch)
        self.context.pending.poll()  # earlier calls' on-device checks: those done, or the oldest of IN_FLIGHT
        why = self.context.pending.refusal(state)  # before the step consumes the state's arrays
        self._measure_costs(batch, state)
        new, metrics = self._runner.step(state, batch)
        self.context.pending.track(state, new, why)
        return new, metrics

    def drain(self, state):
        """Finish every micro-batch in flight (no-flush schedules: 2D - 1 ticks, no new data).

        The next ``step`` refills the pipeline. Synchronous schedules flush every step: the state comes
        back as it is.

        Args:
            state: the state of the last step; consumed.

        Returns:
            ``(state, metrics)`` after the drain."""
        self.check()
        require_live(state, "drain()")
        why = self.context.pending.refusal(state)
        new, metrics = self._runner.drain(state)
        self.context.pending.track(state, new, why)
        return new, metrics

    def shard_batch(self, batch):
        """Place a global batch on the mesh.

        Args:
            batch: a dict of host or device arrays, leading axis the global batch.

        Returns:
            The batch as global arrays, the leading axis split over ``pipe`` x the batch axes (each process
            copies in its own rows)."""
        self._check_batch(batch)
        return self.context.shard_batch(batch)

    def lower(self, what: str, state, batch):
        """The lowered program of a call, for XLA's analyses.

        Args:
            what: ``"grad"`` (:meth:`loss_and_grad`'s program; ``"loss_and_grad"`` names it too) or
                ``"step"``.
            state: a state of this pipeline.
            batch: a batch of the shape training uses.

        Returns:
            A ``jax.stages.Lowered``; ``.compile().memory_analysis()`` and ``.cost_analysis()`` give its
            temp and bytes.

        Raises:
            ConfigError: ``what`` names no program of a pipeline."""
        program = _PROGRAMS.get(what)
        if program is None:
            raise ConfigError(
                f"lower(what={what!r}): a pipeline has two programs, 'grad' (loss_and_grad's, also "
                f"named 'loss_and_grad') and 'step'"
            )
        self._check_batch(batch)
        self._measure_costs(batch, state)
        return self._runner.lower(program, state, batch)

    # ------------------------------------------------------------------ internals
    def _check_batch(self, batch):
        if not isinstance(batch, dict):
            raise ConfigError(
                f"the batch is a {type(batch).__name__}; give a dict of arrays with a leading batch "
                f"axis, e.g. {{'x': float32[n, ...], 'y': int32[n]}} (pre/post_loss read it by key)"
            )
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ConfigError(
                f"the batch {batch!r} has no arrays: give a pytree of arrays with a leading batch "
                f"axis, e.g. {{'x': float32[n, ...], 'y': int32[n]}}"
            )
        check_dtypes(batch)
        scalars = [k for k, v in jax.tree_util.tree_flatten_with_path(batch)[0] if np.ndim(v) == 0]
        if scalars:
            raise ConfigError(
                f"batch entry {jax.tree_util.keystr(scalars[0])} is a scalar: every entry needs a "
                f"leading batch axis (one row per example)"
            )
        sizes = {int(jnp.shape(l)[0]) for l in leaves}
        if sizes == {0}:
            raise ConfigError(
                "the batch has 0 rows: a step needs at least one example per micro-batch and replica "
                "(an empty batch would give a NaN loss and still update the optimizer state)"
            )
        if len(sizes) != 1:
            raise ConfigError(f"every batch leaf needs the same leading (batch) size; found {sorted(sizes)}")
        n = sizes.pop()
        units = self.schedule.M  # backward halving splits each micro-batch in two
        per = self.data_parallel * units
        if n % per:
            lo, hi = (n // per) * per, (n // per + 1) * per
            what = f"{self.num_microbatches} micro-batches" + (
                f" halved into {units} (backward_halving)" if units != self.num_microbatches else ""
            )
            raise ConfigError(
                f"batch size {n} does not split into {self.data_parallel} data-parallel replica(s) x "
                f"{what} of equal size; use a multiple of {per} (e.g. {lo or hi} or {hi}) or change "
                f"num_microbatches"
            )

    def _check_values(self, batch):
        """What is known without reading the device: keys, dtypes, float64 beyond float32.  The values (NaN,
        Inf, ids in range) are checked inside the step's program (``jaxpipe.checks.on_device``)."""
        self._check_keys(batch)
        check_integer_keys(self.model, batch)
        if self.check_inputs:
            require_finite_on_host(batch, "Pipeline(..., check_inputs=False)")
            check_integer_inputs(self.model, batch, "Pipeline(..., check_inputs=False)")

    def _check_keys(self, batch):
        """Trace the unpipelined loss once per batch structure: a key or shape the model reads and the batch
        lacks is reported here, by name, instead of deep inside the pipelined program.  A batch of the
        structure, shapes and dtypes of one that passed is not checked again (every check here reads only
        those: 60-85 us a step of Python where every step's batch is alike)."""
        leaves, treedef = jax.tree.flatten(batch)
        refuse_traced(leaves, "Pipeline.step() or loss_and_grad()", "batch")
        signature = (
            type(batch),
            treedef,
            tuple((np.shape(l), l.dtype if hasattr(l, "dtype") else np.asarray(l).dtype) for l in leaves),
        )
        passed = self.__dict__.setdefault("_batches_passed", set())
        if signature in passed:
            return
        self._check_batch(batch)
        example = jax.tree.map(
            lambda l: jax.ShapeDtypeStruct(
                np.shape(l)[:1] and (1,) + tuple(np.shape(l)[1:]),
                np.asarray(l).dtype if not hasattr(l, "dtype") else l.dtype,
            ),
            batch,
        )
        key = (jax.tree.structure(example), tuple(jax.tree.leaves(example)))
        checked = self.__dict__.setdefault("_keys_checked", set())
        if key in checked:
            passed.add(signature)
            return
        try:
            m = self.model
            x = jax.eval_shape(m.pre, m.pre_params, example)
            w0 = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(tuple(jnp.shape(a))[1:], jnp.result_type(a)), m.stage_params
            )
            m.check_activation(x, m.stage_output_aval(w0, x, example))  # structure before the loss
            jax.eval_shape(lambda p, b: m.loss(p, b, key=jax.random.PRNGKey(0)), m.params, example)
        except KeyError as e:
            if isinstance(batch, dict) and e.args and e.args[0] in batch:
                if self.model.context and e.args[0] not in self.model.stage_inputs:
                    raise ConfigError(
                        f"the model reads {e.args[0]!r}, which the batch has but the stages do not get: a "
                        "stage sees "
                        f"the batch fields named in PipelineModel(stage_inputs=...) (now "
                        f"{list(self.model.stage_inputs)}) as ctx.inputs; add {e.args[0]!r} there"
                    ) from None
                raise  # not a missing batch entry: the model's own KeyError
            keys = list(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ConfigError(
                f"the model reads batch[{e.args[0]!r}], which the batch lacks (it has {keys}); give "
                f"the batch that entry or a model whose pre/post_loss reads the batch's keys"
            ) from None
        checked.add(key)
        passed.add(signature)


#: the programs :meth:`Pipeline.lower` lowers, by the names it takes
_PROGRAMS = {"grad": "grad", "loss_and_grad": "grad", "step": "step"}


def _named_schedule(schedule, options, model, mesh):
    """``(built, name, options, mesh, model)``: a built Schedule's own name and options (a user's own:
    ``USER_SCHEDULE``), or a name checked against the registry, the model re-cut for it."""
    built = schedule if isinstance(schedule, schedules.Schedule) else None
    if built is not None:
        schedule = built.name
        if options:
            raise ConfigError("options= goes with a schedule name; a built Schedule carries its own options")
        options = dict(built.options)
        if schedule not in schedules.available():  # a user's own (jp.schedules.from_actions / from_csv)
            schedule = schedules.USER_SCHEDULE
            options = {"chunks": built.num_model_stages // built.D}
    elif schedule in schedules.METHODS and schedules.method(schedule).builder is None:
        raise ConfigError(
            f"schedule={schedule!r} is a schedule of your own: build it with "
            "jp.schedules.from_actions(...) or jp.schedules.from_csv(path) and pass the Schedule"
        )
    if schedule not in schedules.METHODS:
        raise ConfigError(f"unknown schedule {schedule!r}; available: {', '.join(schedules.available())}")
    options = arguments.checked_options(options)
    if built is None:
        mesh, model = _recut_for(schedule, options, model, arguments.checked_mesh(mesh, model))
    return built, schedule, options, mesh, model


def _with_precision(model, precision, schedule: str):
    """``model`` in ``precision`` (a :class:`~jaxpipe.precision.Precision`), or itself for None."""
    from .precision import Precision, with_precision

    if precision is None:
        return model
    if not isinstance(precision, Precision):
        raise ConfigError(f"precision={precision!r}: give jp.Precision(params='float32', compute='bfloat16')")
    if precision.loss_scale != 1 and schedules.method(schedule).updates_inside:
        raise ConfigError(
            f"Precision(loss_scale={precision.loss_scale}) unscales the gradients before the "
            f"update, which {schedule} applies inside the pipeline; use loss_scale=1 (bfloat16 "
            f"needs none) or a synchronous schedule"
        )
    return with_precision(model, precision)


def _op_costs_mode(op_costs, method, mesh):
    """``(costs, measure)``: hand-given ``(f, b, w[, exchange])`` (or None), and whether the first step
    measures them (``op_costs=None``: ``$JAXPIPE_OP_COSTS``, default ``"measure"``; a flushing schedule
    over two or more stage devices, on a mesh of the stage and data axes alone)."""
    import os

    from .tune.running_costs import ENV

    if op_costs is None:
        op_costs = os.environ.get(ENV, "measure") or "measure"
        where = f"${ENV}={op_costs!r}"
    else:
        where = f"op_costs={op_costs!r}"
    if isinstance(op_costs, str):
        if op_costs not in ("measure", "unit"):
            raise ConfigError(
                f"{where}: give 'measure' (at the first step, on this backend), 'unit' (plans ranked at "
                f"unit costs) or (f, b, w[, exchange]) as measured"
            )
        stage_only = all(n == 1 for a, n in mesh.shape.items() if a not in (STAGE, DATA, PIPE))
        return None, op_costs == "measure" and method.flushes and mesh.shape[STAGE] > 1 and stage_only
    return arguments.checked_costs(op_costs), False


def _recut_for(schedule: str, options: dict, model, mesh):
    """The model as written, cut into the chunks the schedule needs: a schedule holding v > 1 model stages per
    device (interleaved 1F1B, the V-schedules) given a model of one stage per device whose ``recut`` can make
    v x D stages (the Flax adapters' models); otherwise the model unchanged (the schedule's own checks say
    what to change).  Returns ``(mesh, model)``; ``mesh`` is the checked mesh (default: one device per model
    stage as given)."""
    from .axes import STAGE

    if (model.recut is None and model.cut is None) or mesh is None or STAGE not in getattr(mesh, "shape", {}):
        return mesh, model
    D = mesh.shape[STAGE]
    v = schedules.method(schedule).stages_per_device({"virtual": (options or {}).get("virtual")})
    if v <= 1 or model.num_stages != D:
        return mesh, model
    try:
        return mesh, model.chunks(v * D)
    except ConfigError as e:
        raise ConfigError(
            f"{schedule} holds {v} model stages per device, {v * D} in all, but this model's "
            f"blocks cannot be cut so: {e}"
        ) from None


def _step_checks(pipe, model):
    """``(StepChecks, PendingStatus)`` of ``pipe``: a no-flush method of several chunks per device (WPipe), or
    on a mesh whose conditionals may not hold collectives (model axes on XLA CPU), reports a bad batch but is
    not kept back -- the conditional around its program cost +51% temp (BUILD_NOTES, "The no-flush
    methods, WPipe, CDP, AvgPipe")."""
    from .sharding import branches_refused
    from .checks.on_device import pending_for

    keeps = not (
        pipe.method.updates_inside
        and (pipe.method.stages_per_device(pipe.options) > 1 or branches_refused(pipe.mesh))
    )
    return pending_for(model, pipe.check_inputs, not pipe.skip_nonfinite, "Pipeline", keeps)


def _recomputing(model, method, options, residuals):
    """The model whose stage keeps what ``residuals`` says between its forward and its backward.  The stash
    keeps each stage's input only and the backward recomputes the rest -- on request, or where the method says
    (WPipe-R §3.3 by option; Chimera's forward doubling always: it holds two micro-batches' activations per
    forward tick, §3.5).  A method whose F and B read different weights recomputes on F's."""
    import dataclasses

    if residuals == "all" and method.recompute(options):
        residuals = "inputs"
    if residuals == "all":
        return model
    if method.reads_differ:
        from .runtime.residuals import RecomputedAtForwardWeights

        return dataclasses.replace(model, stage_fn=RecomputedAtForwardWeights(model.stage_fn))
    policy = None if residuals == "inputs" else residuals
    return dataclasses.replace(model, stage_fn=jax.checkpoint(model.stage_fn, policy=policy))
