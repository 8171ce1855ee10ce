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
worker (``broadcast="balanced"``: scattered and all-gathered,
:func:`jaxpipe.runtime.collectives.balanced_broadcast`), which lands it at the start of the next tick (every
worker keeps a full replica, its stages stacked and written in place; the replicas stay bit-identical without
running the optimizer N times).  Whether a sum completes in a tick depends on the tick only, so the broadcast
is compiled into those ticks alone: no collective inside a conditional.

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

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import host_memory
from .checks.batch import require_live
from .errors import ConfigError
from .model import PipelineModel
from .optim.policies import cyclic_dp
from .runners.no_flush import AsyncState
from .runtime.collectives import balanced_broadcast
from .schedules import cyclic as cyc
from .axes import DATA, PIPE, STAGE

__all__ = ["BROADCASTS", "RULES", "CyclicDataParallel", "CyclicState", "balanced_broadcast"]

RULES = ("v1", "v2")
BROADCASTS = ("direct", "balanced")


#: the train state (the no-flush runner's): params ``(w [W, S, ...], pre [W, S, ...], post [W, S, ...])``,
#: each worker's replica per stage; the optimizer's state per worker and stage (worker N - 1's is the one
#: used); per worker and stage the previous version and the updates applied (``policies.cyclic_dp``); the
#: in-flight state per worker; the counters ``(tick, base, fed)``; the steps fed
CyclicState = AsyncState


