"""Runners: what turns a configured pipeline into compiled programs and a train state.

Every runner implements one small protocol and receives a plain :class:`RunContext` (never the
``Pipeline``)::

    init() -> state                         prepare(state, batch) -> state (every buffer allocated)
    step(state, batch) -> (state, metrics)  drain(state) -> (state, metrics)
    params(state) -> (stage, pre, post)     loss_and_grad(state, batch) -> (loss, grads)
    lower(what, state, batch) -> jax.stages.Lowered

and says whether its state carries micro-batches between calls (``in_flight``).  Which runner runs a method
is data: the method's registry entry names its family (``jaxpipe.schedules.registry.Method.runner``), and
:data:`RUNNERS` holds the family's class.  ``jp.Pipeline``
checks the user's input and delegates.

* ``sync`` (:mod:`.sync`): the flushing schedules -- the one executor's gradient of the lane plan (a stream of
  one call), one optimizer update;
* ``async`` (:mod:`.no_flush`): the no-flush methods -- the asynchronous 1F1B family, CDP's pipeline form and
  WPipe's two groups (one weight policy per chunk);
* ``avgpipe`` (:mod:`.avgpipe`): AvgPipe's parallel pipelines with elastic averaging.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jax.sharding import NamedSharding, PartitionSpec as P


from ..axes import DATA, PIPE


@dataclasses.dataclass
class RunContext:
    """What a runner needs to know: the (precision-wrapped, recompute-wrapped) model, the mesh, the built
    schedule and its method's options, the optimizer and the run's flags."""

    model: Any
    mesh: Any
    schedule: Any  # jaxpipe.schedules.Schedule
    method: Any  # jaxpipe.schedules.registry.Method
    options: dict
    optimizer: Any
    num_microbatches: int
    ties: Any  # jaxpipe.tying.Ties
    nan_bubbles: bool = False
    seed: int = 0
    precision: Any = None
    skip_nonfinite: bool = False
    placement: str = "lanes"
    param_shardings: Optional[tuple] = None
    batch_axes: tuple = ("data",)  # the batch's leading axis: over pipe, these (data; fsdp for FSDP)
    checks: Any = None  # jaxpipe.checks.on_device.StepChecks: what a step checks on the device
    pending: Any = None  # jaxpipe.checks.on_device.PendingStatus: the last step's status, read later
    _lane_plan: Any = None

    def __post_init__(self):
        if self.checks is None:
            from ..checks.on_device import PendingStatus, StepChecks

            self.checks = StepChecks(getattr(self.model, "integer_inputs", None), False, False, "")
            self.pending = PendingStatus(self.checks)

    @property
    def data_parallel(self) -> int:
        return self.mesh.shape[PIPE] * self.mesh.shape[DATA]

    @property
    def lane_plan(self):
        """The lane plan the flushing executor runs (``jaxpipe.schedules.lanes.LanePlan``)."""
        if self._lane_plan is None:
            from ..schedules.layout import lane_plan

            self._lane_plan = lane_plan(self.schedule, self.placement)
        return self._lane_plan

    def shard_batch(self, batch):
        """A global batch placed on the mesh (leading axis split over ``pipe`` x ``data``; each process copies
        in its own rows)."""
        from ..distributed import global_batch

        return global_batch(batch, NamedSharding(self.mesh, P((PIPE,) + tuple(self.batch_axes))))


def make_runner(ctx: RunContext):
    """The runner of the method's family: its registry entry's ``runner`` names one of :data:`RUNNERS`."""
    runner = RUNNERS.get(ctx.method.runner)
    if runner is None:
        raise ValueError(
            f"registry entry {ctx.method.name!r} names runner {ctx.method.runner!r}; known: "
            f"{', '.join(RUNNERS)}"
        )
    return runner(ctx)


# the runner classes (imported after RunContext: they run what it describes)
from .avgpipe import AvgPipeRunner  # noqa: E402
from .no_flush import AsyncRunner  # noqa: E402
from .sync import SyncRunner  # noqa: E402

#: a registry entry's ``runner`` (the method's family, :class:`jaxpipe.schedules.registry.Method`) -> its
#: class
RUNNERS = {"sync": SyncRunner, "async": AsyncRunner, "avgpipe": AvgPipeRunner}

__all__ = ["RUNNERS", "AsyncRunner", "AvgPipeRunner", "RunContext", "SyncRunner", "make_runner"]
