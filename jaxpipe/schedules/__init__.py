"""Schedule IR, builders, simulator and renderer.  Pure Python + NumPy: importing this never imports JAX.

>>> from jaxpipe import schedules
>>> schedules.build("1f1b", num_stages=4, num_microbatches=8).simulate(f=1.0, b=2.0).bubble_ratio
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from .ir import Action, B, F, W, Schedule, ScheduleError
from .lanes import LanePlan
from .registry import METHODS, Method, method
from .simulate import SimReport, simulate
from ..checks.values import is_int

#: schedule name -> builder (each method's declaration carries its own: :mod:`.registry`)
BUILDERS: Dict[str, Callable[..., Schedule]] = {name: m.builder for name, m in METHODS.items()}
#: the asynchronous 1F1B family (no flush: weight versions change between a micro-batch's F and B)
ASYNCHRONOUS = tuple(name for name, m in METHODS.items() if m.weight_versions is not None)
WEIGHT_VERSIONS = {name: METHODS[name].weight_versions for name in ASYNCHRONOUS}


def is_async(name: str) -> bool:
    return name in ASYNCHRONOUS


def options_for(name: str, model_stages: int, devices: int, options: Optional[dict] = None) -> dict:
    """The full options of ``name`` (its registry defaults updated with ``options``) checked against its
    schema; ``ScheduleError`` naming the valid keys on an unknown one.  :meth:`Method.builder_options` turns
    them into the builder's keywords."""
    return method(name).resolve(options, model_stages, devices)


def available() -> list:
    return sorted(BUILDERS)


def build(name: str, num_stages: int, num_microbatches: int, **options) -> Schedule:
    """Build and validate the schedule ``name`` for ``num_stages`` devices and ``num_microbatches``."""
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
]
