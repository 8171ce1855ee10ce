"""Schedule IR, builders, simulator and renderer.  Pure Python + NumPy: importing this never imports JAX.

>>> from jaxpipe import schedules
>>> schedules.build("1f1b", num_stages=4, num_microbatches=8).simulate(f=1.0, b=2.0).bubble_ratio
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from .ir import Action, B, F, W, Schedule, ScheduleError
from .lanes import LanePlan
from .registry import METHODS, USER_SCHEDULE, Method, method
from .simulate import SimReport, simulate
from .custom import from_actions, from_csv, to_csv
from ..checks.values import is_int

#: each schedule's builder by name (each method's declaration carries its own, in :mod:`.registry`)
#:
#: :meta hide-value:
BUILDERS: Dict[str, Callable[..., Schedule]] = {
    name: m.builder for name, m in METHODS.items() if m.builder is not None
}
#: the asynchronous 1F1B family -- no flush, and the weight versions change between a micro-batch's F and B
ASYNCHRONOUS = tuple(name for name, m in METHODS.items() if m.weight_versions is not None)
WEIGHT_VERSIONS = {name: METHODS[name].weight_versions for name in ASYNCHRONOUS}


def is_async(name: str) -> bool:
    """Whether a method is asynchronous (weights updated inside the step, a state carried from step to step).

    Args:
        name: the method's name.

    Returns:
        True for the methods with a weight-version rule: PipeDream, PipeDream-2BW, SpecTrain, PipeOptim and
        CDP's pipeline form (WPipe and AvgPipe have runners of their own).
    """
    return name in ASYNCHRONOUS


def options_for(name: str, model_stages: int, devices: int, options: Optional[dict] = None) -> dict:
    """The full options of a method: its registry defaults updated with ``options``, checked against its
    schema.

    :meth:`Method.builder_options` turns them into the builder's keywords.

    Args:
        name: the method's name.
        model_stages: the model's stages.
        devices: the ``stage`` axis's devices.
        options: the options given.

    Returns:
        Every option of the method.

    Raises:
        ScheduleError: an unknown key (naming the valid ones) or a bad value.
    """
    return method(name).resolve(options, model_stages, devices)


def available() -> list:
    return sorted(BUILDERS)


def build(name: str, num_stages: int, num_microbatches: int, **options) -> Schedule:
    """Build and validate a built-in schedule.

    Args:
        name: the method's name (:func:`method`).
        num_stages: pipeline devices.
        num_microbatches: micro-batches a step.
        **options: the builder's options (``virtual=2`` for interleaved 1F1B, ...).

    Returns:
        The validated :class:`Schedule`.

    Raises:
        ScheduleError: an unknown name, options that do not fit, or a schedule that fails validation.
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; available: {', '.join(available())}")
    for what, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not is_int(v, 1):
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    return BUILDERS[name](num_stages, num_microbatches, **options).validate()


assert all(callable(b) for b in BUILDERS.values()), "every method's declaration names its builder"

__all__ = [
    "ASYNCHRONOUS",
    "Action",
    "B",
    "BUILDERS",
    "METHODS",
    "USER_SCHEDULE",
    "Method",
    "WEIGHT_VERSIONS",
    "is_async",
    "F",
    "W",
    "Schedule",
    "ScheduleError",
    "method",
    "options_for",
    "SimReport",
    "LanePlan",
    "available",
    "build",
    "simulate",
    "from_actions",
    "from_csv",
    "to_csv",
]