class CyclicDataParallel:
    """Cyclic Data Parallelism over the mesh's ``data`` axis (the module docstring has the timeline and
    rules).

    Methods as :class:`Pipeline`'s: ``init``, ``step``, ``drain``, ``params``.

    Args:
        model: a :class:`PipelineModel` whose ``num_stages`` equals the mesh's ``data`` size: each worker
            holds the whole model cut into that many stages.
        optimizer: an optax transformation, run by the last worker only.
        rule: ``"v1"`` (every stage read at version ``t - 1``) or ``"v2"`` (fresh versions on a
            micro-batch's last stages).
        mesh: ``jp.make_mesh(data=N)``.
        check_inputs: NaN / Inf and integer-id checks of every batch.
        seed: the root of a context model's keys.
        nan_bubbles: idle slots filled with NaN (a test of the executor).
        broadcast: ``"direct"`` or ``"balanced"``: how the updated stage reaches the other workers.

    Raises:
        ConfigError: a model, rule, mesh or option that cannot run, naming it."""

    def __init__(
        self,
        model: PipelineModel,
        optimizer: optax.GradientTransformation,
        rule: str = "v2",
        mesh=None,
        *,
        check_inputs: bool = True,
        seed: int = 0,
        nan_bubbles: bool = False,
        broadcast: str = "direct",
    ):
        self.seed = seed
        _check_options(model, optimizer, rule, broadcast)
        self.broadcast = broadcast
        mesh = _workers_mesh(model, mesh)
        N = mesh.shape[DATA]
        # uneven stages: the executor holds a cut model's blocks padded (jaxpipe.cuts); params() drops the
        # padding
        self.user_model, model = model, model.padded()
        self.model, self.opt, self.rule, self.mesh, self.N = model, optimizer, rule, mesh, N
        self.check_inputs = bool(check_inputs)
        # a debugging aid (as ``jp.Pipeline``'s): in-flight buffers start NaN (the ring's message buffer too,
        # which idle backward lanes resend), so a bubble read into a result shows as a non-finite number
        self.nan_bubbles = bool(nan_bubbles)
        from .tying import Ties

        # tied arrays: held once, in stage 0's pre; a micro-batch reads the version its stage-0 forward read
        # (carried with its activation) and its head gradient joins that micro-batch's stage-0 gradient
        self.ties = Ties(model)
        self.ties.check_values(model)
        self.periodic = cyc.stream(N)
        self.policies = tuple(cyclic_dp(optimizer, N, j, rule) for j in range(N))
        # behind the runner protocol (jaxpipe.runners): the no-flush runner's state, set-up and drain loop
        from .runners import RunContext
        from .runners.cyclic import CyclicRunner
        from .checks.on_device import pending_for

        # reported by a later call, not kept back (jaxpipe.checks.on_device: a conditional would copy the
        # ring's stacked stages)
        checks, self._pending = pending_for(
            model, self.check_inputs, True, "CyclicDataParallel", keeps_state=False
        )
        self._runner = CyclicRunner(
            RunContext(
                model=model,
                mesh=mesh,
                schedule=self.periodic.expand(1),
                method=None,
                options={"policies": self.policies, "broadcast": broadcast},
                optimizer=optimizer,
                num_microbatches=1,
                ties=self.ties,
                nan_bubbles=self.nan_bubbles,
                seed=seed,
                checks=checks,
                pending=self._pending,
            )
        )
        host_memory.keep_freed_memory_for(mesh)  # once built: on CPU no per-step page faults (host_memory)

    # ------------------------------------------------------------------ state and programs (the runner's)
    def init(self) -> CyclicState:
        """Parameters and optimizer state placed on the workers, step 0, nothing in flight.

        Returns:
            The ``CyclicState`` to pass to :meth:`step`."""
        return self._runner.init()

    def params(self, state: CyclicState):
        """The model's parameters (worker 0's replica).

        All replicas are equal once every update has arrived, e.g. after :meth:`drain`.

        Args:
            state: a state of this CDP run.

        Returns:
            ``(stage_params, pre_params, post_params)``."""
        self.check()
        require_live(state, "params()")
        stage, *rest = self._runner.params(state)
        return (self.user_model.user_layout(stage), *rest)

    def check(self):
        """Raise the ConfigError of the last call if its on-device checks failed (``Pipeline.check``)."""
        self._pending.check()

    def _empty_carry(self, batch):
        """``(carry, activation avals)`` of an empty cycle, placed one entry per worker."""
        return self._runner.empty_carry(batch)

    def _program(self, batch):
        return self._runner._fn(batch)

    def _check_batch(self, batch):
        sizes = {int(np.shape(l)[0]) for l in jax.tree.leaves(batch)}
        if len(sizes) != 1 or next(iter(sizes)) % self.N:
            raise ConfigError(
                f"the batch's leading size {sorted(sizes)} must be one size divisible by the "
                f"{self.N} workers (one micro-batch each); use a multiple of {self.N}"
            )

    # ------------------------------------------------------------------ public
    def prepare(self, state: CyclicState, batch) -> CyclicState:
        """The state with the in-flight buffers allocated (as :meth:`Pipeline.prepare`): a checkpoint
        template.

        Args:
            state: the state :meth:`init` returned.
            batch: a batch of the shape training will use.

        Returns:
            The prepared state."""
        self._check_batch(batch)
        return self._runner.prepare(state, batch)

    def step(self, state: CyclicState, batch):
        """Feed one micro-batch per worker (the batch's rows split over the workers in order) and run 2N time
        steps.

        Args:
            state: the state of the last call; consumed.
            batch: a dict of arrays, leading axis the global batch (divisible by the workers).

        Returns:
            ``(state, metrics)``: ``loss`` (mean of the losses computed in this call; a (sum, count) loss:
            their summed values over their summed counts), ``losses_computed``, ``version_errors`` (always
            0 unless the timeline is broken)."""
        require_live(state, "step()")
        self._check_batch(batch)
        from .checks.batch import check_integer_inputs, check_integer_keys, require_finite_on_host

        check_integer_keys(self.model, batch)
        if self.check_inputs:
            opt_out = "CyclicDataParallel(..., check_inputs=False)"
            require_finite_on_host(batch, opt_out)
            check_integer_inputs(self.model, batch, opt_out)
        self._pending.poll()  # earlier calls' checks: those done, or the oldest of IN_FLIGHT
        why = self._pending.refusal(state)  # before the step consumes the state's arrays
        new, metrics = self._runner.step(state, batch)
        self._pending.track(state, new, why)
        return new, metrics

    def drain(self, state: CyclicState):
        """Run without new data until every step in flight finished and every update arrived.

        The counters are then reset, so the next step restarts the cycle.

        Args:
            state: the state of the last call; consumed.

        Returns:
            ``(state, metrics)``, the metrics of the drain's calls together."""
        self.check()
        require_live(state, "drain()")
        why = self._pending.refusal(state)
        new, metrics = self._runner.drain(state)
        self._pending.track(state, new, why)
        return new, metrics

    def check_saveable(self, state):
        """Refuse a state that may not be checkpointed (as :meth:`Pipeline.check_saveable`).

        Args:
            state: the state about to be saved.

        Raises:
            ConfigError: the last call's checks failed, or ``state`` holds a refused step's effect."""
        self._pending.require_saveable(state)


