"""One declaration per method: everything the rest of the library may ask about a schedule by name (issue
#17).  Pure Python, no JAX.

A :class:`Method` says: whether the pipeline flushes every step (``flushes``) and whether the optimizer runs
inside the pipeline program (``updates_inside``: per micro-batch, per group or per replica -- there is then
no single update to skip or unscale); which runner executes it (``runner``: ``"sync"``, ``"async"``,
``"avgpipe"``) and with which weight policy (``policy``, :mod:`jaxpipe.optim.policies`); its user
options with their defaults (``options``: the schema ``Pipeline(options=...)`` is checked against); how many
model stages each device holds (``stages_per_device(options)``); which options feed the schedule builder
(``builder_keys``); whether the stage's forward is recomputed in the backward (``recompute(options)``); and the
paper.  Adding a method = one builder file + one entry here + its tests.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from .ir import ScheduleError


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    flushes: bool
    updates_inside: bool
    stages_per_device: Callable[[dict], int]
    paper: str
    runner: str = "sync"
    policy: Optional[str] = None
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    builder_keys: Tuple[str, ...] = ()
    policy_keys: Tuple[str, ...] = ()      # options the weight policy takes (``optim.policies.make_policy``)
    recompute: Callable[[dict], bool] = lambda opts: False
    # option defaults that depend on the model and the mesh, and builder values that differ from the user's
    finish: Callable[[dict, int, int], dict] = lambda opts, model_stages, devices: opts
    to_builder: Callable[[dict], dict] = lambda opts: opts

    def resolve(self, user: Optional[dict], model_stages: int, devices: int) -> dict:
        """The method's full options: its defaults updated with ``user``'s; unknown keys are a
        ScheduleError naming the valid ones (and the method a key belongs to, when it is another's)."""
        user = dict(user or {})
        unknown = sorted(set(user) - set(self.options))
        if unknown:
            owners = {k: sorted(m.name for m in METHODS.values() if k in m.options) for k in unknown}
            where = "; ".join(f"{k!r} is an option of {', '.join(v)}" for k, v in owners.items() if v)
            raise ScheduleError(
                f"{self.name}: unknown option(s) {unknown}; known: {sorted(self.options) or 'none'}"
                + (f" ({where})" if where else ""))
        return self.finish({**self.options, **user}, model_stages, devices)

    def builder_options(self, opts: dict) -> dict:
        """The options the schedule builder takes."""
        return self.to_builder({k: opts[k] for k in self.builder_keys})


def _virtual(opts: dict, model_stages: int, devices: int) -> dict:
    """interleaved_1f1b: ``virtual`` (chunks per device) defaults to model_stages / devices."""
    if opts["virtual"] is not None:
        return opts
    if model_stages % devices:
        raise ScheduleError(
            f"interleaved_1f1b: the model has {model_stages} stages, not a multiple of the {devices} 'stage' "
            f"devices; each device holds model_stages / devices chunks: stack a multiple of {devices} stages "
            f"(e.g. {2 * devices})")
    return {**opts, "virtual": model_stages // devices}


def _auto_advance(b: dict) -> dict:
    """AvgPipe's ``advance="auto"`` builds the 1F1B order first (advance 0); the runner raises it (Algorithm 1)."""
    return {**b, "advance": 0 if b["advance"] in ("auto", None) else b["advance"]}


_one = lambda opts: 1
_ASYNC = dict(flushes=False, updates_inside=True, stages_per_device=_one, runner="async")
# per-batch rules may run the lanes timeline (schedules.asynchronous.timeline): "auto", "lanes", "alternating"
_TIMELINE = dict(options={"timeline": "auto"}, builder_keys=("timeline",),
                 to_builder=lambda o: {"timeline_choice": o["timeline"]})
METHODS: Dict[str, Method] = {m.name: m for m in [
    Method("gpipe", True, False, _one, "Huang et al. 2019, GPipe"),
    Method("1f1b", True, False, _one, "Narayanan et al. 2019/2021, PipeDream-Flush (1F1B)"),
    Method("interleaved_1f1b", True, False, lambda o: int(o.get("virtual") or 2), "Narayanan et al. 2021, §2.2",
           options={"virtual": None}, builder_keys=("virtual",), finish=_virtual),
    Method("zb_h1", True, False, _one, "Qi et al. 2024, Zero Bubble (ZB-H1)",
           options={"max_deferred_w": None, "w_from": "frontier"}, builder_keys=("max_deferred_w", "w_from")),
    Method("zb_v", True, False, lambda o: 2, "Qi et al. 2024, Zero Bubble (ZB-V: two chunks per device in a V)",
           options={"w_from": "frontier"}, builder_keys=("w_from",)),
    Method("dualpipe_v", True, False, lambda o: 2, "DeepSeek-AI 2025, DualPipeV (DualPipe cut in half: a V)",
           options={"w_from": "frontier"}, builder_keys=("w_from",)),
    Method("chimera", True, False, _one, "Li & Hoefler 2021, Chimera",
           options={"pipelines": 2, "concat": "direct", "eager_reduce": False, "double_batch": False},
           builder_keys=("pipelines", "concat", "eager_reduce", "double_batch"),
           recompute=lambda o: o.get("concat") == "forward_doubling"),     # §3.5
    Method("avgpipe", False, True, _one, "AvgPipe: elastic averaging of parallel pipelines", runner="avgpipe",
           options={"alpha": None, "advance": "auto", "memory_limit": None, "tolerance": 0.02, "shared": None},
           builder_keys=("advance",), to_builder=_auto_advance),
    Method("wpipe", False, True, lambda o: 2, "Yang et al., WPipe (2GW)", runner="async", policy="wpipe",
           options={"recompute": False, "apc": False},                 # WPipe-R §3.3; APC appendix A.3
           recompute=lambda o: bool(o.get("recompute"))),
    Method("pipedream", paper="Narayanan et al. 2019, PipeDream (weight stashing)", policy="pipedream",
           **_ASYNC),
    Method("pipedream_2bw", paper="Narayanan et al. 2021, PipeDream-2BW", policy="pipedream_2bw", **_TIMELINE,
           **_ASYNC),
    Method("spectrain", paper="Chen et al. 2018, SpecTrain", policy="spectrain", **_ASYNC),
    Method("pipeoptim", paper="Guan et al., PipeOptim", policy="pipeoptim",
           options={"distance": "paper", "prediction": "update"}, policy_keys=("distance", "prediction"),
           **_ASYNC),
    Method("cdp_v1", paper="Fournier & Oyallon, Cyclic Data Parallelism (v1, pipeline form)", policy="cdp_v1",
           **_TIMELINE, **_ASYNC),
    Method("cdp_v2", paper="Fournier & Oyallon, Cyclic Data Parallelism (v2, pipeline form)", policy="cdp_v2",
           **_ASYNC),
]}


def method(name: str) -> Method:
    """The declaration of ``name``; ScheduleError naming the known ones otherwise."""
    if name not in METHODS:
        raise ScheduleError(f"unknown schedule {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]
