"""Automatic configuration, first version: from a model, a device count and a memory budget to the
predicted-fastest pipeline that fits.

:func:`configure` considers every split of the devices into ``stage`` x ``data`` (x the model axes, below),
every schedule given, every micro-batch count and residual policy, and for each predicts

* **memory per device** with :mod:`jaxpipe.tune.memory`: the state exact, the temp from the plan's stash slots
  and the stage's residuals, a line per family (residual policy, split backward, chunks per device; one
  stage, whose plan stashes nothing, a family of its own), its slope the policy's, fitted on two compiles of
  one family, and each other family's offset from one compile of its own (:func:`_calibrate`); the chosen
  candidate and the runner-up are then compiled, and where XLA's figure differs from the prediction by over
  10% the choice is made again on the compiled figure;
* **step time** with :func:`jaxpipe.tune.lockstep.predict_devices`: the plan the executor compiles, tick by
  tick, at one stage's F, B and W measured on this backend per micro-batch size and residual policy
  (:func:`jaxpipe.tune.stage_bench.stashed_stage_costs`: residuals through a stash, a recomputing policy's
  backward paying its recomputation, zero-bubble's W as the executor's split runs it), the
  embedding's and the head's costs on the first and last stage (:class:`~jaxpipe.tune.lockstep.EdgeCosts`:
  a large vocabulary's head is several blocks), the exchange's cost (:func:`jaxpipe.tune.microbench.
  p2p_alpha_beta`), the rendezvous every tick pays beyond its message (a tick's price measured as
  :func:`jaxpipe.tune.running_costs.tick_price` times it, less the message), the data replicas' gradient
  all-reduce of one device's gradient leaves (:func:`jaxpipe.tune.microbench.tree_allreduce_time`) and the
  optimizer's update of one device's share.

Every measurement is made once per search and kept per (model, backend) on disk
(:mod:`jaxpipe.tune.measure_cache`, :mod:`jaxpipe.tune.config_bench`): the same search again compiles and
times nothing.  In a multi-process job every timing is process 0's, broadcast, so every process builds the
same programs.

It returns a :class:`Configuration`: the choice (``Pipeline`` keyword arguments and the mesh), every candidate
with its predicted step, bubble, memory and why a candidate was dropped, and :meth:`Configuration.table`.
The cut: each stage count's fastest fitting candidate is also tried with its blocks' cut balanced from
measured costs (:mod:`jaxpipe.cuts.configure`).

Model axes: where the model's ``param_specs`` name ``tensor`` or ``fsdp``, the devices are also split into
``stage x data x fsdp x tensor`` (FSDP splits the batch too: ``batch_axes=("data", "fsdp")``).  Such a
candidate's state is its own shards; its residuals are the shards XLA's sharding propagation gives a compiled
forward of one stage (:func:`~jaxpipe.tune.memory.residual_bytes_on`), and its families are lines of their own
(the model axes' sizes in the family: their slope is fitted on their own two compiles); its stage is timed on
that many devices with its weights sharded as the pipeline shards them, XLA's collectives included
(:meth:`~jaxpipe.tune.config_bench.Bench.stage_costs`); the update and the data all-reduce are of one device's
shards.  The embedding and the head are timed whole (under FSDP on a device's rows).  A candidate with every
model axis at 1 runs the model with its specs dropped (weights replicated).  Not yet: a per-stage
policy, the no-flush methods.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from .. import schedules as _schedules
from ..errors import ConfigError
from .config_bench import Bench, agreed
from ..cuts.configure import balance_cuts
from .lockstep import Link, predict_devices
from .measure_cache import MeasureCache, default_path
from .memory import MemoryModel, calibrate

CHECK_TOLERANCE = 0.10
#: a measured choice times its fastest candidate at least this long (seconds), in at most MAX_ROUNDS rounds
MIN_TIME_S = 1.0
MAX_ROUNDS = 30


@dataclasses.dataclass
class Candidate:
    schedule: str
    stages: int
    data: int
    microbatches: int
    residuals: str
    step_s: float = float("nan")
    bubble: float = float("nan")
    memory: float = float("nan")  # bytes per device, predicted (or compiled, once checked)
    compiled_memory: Optional[float] = None
    dropped: str = ""
    measured_s: Optional[float] = None  # its step timed on the devices (``configure(measure=k)``)
    #: blocks per model stage where the cut is not the model's own even one (the pick's balanced cut,
    #: :mod:`jaxpipe.cuts.configure`); build the model with :meth:`Configuration.model`
    cut: Optional[Tuple[int, ...]] = None
    #: devices a stage's weights are sharded over along the model axes (the model's ``param_specs`` name them;
    #: 1: that axis is left out and the weights replicated)
    fsdp: int = 1
    tensor: int = 1
    #: the plan's placement the prediction is of (``Pipeline``'s ``placement="auto"``: the faster of the two
    #: in the lockstep model), set once the candidate is built and given to ``Pipeline`` as such
    placement: Optional[str] = None

    @property
    def model_axes(self) -> Tuple[int, int]:
        """``(fsdp, tensor)``: the model axes' sizes, what a stage's devices are split into."""
        return (self.fsdp, self.tensor)

    def pipeline_kwargs(self) -> dict:
        """What to give ``jp.Pipeline`` (with the model cut into :meth:`model_stages` stages): the program the
        search built, predicted and timed -- its placement, and ``op_costs="unit"``, so that the pipeline does
        not place its plan again for costs measured at its first step (the search measured its stage's costs
        and timed the candidates itself)."""
        from ..runtime.mesh import make_mesh

        return {
            "schedule": self.schedule,
            "num_microbatches": self.microbatches,
            "residuals": self.residuals,
            "mesh": make_mesh(stages=self.stages, data=self.data, fsdp=self.fsdp, tensor=self.tensor),
            "options": self._options(),
            **({"batch_axes": ("data", "fsdp")} if self.fsdp > 1 else {}),
            **({"placement": self.placement} if self.placement else {}),
            "op_costs": "unit",
        }

    def _options(self) -> dict:
        """Two model chunks a device where the method stacks chunks (interleaved's ``virtual``), as the search
        in :mod:`.search` uses it."""
        return {"virtual": 2} if "virtual" in _schedules.method(self.schedule).options else {}

    @property
    def model_stages(self) -> int:
        per = _schedules.method(self.schedule).stages_per_device(self._options())
        return self.stages * per

    def label(self) -> str:
        cut = "" if self.cut is None else f" cut={','.join(map(str, self.cut))}"
        axes = "".join(f" {n}={v}" for n, v in (("fsdp", self.fsdp), ("tensor", self.tensor)) if v > 1)
        place = " placement=ordered" if self.placement == "ordered" else ""  # (lanes: most plans)
        return (
            f"{self.schedule} stage={self.stages} data={self.data}{axes} M={self.microbatches} "
            f"residuals={self.residuals}{cut}{place}"
        )


@dataclasses.dataclass
class Configuration:
    best: Candidate
    candidates: List[Candidate]
    budget: float
    _built: dict = dataclasses.field(default_factory=dict, repr=False)
    _bench: object = dataclasses.field(default=None, repr=False)
    #: what balancing each stage count's fastest cut found (:mod:`jaxpipe.cuts.configure`)
    cut_note: str = ""
    _balance: bool = dataclasses.field(default=True, repr=False)

    def model(self, candidate: Optional[Candidate] = None):
        """The model ``candidate`` (default: the choice) runs: ``make_model(candidate.model_stages)``, or with
        a balanced cut, the same blocks cut as :attr:`Candidate.cut` says."""
        return self._bench.model_for(self.best if candidate is None else candidate)

    @property
    def cache_hits(self) -> int:
        """Measurements read from the cache by the search (and its checks)."""
        return self._bench.cache.hits

    @property
    def cache_misses(self) -> int:
        """Measurements made (timed or compiled) by the search."""
        return self._bench.cache.misses

    def within(
        self, memory_budget: float, measure: int = 0, rounds: int = 3, min_time_s: float = MIN_TIME_S
    ) -> "Configuration":
        """The choice under another budget, from the same predictions (compiling only what the check needs);
        ``measure``, ``rounds``, ``min_time_s``: as :func:`configure`'s."""
        cands = [dataclasses.replace(c, measured_s=None) for c in self.candidates]
        built = {id(n): self._built[id(o)] for o, n in zip(self.candidates, cands) if id(o) in self._built}
        for c in cands:
            if c.dropped.startswith(("needs", "compiled")):
                c.dropped = ""
        conf = _choose(cands, built, self._bench, memory_budget)
        if self._balance:
            balance_cuts(conf, memory_budget)
        conf._balance = self._balance
        if measure:
            conf.best = _measured_best(conf, measure, rounds, min_time_s)
        return conf

    def table(self) -> str:
        """The candidates, fitting ones fastest first, then the dropped ones with why."""
        ok = sorted((c for c in self.candidates if not c.dropped), key=lambda c: c.step_s)
        rows = [
            "| candidate | predicted step | measured | bubble | memory / device | compiled | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in ok + [c for c in self.candidates if c.dropped]:
            comp = "" if c.compiled_memory is None else f"{c.compiled_memory / 2**20:,.1f} MiB"
            note = c.dropped or ("chosen" if c is self.best else "")
            step = "" if np.isnan(c.step_s) else f"{c.step_s * 1e3:.2f} ms"
            bub = "" if np.isnan(c.bubble) else f"{c.bubble:.0%}"
            mem = "" if np.isnan(c.memory) else f"{c.memory / 2**20:,.1f} MiB"
            meas = "" if c.measured_s is None else f"{c.measured_s * 1e3:.2f} ms"
            rows.append(f"| {c.label()} | {step} | {meas} | {bub} | {mem} | {comp} | {note} |")
        return "\n".join(rows)


def _candidates(devices, rows, names, microbatches, residuals, model_axes=((1, 1),)) -> List[Candidate]:
    out = []
    # on one stage there is no pipeline and no bubble: every schedule is the plain accumulation of the M
    # micro-batches, and one of them stands for the rest (1F1B's, the simplest plan; zero-bubble's split and
    # two chunks on one device only add work there: H200, D = 1, zb_h1 1.20x and interleaved 2.1x the plain
    # step where 1F1B was 1.05x)
    one = "1f1b" if "1f1b" in names else names[0]
    for f, t in model_axes:
        if devices % (f * t):
            continue
        rest = devices // (f * t)
        for D in [d for d in range(1, rest + 1) if rest % d == 0]:
            for name in names:
                for M in microbatches:
                    for res in residuals:
                        c = Candidate(name, D, rest // D, M, res, fsdp=f, tensor=t)
                        if rows % (c.data * f * M):
                            split = f"data={c.data} x fsdp={f}" if f > 1 else f"data={c.data}"
                            c.dropped = f"{rows} rows do not split into {split} x M={M} micro-batches"
                        elif D == 1 and name != one:
                            c.dropped = f"one stage: no pipeline, {one}'s candidate stands for it"
                        out.append(c)
    return out


def _model_axes(bench, devices: int, fsdp, tensor) -> List[Tuple[int, int]]:
    """The ``(fsdp, tensor)`` sizes to search: for an axis the model's ``param_specs`` name, ``None`` means
    every divisor of ``devices``; an axis they do not name is 1 (asking for more is an error: nothing would be
    sharded over it)."""
    named = bench.model_axis_names()
    sizes = []
    for axis, given in (("fsdp", fsdp), ("tensor", tensor)):
        if given is None:
            sizes.append([d for d in range(1, devices + 1) if devices % d == 0] if axis in named else [1])
            continue
        given = [int(v) for v in ((given,) if np.isscalar(given) else given)]
        if any(v < 1 for v in given):
            raise ConfigError(f"configure({axis}={given}): sizes are positive integers")
        if any(v > 1 for v in given) and axis not in named:
            raise ConfigError(
                f"configure({axis}={given}): the model's param_specs do not name the {axis!r} axis "
                f"(they name {sorted(named) or 'none'}), so no weight would be sharded over it; build "
                f"the model with specs over {axis!r} (e.g. jp.models.gpt(n, {axis}={axis!r})) or leave "
                f"{axis} at 1"
            )
        sizes.append(sorted(set(given)))
    return [(f, t) for f in sizes[0] for t in sizes[1] if devices % (f * t) == 0]


def _built(cands, bench, optimizer):
    """``({id(candidate): (pipe, footprint)}, {footprint family: [candidates]})``: every candidate not
    dropped built as a ``Pipeline``; one that cannot be built, or builds the same program as an earlier one,
    is dropped with its reason."""
    from ..pipeline import Pipeline

    built, fams, programs = {}, {}, {}
    for c in cands:
        if c.dropped:
            continue
        try:
            pipe = Pipeline(bench.model_for(c), optimizer=optimizer, **c.pipeline_kwargs())
        except (ConfigError, ValueError) as e:
            c.dropped = f"not buildable: {str(e).splitlines()[0][:80]}"
            continue
        same = programs.setdefault(_program_key(c, pipe), c)
        if same is not c:  # GPipe under lanes is 1F1B's plan: timing both measures noise, not a choice
            c.dropped = f"the same program as {same.schedule}'s (placement {pipe.placement})"
            continue
        fp = bench.footprint(c, pipe)
        c.placement = pipe.placement
        built[id(c)] = (pipe, fp)
        fams.setdefault(fp.family, []).append(c)
    return built, fams


def _predicted(cands, bench, optimizer, devices: int):
    """The candidates built (:func:`_built`), the memory model calibrated on them, and each one's step time
    and memory predicted (its compiled memory where measured); returns the built ones."""
    built, fams = _built(cands, bench, optimizer)
    model = _calibrate(fams, built, bench)
    _predict_times(cands, built, bench, devices)
    for c in cands:
        if id(c) in built:
            c.memory = c.compiled_memory if c.compiled_memory is not None else model.total(built[id(c)][1])
    return built


def configure(
    make_model: Callable[[int], object],
    batch: Dict[str, np.ndarray],
    optimizer,
    *,
    devices: int,
    memory_budget: float,
    schedules: Sequence[str] = ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b"),
    microbatches: Sequence[int] = (2, 4, 8),
    residuals: Sequence[str] = ("all", "inputs"),
    verbose: bool = True,
    cache="default",
    measure: int = 0,
    rounds: int = 3,
    min_time_s: float = MIN_TIME_S,
    balance_cut: bool = True,
    tensor=None,
    fsdp=None,
) -> Configuration:
    """The predicted-fastest configuration of a model on ``devices`` devices within a memory budget (module
    docstring).

    Every split of the devices into stage x data (x the model axes), schedule, micro-batch count and
    residual policy is predicted; the few that come first are compiled, and their memory checked against
    XLA's figure.

    Args:
        make_model: ``make_model(num_stages)`` -> a :class:`~jaxpipe.PipelineModel` of that many stages.
        batch: one step's host batch (its rows are split over ``data`` and the micro-batches).
        optimizer: the optax optimizer the pipeline will train with (its state counts in the memory).
        devices: how many devices the configuration may use.
        memory_budget: bytes a device may hold (``float("inf")``: no limit).
        schedules: the schedules considered.
        microbatches: the micro-batch counts considered.
        residuals: the residual policies considered (``"all"``, ``"inputs"``).
        verbose: print the candidates' table and the choice.
        cache: where measurements are kept per (model, backend): ``"default"`` (``$JAXPIPE_CACHE_DIR`` or
            ``~/.cache/jaxpipe``), a file path, or None (measure everything).
        measure: ``k`` > 0: the final choice is made by timing steps of at most ``k`` fitting candidates
            (the two predicted fastest and the predicted fastest of each stage count and residual policy),
            in turns, where the model's ranking is least sure.
        rounds: with ``measure``: at least this many rounds of 3 steps.
        min_time_s: with ``measure``: the fastest timed at least this many seconds in all.
        balance_cut: also each stage count's fastest fitting candidate with its cut balanced from measured
            costs, a candidate of its own (:mod:`jaxpipe.cuts.configure`; models of blocks only).
        tensor: the sizes of the ``tensor`` axis to search (default: every divisor of ``devices`` where the
            model's ``param_specs`` name the axis, else 1).
        fsdp: the sizes of the ``fsdp`` axis to search, as ``tensor``.

    Returns:
        A ``Configuration``: ``best`` (``jp.Pipeline(conf.model(), optimizer=...,
        **conf.best.pipeline_kwargs())`` builds it), the candidates with their predictions, and
        ``table()``.

    Raises:
        ConfigError: an argument out of range, naming it, or nothing fits the budget (each reason, with a
            count and an example)."""

    # every argument checked before anything is measured
    _check_inputs(make_model, batch, optimizer, devices, memory_budget)
    schedules, microbatches, residuals = _checked_space(schedules, microbatches, residuals)
    _check_timing(measure, rounds, min_time_s, cache)
    store = MeasureCache(default_path() if cache == "default" else cache)
    bench = Bench(make_model, batch, optimizer, store)
    cands = _candidates(
        devices, bench.rows, schedules, microbatches, residuals, _model_axes(bench, devices, fsdp, tensor)
    )
    built = _predicted(cands, bench, optimizer, devices)
    conf = _choose(cands, built, bench, memory_budget)
    conf._balance = balance_cut
    if balance_cut:
        balance_cuts(conf, memory_budget)
    if measure:
        conf.best = _measured_best(conf, measure, rounds, min_time_s)
    if verbose:
        print(conf.table(), flush=True)
        if conf.cut_note:
            print(f"cut: {conf.cut_note}", flush=True)
    return conf


def _names(what: str, given, allowed: Sequence[str], example: str) -> Tuple[str, ...]:
    """``given`` (a name or a sequence of names) as a tuple of names from ``allowed``, or a ConfigError."""
    names = (given,) if isinstance(given, str) else given
    try:
        names = tuple(names)
    except TypeError:
        raise ConfigError(
            f"configure({what}={given!r}): give a sequence of names, e.g. {what}={example}"
        ) from None
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise ConfigError(
            f"configure({what}={given!r}): {'nothing given' if not names else f'{bad[0]!r} is not one'}"
            f"; choose from {', '.join(map(repr, allowed))}, e.g. {what}={example}"
        )
    return tuple(dict.fromkeys(names))


def _check_inputs(make_model, batch, optimizer, devices, memory_budget) -> None:
    """:func:`configure`'s model, batch, optimizer, devices and budget checked before anything is measured: a
    ConfigError naming the value, why it cannot be taken and what would work."""
    from ..checks.values import is_int

    if not callable(make_model):
        raise ConfigError(
            f"configure(make_model={make_model!r}): give a function of the stage count that builds "
            f"the model, e.g. lambda n: jp.models.gpt(n)"
        )
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ConfigError(
            f"configure(optimizer={optimizer!r}): give an optax GradientTransformation, e.g. "
            f"optax.adamw(1e-3)"
        )
    leaves = jax.tree.leaves(batch)
    if not leaves or any(np.ndim(a) == 0 for a in leaves):
        raise ConfigError(
            "configure(batch=...): give one step's batch, e.g. {'x': array, 'y': array}, every "
            "field with the rows on its leading axis"
        )
    if not is_int(devices, 1) or devices > jax.device_count():
        raise ConfigError(
            f"configure(devices={devices!r}): give a device count from 1 to the "
            f"{jax.device_count()} device(s) JAX sees"
        )
    try:
        budget = float(memory_budget)
    except (TypeError, ValueError):
        budget = float("nan")
    if isinstance(memory_budget, bool) or not budget > 0:  # NaN, 0, negative, not a number
        raise ConfigError(
            f"configure(memory_budget={memory_budget!r}): give the bytes a device may hold, a "
            f"positive number (e.g. 16 * 2**30; float('inf') for no limit)"
        )


def _checked_space(schedules, microbatches, residuals) -> Tuple[tuple, tuple, tuple]:
    """:func:`configure`'s search space as tuples (schedules, micro-batch counts, residual policies), each
    checked: a ConfigError naming the value and what would work."""
    from ..checks.values import is_int

    flushing = [n for n in _schedules.available() if _schedules.method(n).flushes]
    schedules = _names("schedules", schedules, flushing, "('1f1b', 'zb_h1')")
    counts = (microbatches,) if is_int(microbatches) else microbatches
    try:
        counts = tuple(counts)
    except TypeError:
        counts = (microbatches,)
    if not counts or not all(is_int(m, 1) for m in counts):
        raise ConfigError(
            f"configure(microbatches={microbatches!r}): give positive micro-batch counts, e.g. "
            f"microbatches=(2, 4, 8)"
        )
    residuals = _names("residuals", residuals, ("all", "inputs"), "('all', 'inputs')")
    return schedules, tuple(dict.fromkeys(counts)), residuals


def _check_timing(measure, rounds, min_time_s, cache) -> None:
    """:func:`configure`'s timing and cache arguments checked: a ConfigError naming the value."""
    from ..checks.values import is_int

    for name, value, low in (("measure", measure, 0), ("rounds", rounds, 1)):
        if not is_int(value, low):
            raise ConfigError(f"configure({name}={value!r}): give an integer >= {low}")
    if not (isinstance(min_time_s, (int, float)) and 0 <= min_time_s < float("inf")):
        raise ConfigError(f"configure(min_time_s={min_time_s!r}): give seconds >= 0")
    if not (cache in ("default", None) or isinstance(cache, (str, os.PathLike))):
        raise ConfigError(
            f"configure(cache={cache!r}): give 'default', a file path, or None (measure everything)"
        )


def _program_key(c, pipe) -> tuple:
    """What the executor compiles for ``pipe``: the split, M, policy, the lane plan it runs and the schedule's
    options the executor reads.  Two candidates with the same key are one program."""
    from ..schedules.layout import exchange_perms, stream_options

    p = pipe.lane_plan
    plan = (
        p.lanes,
        tuple(map(tuple, p.phases)),
        p.stash_capacity,
        p.front_capacity,
        p.direct,
        p.table.tobytes(),
        p.table.shape,
    )
    return (
        c.model_stages,
        c.stages,
        c.data,
        c.model_axes,
        c.microbatches,
        c.residuals,
        pipe.schedule.has_w(),
        plan,
        tuple(sorted(stream_options(pipe.schedule).items())),
        exchange_perms(pipe.schedule) is None,
    )


def _calibrate(fams, built, bench) -> MemoryModel:
    """Each family's line ``temp = a * working + b`` (:mod:`.memory`).  The slope ``a`` is the residual
    policy's (how many working-set-sized buffers its programs keep: the guide's configure search, 1.44-1.60
    under ``"all"``, 0.88-1.04 under recomputing policies, whatever the split or chunks): it is fitted on one
    family of each policy -- the one with the most candidates -- from two compiles at its two most different
    micro-batch sizes, and every other family of that policy takes it with one compile of its own for ``b``
    (at its largest working set, where a budget bites first).  All compiles at once, two side by side; from
    the cache where measured before.  The choice and the runner-up are compiled again if not among these
    (:func:`_checked_best`)."""
    work = lambda c: built[id(c)][1].working
    kind = lambda fam: (fam[0],) + tuple(fam[3:])  # the policy, and the model axes (sharded residuals)
    anchors = {}
    for fam, cs in fams.items():
        best = anchors.get(kind(fam))
        if best is None or len(cs) > len(fams[best]):
            anchors[kind(fam)] = fam
    points = {}
    for fam, cs in fams.items():
        by_work = sorted(cs, key=work)
        pts = [by_work[-1], by_work[0]] if anchors[kind(fam)] == fam else [by_work[-1]]
        points[fam] = list({id(c): c for c in pts}.values())
    bench.compile_memory([(c, built[id(c)][0]) for cs in points.values() for c in cs])
    model = MemoryModel({})
    xy = lambda c: (built[id(c)][1], c.compiled_memory - built[id(c)][1].state)
    for fam in sorted(points, key=lambda f: anchors[kind(f)] != f):  # anchors first: their slopes are shared
        pts = [xy(c) for c in points[fam]]
        if len(pts) == 2 and pts[0][0].working != pts[1][0].working:
            model = calibrate(pts, model)
        else:
            a = model.lines.get(anchors[kind(fam)], (0.0, 0.0))[0] if anchors[kind(fam)] != fam else 0.0
            fp, y = pts[0]
            model.lines[fam] = (a, float(y - fp.known - a * fp.working))
    return model


def _choose(cands, built, bench, budget) -> Configuration:
    for c in cands:
        if id(c) in built and not c.dropped and c.memory > budget:
            c.dropped = f"needs {c.memory / 2**20:,.1f} MiB a device > the budget {budget / 2**20:,.1f}"
    return Configuration(_checked_best(cands, built, bench, budget), cands, budget, built, bench)


def _checked_best(cands, built, bench, budget) -> Candidate:
    """The fastest fitting candidate, its prediction and the runner-up's checked by compiling (module
    docstring)."""
    while True:
        ok = sorted((c for c in cands if not c.dropped), key=lambda c: c.step_s)
        if not ok:
            raise ConfigError(nothing_fits(cands, budget))
        check = [c for c in ok[:2] if c.compiled_memory is None]
        bench.compile_memory([(c, built[id(c)][0]) for c in check])
        redo = False
        for c in check:
            if abs(c.compiled_memory - c.memory) > CHECK_TOLERANCE * c.compiled_memory:
                redo = True
            c.memory = c.compiled_memory
            if c.memory > budget:
                c.dropped = f"compiled: {c.memory / 2**20:,.1f} MiB a device > the budget"
                redo = True
        if not redo:
            return ok[0]


def nothing_fits(cands, budget: float) -> str:
    """Why no candidate is left: each reason once, with how many candidates it dropped and an example, and the
    smallest memory need where candidates were measured."""
    measured = [c.memory for c in cands if not np.isnan(c.memory)]
    need = f"; the smallest needs {min(measured) / 2**20:,.1f} MiB a device" if measured else ""
    by_reason: Dict[str, List[Candidate]] = {}
    for c in cands:
        over = c.dropped.startswith(("needs", "compiled"))
        by_reason.setdefault("over the budget" if over else c.dropped, []).append(c)
    shown = list(by_reason.items())[:6]
    why = "; ".join(f"{len(cs)} x {reason} (e.g. {cs[0].label()})" for reason, cs in shown)
    why += f"; and {len(by_reason) - len(shown)} other reason(s)" if len(by_reason) > len(shown) else ""
    return (
        f"no configuration fits {budget / 2**20:,.1f} MiB a device{need}. Dropped: {why or 'no candidates'}. "
        "Raise the budget, add devices, or allow more micro-batches / residuals='inputs'; micro-batch "
        "counts "
        f"must divide the batch's rows over the data replicas"
    )


def _predict_times(cands, built, bench, devices) -> None:
    """Each built candidate's predicted step and bubble (module docstring): one stage's costs per micro-batch
    size and policy, timed on the finest cut of the search and scaled (:meth:`Bench.stage_costs`)."""
    link = Link(*bench.link(devices)) if devices > 1 else Link(0.0, 0.0)
    pipes = {(c.model_stages, c.residuals, c.model_axes): built[id(c)][0] for c in cands if id(c) in built}
    finest = {}
    for n, res, axes in pipes:
        finest[(res, axes)] = max(finest.get((res, axes), 0), n)
    for c in cands:
        if id(c) not in built:
            continue
        pipe, fp = built[id(c)]
        rows = bench.rows // (c.data * c.microbatches)
        lc, act = bench.stage_costs(
            finest[(c.residuals, c.model_axes)],
            c.model_stages,
            c.residuals,
            rows,
            pipe.schedule.has_w(),
            lambda n, res: pipes[(n, res, c.model_axes)],
            axes=c.model_axes,
        )
        rendezvous = 0.0  # a tick's price beyond its message (tensor and FSDP axes: not measured)
        if c.stages > 1 and tuple(c.model_axes) == (1, 1):
            n_finest = finest[(c.residuals, c.model_axes)]
            price = bench.tick(n_finest, rows, c.stages, lambda n: pipes[(n, c.residuals, c.model_axes)])
            rendezvous = max(price - link(act), 0.0)
        # the embedding and the head as one device runs them: FSDP splits their rows (tensor: timed whole)
        parts = predict_devices(
            pipe.schedule,
            lc,
            1.0,
            0.0,
            link,
            act,
            0.0,
            placement=pipe.placement,
            edges=bench.edges(max(rows // c.fsdp, 1)),
            rendezvous=rendezvous,
        )
        # the data replicas' gradient all-reduce after the pipeline, its leaves as the step has them
        allreduce = bench.allreduce(c, pipe, devices) if c.data > 1 else 0.0
        update = bench.update(c, pipe)
        c.step_s = parts["step"] + allreduce + update
        c.bubble = 1.0 - parts["busy"] / max(parts["compute"], 1e-30)


def _measured_best(conf: Configuration, k: int, rounds: int, min_time_s: float = MIN_TIME_S) -> Candidate:
    """The fastest measured of at most ``k`` fitting candidates: the two predicted fastest, then the predicted
    fastest of each (stage count, model axes, residual policy) group.  Each is built, warmed up (2 steps) and
    timed in turns with the others, the median of the rounds of 3 steps: at least ``rounds`` rounds, and
    enough that the fastest candidate is timed for ``min_time_s`` (:func:`_rounds_for`; on 12-ms steps three
    rounds were too few: one candidate timed 1.33x its own speed, and the pick lost 24%).  In a multi-process
    job the times and the round count are process 0's (every process then builds and steps the same)."""
    from ..pipeline import Pipeline

    ok = sorted((c for c in conf.candidates if not c.dropped), key=lambda c: c.step_s)
    group = lambda c: (c.stages, c.model_axes, c.residuals)
    pick, seen = ok[:2], {group(c) for c in ok[:2]}
    for c in ok[2:]:
        if group(c) not in seen:
            pick.append(c)
            seen.add(group(c))
    pick = pick[: max(k, 1)]
    bench, runs = conf._bench, []
    for c in pick:
        pipe = Pipeline(bench.model_for(c), optimizer=bench.optimizer, **c.pipeline_kwargs())
        b = pipe.shard_batch(bench.batch)
        s = pipe.init()
        for _ in range(2):
            s = pipe.step(s, b)[0]
        runs.append([pipe, b, jax.block_until_ready(s), []])
    _time_round(runs)
    total = _rounds_for(min(agreed([r[3][0] for r in runs])), rounds, min_time_s)
    for _ in range(total - 1):
        _time_round(runs)
    times = agreed([float(np.median(r[3])) for r in runs])
    for c, t in zip(pick, times):
        c.measured_s = t
    return min(pick, key=lambda c: c.measured_s)


def _time_round(runs, steps: int = 3) -> None:
    """One round: each run's ``steps`` steps in turn, its mean step time appended to its list."""
    for run in runs:
        pipe, b, s, ts = run
        t0 = time.perf_counter()
        for _ in range(steps):
            s = pipe.step(s, b)[0]
        run[2] = jax.block_until_ready(s)
        ts.append((time.perf_counter() - t0) / steps)


def _rounds_for(
    fastest_s: float, rounds: int, min_time_s: float, steps: int = 3, most: int = MAX_ROUNDS
) -> int:
    """Rounds of ``steps`` steps so that a candidate stepping in ``fastest_s`` is timed ``min_time_s`` in all:
    at least ``rounds``, at most ``most``."""
    need = int(np.ceil(min_time_s / max(fastest_s * steps, 1e-9)))
    return int(min(max(rounds, need), max(most, rounds)))
