"""One declaration per method: everything the rest of the library may ask about a schedule by name.  Pure
Python, no JAX.

A :class:`Method` says: how to build its schedule (``builder``), whether the pipeline flushes every step
(``flushes``) and whether the optimizer runs
inside the pipeline program (``updates_inside``: per micro-batch, per group or per replica -- there is then
no single update to skip or unscale); which runner executes it (``runner``: ``"sync"``, ``"async"``,
``"avgpipe"``) and with which weight policy (``policy``, :mod:`jaxpipe.optim.policies`); its user
options with their defaults (``options``: the schema ``Pipeline(options=...)`` is checked against); how many
model stages each device holds (``stages_per_device(options)``); which options feed the schedule builder
(``builder_keys``); whether the stage's forward is recomputed in the backward (``recompute(options)``); the
weight versions each stage holds (``weight_versions``, the no-flush methods, PipeOptim Table II); whether its
weight rule is per batch (``per_batch_rule``: it may run the lanes timeline) and accumulates a step's
gradients (``accumulating``); the rule its serial reference applies (``reference``: which versions a
micro-batch's F and B read, :mod:`jaxpipe.optim.reference`); the removed ``Pipeline`` keyword that carried its
options (refused by name) (``legacy_keyword``); whether the configuration search considers it (``tunable``);
and the paper.  Adding a method = one builder (a new schedule family: one file) + one entry here + its tests;
a new weight rule adds its policy to :mod:`jaxpipe.optim.policies` under the entry's ``policy`` name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from .asynchronous import TIMELINES, builder as no_flush_builder
from .avgpipe import build_avgpipe
from .chimera import CONCATS, build_chimera
from .gpipe import build_gpipe
from .interleaved import build_interleaved_1f1b
from .ir import ScheduleError
from .option_types import BOOL, Opt, check_options
from .one_f_one_b import build_1f1b
from .v_shape import build_dualpipe_v, build_zb_v
from .wpipe import build_wpipe_step
from .zero_bubble import build_zb_h1


@dataclasses.dataclass(frozen=True)
class Method:
    """A method's declaration: what the runtime, the options' checks and the search read, instead of its name.

    Attributes:
        name: the name ``Pipeline(schedule=...)`` takes.
        flushes: every step ends with the pipeline empty (the synchronous schedules).
        updates_inside: weights are updated inside the step, per micro-batch (the no-flush methods).
        stages_per_device: ``stages_per_device(options)``: model stages (chunks) each device holds.
        paper: the paper it follows (title, section).
        builder: ``builder(num_stages, num_microbatches, **builder options) -> Schedule``.
        runner: the runner class's key in :data:`jaxpipe.runners.RUNNERS`.
        policy: the weight policy's name (:mod:`jaxpipe.optim.policies`), for the no-flush methods.
        options: the options and their defaults.
        builder_keys: the options the builder takes.
        policy_keys: the options the weight policy takes.
        recompute: ``recompute(options)``: whether a stage recomputes its forward in the backward.
        finish: ``finish(options, model_stages, devices)``: option defaults that depend on the model and the
            mesh.
        to_builder: ``to_builder(builder options)``: builder values that differ from the user's.
        weight_versions: ``weight_versions(D)``: per stage, the weight versions held (asynchronous methods
            only).
        per_batch_rule: a batch reads version ``b - 1`` in F and B, whatever the ticks.
        accumulating: a step's gradients are summed, one update per step.
        reference: the weight-version rule of the serial reference loop the tests hold the method to.
        legacy_keyword: the removed ``Pipeline(<keyword>=...)`` that carried its options (refused by name).
        tunable: considered by the configuration search (:mod:`jaxpipe.tune`).
        types: each option's type and range.
        reads_differ: a micro-batch's forward and backward on one stage may read different weights (a
            prediction).
    """

    name: str
    flushes: bool
    updates_inside: bool
    stages_per_device: Callable[[dict], int]
    paper: str
    builder: Optional[Callable] = None  # (num_stages, num_microbatches, **builder options) -> Schedule
    runner: str = "sync"
    policy: Optional[str] = None
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    builder_keys: Tuple[str, ...] = ()
    policy_keys: Tuple[str, ...] = ()  # options the weight policy takes (``optim.policies.make_policy``)
    recompute: Callable[[dict], bool] = lambda opts: False
    # option defaults that depend on the model and the mesh, and builder values that differ from the user's
    finish: Callable[[dict, int, int], dict] = lambda opts, model_stages, devices: opts
    to_builder: Callable[[dict], dict] = lambda opts: opts
    weight_versions: Optional[Callable[[int], List[int]]] = None  # per stage, in units of one stage's weights
    per_batch_rule: bool = False  # a batch reads version b - 1 in F and B: its numbers ignore the ticks
    accumulating: bool = False  # a step's gradients summed, one update per step
    #: (stage s, micro-batch i, batch b, D, M, versions h of stage s, updates u, axpy[, o=options]) -> (w_F,
    #: w_B)
    reference: Optional[Callable] = None
    legacy_keyword: Optional[str] = (
        None  # the removed Pipeline(<keyword>=...) that carried its options (refused by name)
    )
    tunable: bool = False  # considered by the configuration search (jaxpipe.tune)
    types: Dict[str, Opt] = dataclasses.field(default_factory=dict)  # each option's type and range
    #: a micro-batch's forward and backward on one stage may read different weights (a prediction): a stage
    #: that recomputes its forward in the backward must recompute it on the forward's weights
    #: (:class:`jaxpipe.runtime.residuals.RecomputedAtForwardWeights`)
    reads_differ: bool = False

    def resolve(self, user: Optional[dict], model_stages: int, devices: int) -> dict:
        """The method's full options: its defaults updated with the user's, checked.

        Args:
            user: the options given (``Pipeline(schedule_options=...)``).
            model_stages: the model's stages.
            devices: the ``stage`` axis's devices.

        Returns:
            Every option, with the defaults that depend on the model and the mesh filled in.

        Raises:
            ScheduleError: an unknown key (naming the valid ones, and the method it belongs to when it is
                another's), or a value of the wrong type or range.
        """
        user = dict(user or {})
        unknown = sorted(set(user) - set(self.options))
        if unknown:
            owners = {k: sorted(m.name for m in METHODS.values() if k in m.options) for k in unknown}
            where = "; ".join(f"{k!r} is an option of {', '.join(v)}" for k, v in owners.items() if v)
            raise ScheduleError(
                f"{self.name}: unknown option(s) {unknown}; known: {sorted(self.options) or 'none'}"
                + (f" ({where})" if where else "")
            )
        check_options(self.name, user, self.types)
        return self.finish({**self.options, **user}, model_stages, devices)

    def builder_options(self, opts: dict) -> dict:
        """The options the schedule builder takes.

        Args:
            opts: the method's full options (:meth:`resolve`).

        Returns:
            The builder's keyword arguments.
        """
        return self.to_builder({k: opts[k] for k in self.builder_keys})


def _virtual(opts: dict, model_stages: int, devices: int) -> dict:
    """interleaved_1f1b: ``virtual`` (chunks per device) defaults to model_stages / devices."""
    if opts["virtual"] is not None:
        return opts
    if model_stages == devices:
        raise ScheduleError(
            f"interleaved_1f1b: the model has {model_stages} stages for {devices} 'stage' devices, one "
            "chunk each: "
            f"that is plain 1F1B. Interleaving needs several chunks per device: stack {2 * devices} stages "
            f"(virtual=2), or use schedule='1f1b'"
        )
    if model_stages % devices:
        raise ScheduleError(
            f"interleaved_1f1b: the model has {model_stages} stages, not a multiple of the {devices} 'stage' "
            f"devices; each device holds model_stages / devices chunks: stack a multiple of {devices} stages "
            f"(e.g. {2 * devices})"
        )
    return {**opts, "virtual": model_stages // devices}


def _auto_advance(b: dict) -> dict:
    """AvgPipe's ``advance="auto"`` builds the 1F1B order first (advance 0); the runner raises it (Algorithm
    1)."""
    return {**b, "advance": 0 if b["advance"] in ("auto", None) else b["advance"]}


_one = lambda opts: 1


def _same(v):
    return lambda h: (h[v], h[v])


def _stashed(s, i, b, D, M, h, u, axpy):
    """PipeDream: F and B of micro-batch i read the version stage s held at i's F (c_F updates applied)."""
    return _same(max(0, i - (D - 1 - s)))(h)


