"""Schedule IR, builders, simulator and renderer.  Pure Python + NumPy: importing this never imports JAX.

    >>> from jaxpipe import schedules
    >>> schedules.build("1f1b", num_stages=4, num_microbatches=8).simulate(f=1.0, b=2.0).bubble_ratio
"""
from __future__ import annotations

from typing import Callable, Dict

from .asynchronous import ASYNC_BUILDERS, WEIGHT_VERSIONS
from .avgpipe import build_avgpipe
from .wpipe import build_wpipe_step
from .chimera import build_chimera
from .gpipe import build_gpipe
from .interleaved import build_interleaved_1f1b
from .ir import Action, B, F, W, Schedule, ScheduleError, Tables
from .one_f_one_b import build_1f1b
from .zero_bubble import build_zb_h1
from .registry import METHODS, Method, method
from .simulate import SimReport, simulate

BUILDERS: Dict[str, Callable[..., Schedule]] = {
    "gpipe": build_gpipe,
    "1f1b": build_1f1b,
    "interleaved_1f1b": build_interleaved_1f1b,
    "zb_h1": build_zb_h1,
    "chimera": build_chimera,
    "avgpipe": build_avgpipe,
    "wpipe": build_wpipe_step,
    **ASYNC_BUILDERS,
}
ASYNCHRONOUS = tuple(ASYNC_BUILDERS)   # no flush: weight versions change between a micro-batch's F and B


def is_async(name: str) -> bool:
    return name in ASYNCHRONOUS


def options_for(name: str, model_stages: int, devices: int, chimera=None, virtual=None, zb=None,
                avgpipe=None) -> dict:
    """Builder options for ``name`` from the user's settings; raises ``ScheduleError`` on bad ones.

    interleaved_1f1b: ``virtual`` (chunks per device) defaults to model_stages / devices.
    chimera: ``chimera={"pipelines": 2, "concat": "direct", "eager_reduce": False}``.
    avgpipe: ``avgpipe={"alpha": None, "advance": "auto" | int, "memory_limit": None}``; the schedule takes
    ``advance`` (``"auto"`` starts as 1F1B, advance 0, and the runner raises it, Algorithm 1).
    """
    if avgpipe is not None and name != "avgpipe":
        raise ScheduleError(f"avgpipe={avgpipe!r} given for schedule {name!r}; it is an option of 'avgpipe' only")
    if name == "avgpipe":
        known = {"alpha", "advance", "memory_limit"}
        unknown = set(avgpipe or {}) - known
        if unknown:
            raise ScheduleError(f"avgpipe: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
        adv = (avgpipe or {}).get("advance", "auto")
        if adv == "auto" or adv is None:
            adv = 0
        return {"advance": adv}
    if zb is not None and name != "zb_h1":
        raise ScheduleError(f"zb={zb!r} given for schedule {name!r}; it is an option of 'zb_h1' only")
    if name == "zb_h1":
        unknown = set(zb or {}) - {"max_deferred_w"}
        if unknown:
            raise ScheduleError(f"zb_h1: unknown option(s) {sorted(unknown)}; known: ['max_deferred_w']")
        return dict(zb or {})
    if chimera is not None and name != "chimera":
        raise ScheduleError(f"chimera={chimera!r} given for schedule {name!r}; it is an option of 'chimera' only")
    if virtual is not None and name != "interleaved_1f1b":
        raise ScheduleError(f"virtual={virtual!r} given for schedule {name!r}; it is an option of "
                            f"'interleaved_1f1b' only")
    if name == "interleaved_1f1b":
        if virtual is None:
            if model_stages % devices:
                raise ScheduleError(
                    f"interleaved_1f1b: the model has {model_stages} stages, not a multiple of the {devices} "
                    f"'stage' devices; each device holds model_stages / devices chunks: stack a multiple of "
                    f"{devices} stages (e.g. {2 * devices})")
            virtual = model_stages // devices
        return {"virtual": virtual}
    if name == "chimera":
        opts = {"pipelines": 2, "concat": "direct", "eager_reduce": False}
        unknown = set(chimera or {}) - set(opts)
        if unknown:
            raise ScheduleError(f"chimera: unknown option(s) {sorted(unknown)}; known: {sorted(opts)}")
        opts.update(chimera or {})
        return opts
    return {}


def available() -> list:
    return sorted(BUILDERS)


def build(name: str, num_stages: int, num_microbatches: int, **options) -> Schedule:
    """Build and validate the schedule ``name`` for ``num_stages`` devices and ``num_microbatches``."""
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; available: {', '.join(available())}")
    for what, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    return BUILDERS[name](num_stages, num_microbatches, **options).validate()


assert set(METHODS) == set(BUILDERS), "every method needs a builder and a registry entry"

__all__ = ["ASYNCHRONOUS", "Action", "B", "BUILDERS", "METHODS", "Method", "WEIGHT_VERSIONS", "is_async", "F", "W",
           "Schedule", "ScheduleError", "method", "options_for", "SimReport", "Tables", "available", "build",
           "simulate"]