def _require_mean_loss(model, x_aval, mb):
    """The cyclic programs update from a step's micro-batch gradients averaged over the workers; a (sum,
    count) post_loss would silently become a mean of micro-batch means there: refuse it."""
    mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), mb)
    if model.reduction(x_aval, mb) == "sum":
        raise ConfigError(
            "CyclicDataParallel averages the workers' micro-batch gradients, and post_loss returns a "
            "(sum, count) pair: the normalisation would silently be the mean of micro-batch means. "
            "Return a scalar mean loss, or train with a synchronous schedule (gpipe, 1f1b, ...), "
            "which divides by the exact global count"
        )


def _check_options(model, optimizer, rule: str, broadcast: str) -> None:
    """Raises ConfigError for a ``broadcast``, ``model``, ``rule`` or ``optimizer``
    :class:`CyclicDataParallel` cannot run, naming what would."""
    if broadcast not in BROADCASTS:
        raise ConfigError(
            f"CyclicDataParallel broadcast={broadcast!r}: choose 'direct' (worker N - 1 sends the "
            f"updated stage to each other worker: (N - 1) x the stage per step from one worker) "
            f"or 'balanced' (scattered in N - 1 chunks, then all-gathered among the receivers: "
            f"no worker sends more than the stage, as in the paper's Table 1)"
        )
    if not isinstance(model, PipelineModel):
        raise ConfigError(f"model must be a jp.PipelineModel cut into N stages, got {type(model).__name__}")
    if rule not in RULES:
        raise ConfigError(
            f"CyclicDataParallel rule={rule!r}: choose 'v1' (eq. CDP-v1, one step of delay "
            f"everywhere) or 'v2' (eq. CDP-v2, fresh parameters where the stage allows)"
        )
    if optimizer is None:
        raise ConfigError(
            "CyclicDataParallel updates inside the cycle: give optimizer=optax.sgd(...) or "
            "another optax optimizer"
        )


def _workers_mesh(model, mesh):
    """``mesh`` (default: one worker a stage on the ``data`` axis), checked to hold as many workers as the
    model has stages and no stage or pipe axis.

    Raises:
        ConfigError: a mesh with a stage or pipe axis, or another number of workers than stages."""
    if mesh is None:
        from .runtime.mesh import make_mesh

        mesh = make_mesh(data=model.num_stages)
    if mesh.shape.get(STAGE, 1) != 1 or mesh.shape.get(PIPE, 1) != 1:
        raise ConfigError(
            f"CyclicDataParallel runs N workers on the 'data' axis, each with the whole model; "
            f"the mesh has stage={mesh.shape.get('stage')} pipe={mesh.shape.get('pipe')}: "
            f"use jp.make_mesh(data=N)"
        )
    N = mesh.shape[DATA]
    if model.num_stages != N:
        raise ConfigError(
            f"Cyclic Data Parallelism cuts the model into as many stages as workers (one time "
            f"step per stage, workers 2 steps apart): the model has {model.num_stages} stages "
            f"and the mesh {N} workers; build the model with {N} stages or use "
            f"jp.make_mesh(data={model.num_stages})"
        )
    return mesh