def _predicted(s, i, b, D, M, h, u, axpy, o=None):
    """PipeOptim: F predicts by distance D - 1 - s ("paper", eq. 4) or D - s ("code"); B reads the current."""
    c = max(0, i - (D - 1 - s))
    return axpy(D - s - ((o or {}).get("distance", "paper") != "code"), u[c], h[c]), h[i]


def _momentum_predicted(s, i, b, D, M, h, u, axpy):
    """SpecTrain: F predicts by s // 2 + D - 1 - s, B by s // 2 (both from the momentum step)."""
    c = max(0, i - (D - 1 - s))
    return axpy(s // 2 + D - 1 - s, u[c], h[c]), axpy(s // 2, u[i], h[i])


W_FROM = {"w_from": Opt("choice", choices=("frontier", "recompute"))}


def _async(name, versions, paper, reference, per_batch=False, accumulating=False, **kw):
    """An asynchronous 1F1B-family method: the periodic no-flush 1F1B under its weight policy."""
    opts = (
        dict(
            options={"timeline": "auto"},
            builder_keys=("timeline",),
            to_builder=lambda o: {"timeline_choice": o["timeline"]},
            types={"timeline": Opt("choice", choices=TIMELINES)},
        )
        if per_batch
        else {}
    )
    opts.update(kw)
    return Method(
        name,
        False,
        True,
        _one,
        paper,
        builder=no_flush_builder(name, versions, per_batch),
        runner="async",
        policy=name,
        weight_versions=versions,
        per_batch_rule=per_batch,
        accumulating=accumulating,
        reference=reference,
        **opts,
    )


_two = lambda D: [2] * D
#: the method of a user's own schedule (:mod:`jaxpipe.schedules.custom`): it has no builder
USER_SCHEDULE = "custom"

METHODS: Dict[str, Method] = {
    m.name: m
    for m in [
        Method("gpipe", True, False, _one, "Huang et al. 2019, GPipe", builder=build_gpipe, tunable=True),
        Method(
            "1f1b",
            True,
            False,
            _one,
            "Narayanan et al. 2019/2021, PipeDream-Flush (1F1B)",
            builder=build_1f1b,
            tunable=True,
        ),
        Method(
            "interleaved_1f1b",
            True,
            False,
            lambda o: int(o.get("virtual") or 2),
            "Narayanan et al. 2021, §2.2",
            builder=build_interleaved_1f1b,
            options={"virtual": None},
            builder_keys=("virtual",),
            finish=_virtual,
            legacy_keyword="virtual",
            tunable=True,
            types={"virtual": Opt("int", minimum=2, none_ok=True)},
        ),
        Method(
            "zb_h1",
            True,
            False,
            _one,
            "Qi et al. 2024, Zero Bubble (ZB-H1)",
            builder=build_zb_h1,
            options={"max_deferred_w": None, "w_from": "frontier", "costs": None},
            builder_keys=("max_deferred_w", "w_from", "costs"),
            legacy_keyword="zb",
            tunable=True,
            types={"max_deferred_w": Opt("int", minimum=0, none_ok=True), **W_FROM},
        ),
        Method(
            "zb_v",
            True,
            False,
            lambda o: 2,
            "Qi et al. 2024, Zero Bubble (ZB-V: two chunks per device in a V)",
            builder=build_zb_v,
            options={"w_from": "frontier", "costs": None},
            builder_keys=("w_from", "costs"),
            types=W_FROM,
        ),
        Method(
            "dualpipe_v",
            True,
            False,
            lambda o: 2,
            "DeepSeek-AI 2025, DualPipeV (DualPipe cut in half: a V)",
            builder=build_dualpipe_v,
            options={"w_from": "frontier"},
            builder_keys=("w_from",),
            types=W_FROM,
        ),
        Method(
            "chimera",
            True,
            False,
            _one,
            "Li & Hoefler 2021, Chimera",
            builder=build_chimera,
            options={"pipelines": 2, "concat": "direct", "eager_reduce": False, "double_batch": False},
            builder_keys=("pipelines", "concat", "eager_reduce", "double_batch"),
            recompute=lambda o: o.get("concat") == "forward_doubling",  # §3.5
            legacy_keyword="chimera",
            tunable=True,
            types={
                "pipelines": Opt("int", minimum=2),
                "eager_reduce": BOOL,
                "double_batch": BOOL,
                "concat": Opt("choice", choices=CONCATS),
            },
        ),
        Method(
            "avgpipe",
            False,
            True,
            _one,
            "AvgPipe: elastic averaging of parallel pipelines",
            runner="avgpipe",
            builder=build_avgpipe,
            options={
                "alpha": None,
                "advance": "auto",
                "memory_limit": None,
                "tolerance": 0.02,
                "shared": None,
            },
            builder_keys=("advance",),
            to_builder=_auto_advance,
            legacy_keyword="avgpipe",
            types={
                "alpha": Opt("number", minimum=0, maximum=1, none_ok=True),
                "advance": Opt(
                    "int",
                    minimum=0,
                    literals=("auto",),
                    meaning="forwards issued beyond 1F1B, 0 = 1F1B; 'auto': AvgPipe's Algorithm 1",
                ),
                "memory_limit": Opt("number", above=0, none_ok=True),
                "tolerance": Opt("number", minimum=0),
                "shared": Opt("int", minimum=1, none_ok=True),
            },
        ),
        # eq. (1): G0 (stages < D/2 of the 2D-partition model) one delay, G1 none
        Method(
            "wpipe",
            False,
            True,
            lambda o: 2,
            "Yang et al., WPipe (2GW)",
            runner="async",
            policy="wpipe",
            builder=build_wpipe_step,
            options={"recompute": False, "apc": False},  # WPipe-R §3.3; APC appendix A.3
            recompute=lambda o: bool(o.get("recompute")),
            accumulating=True,
            legacy_keyword="wpipe",
            types={"recompute": BOOL, "apc": BOOL},
            reference=lambda s, i, b, D, M, h, u, axpy: _same(max(b - 1, 0) if s < D // 2 else b)(h),
        ),
        _async(
            "pipedream",
            lambda D: [D - s for s in range(D)],
            "Narayanan et al. 2019, PipeDream (weight stashing)",
            _stashed,
        ),
        _async(
            "pipedream_2bw",
            _two,
            "Narayanan et al. 2021, PipeDream-2BW",
            lambda s, i, b, D, M, h, u, axpy: _same(max(b - 1, 0))(h),
            per_batch=True,
            accumulating=True,
        ),
        # SpecTrain holds the weights and the momentum step; PipeOptim's last stage predicts nothing
        _async("spectrain", _two, "Chen et al. 2018, SpecTrain", _momentum_predicted, reads_differ=True),
        _async(
            "pipeoptim",
            lambda D: [2] * (D - 1) + [1],
            "Guan et al., PipeOptim",
            _predicted,
            reads_differ=True,
            options={"distance": "paper", "prediction": "update"},
            policy_keys=("distance", "prediction"),
            types={
                "distance": Opt("choice", choices=("paper", "code")),
                "prediction": Opt("choice", choices=("update", "decay_free")),
            },
        ),
        # Cyclic Data Parallelism, pipeline form: CDP-v1 is 2BW's rule; CDP-v2 (eq. CDP-v2): micro-batch j
        # reads the fresh version w(b) on stages s >= D - 1 - j
        _async(
            "cdp_v1",
            _two,
            "Fournier & Oyallon, Cyclic Data Parallelism (v1, pipeline form)",
            lambda s, i, b, D, M, h, u, axpy: _same(max(b - 1, 0))(h),
            per_batch=True,
            accumulating=True,
        ),
        _async(
            "cdp_v2",
            _two,
            "Fournier & Oyallon, Cyclic Data Parallelism (v2, pipeline form)",
            lambda s, i, b, D, M, h, u, axpy: _same(b if (i % M) + s >= D - 1 else max(b - 1, 0))(h),
            accumulating=True,
        ),
        # a user's own schedule (jaxpipe.schedules.custom): built by from_actions / from_csv, never by name
        Method(
            USER_SCHEDULE,
            True,
            False,
            lambda opts: opts["chunks"],
            "a user's own schedule (per-device action lists, or PyTorch's CSV format)",
            options={"chunks": 1},
            types={"chunks": Opt("int", minimum=1, meaning="model stages a device holds")},
        ),
    ]
}


def method(name: str) -> Method:
    """The declaration of a method.

    Args:
        name: the method's name.

    Returns:
        Its :class:`Method`.

    Raises:
        ScheduleError: an unknown name (the message lists the known ones).
    """
    if name not in METHODS:
        raise ScheduleError(f"unknown schedule {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]
