"""One declaration per method: what the rest of the library may ask about a schedule by name (issue #17,
first part).  Pure Python, no JAX.

``flushes``: a step ends with an empty pipeline and one optimizer update outside it (the synchronous
schedules); ``updates_inside``: the optimizer runs inside the pipeline program (per micro-batch, per group or
per replica), so there is no single update to skip, unscale or tie; ``stages_per_device(options)``: model
stages each device holds; ``paper``: where the schedule comes from.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict

from .ir import ScheduleError


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    flushes: bool
    updates_inside: bool
    stages_per_device: Callable[[dict], int]
    paper: str


_one = lambda opts: 1
METHODS: Dict[str, Method] = {m.name: m for m in [
    Method("gpipe", True, False, _one, "Huang et al. 2019, GPipe"),
    Method("1f1b", True, False, _one, "Narayanan et al. 2019/2021, PipeDream-Flush (1F1B)"),
    Method("interleaved_1f1b", True, False, lambda o: int(o.get("virtual", 2)), "Narayanan et al. 2021, §2.2"),
    Method("zb_h1", True, False, _one, "Qi et al. 2024, Zero Bubble (ZB-H1)"),
    Method("chimera", True, False, _one, "Li & Hoefler 2021, Chimera"),
    Method("avgpipe", False, True, _one, "AvgPipe: elastic averaging of parallel pipelines"),
    Method("wpipe", False, True, lambda o: 2, "Yang et al., WPipe (2GW)"),
    Method("pipedream", False, True, _one, "Narayanan et al. 2019, PipeDream (weight stashing)"),
    Method("pipedream_2bw", False, True, _one, "Narayanan et al. 2021, PipeDream-2BW"),
    Method("spectrain", False, True, _one, "Chen et al. 2018, SpecTrain"),
    Method("pipeoptim", False, True, _one, "Guan et al., PipeOptim"),
    Method("cdp_v1", False, True, _one, "Fournier & Oyallon, Cyclic Data Parallelism (v1, pipeline form)"),
    Method("cdp_v2", False, True, _one, "Fournier & Oyallon, Cyclic Data Parallelism (v2, pipeline form)"),
]}


def method(name: str) -> Method:
    """The declaration of ``name``; ScheduleError naming the known ones otherwise."""
    if name not in METHODS:
        raise ScheduleError(f"unknown schedule {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]
