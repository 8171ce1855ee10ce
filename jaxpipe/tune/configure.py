"""Automatic configuration, first version (issue #53): from a model, a device count and a memory budget to the
predicted-fastest pipeline that fits.

:func:`configure` considers every split of the devices into ``stage`` x ``data``, every schedule given, every
micro-batch count and residual policy, and for each predicts

* **memory per device** with :mod:`jaxpipe.tune.memory`: the state exact, the temp from the plan's stash slots
  and the stage's residuals, the lines calibrated on two compiles per family (residual policy, split
  backward, chunks per device); the chosen candidate and the runner-up are then compiled, and where XLA's
  figure differs from the prediction by over 10% the choice is made again on the compiled figure;
* **step time** with :func:`jaxpipe.tune.lockstep.predict_devices`: the plan the executor compiles, tick by
  tick, at one stage's F, B and W measured on this backend per micro-batch size and residual policy
  (:func:`jaxpipe.tune.microbench.layer_costs` on the stage as the executor runs it: a recomputing policy's
  pullback reruns the forward), the exchange's cost measured here
  (:func:`jaxpipe.tune.microbench.p2p_alpha_beta`), and the data replicas' gradient all-reduce
  (:func:`jaxpipe.tune.microbench.allreduce_alpha_beta`, Rabenseifner's model).

It returns a :class:`Configuration`: the choice (``Pipeline`` keyword arguments and the mesh), every candidate
with its predicted step, bubble, memory and why a candidate was dropped, and :meth:`Configuration.table`.
Not yet (issue #53): tensor / FSDP axes, a per-stage cut or per-stage policy, the two-process check of the
choice against the fastest measured candidate, a cache of the measurements, a decision under a minute (36
candidates of a 4-device GPT took 373 s on the 2-core build machine: every candidate's ``Pipeline`` is built
and initialised, and two compiles a family calibrate the memory lines).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

import jax
import numpy as np

from .. import schedules as _schedules
from ..errors import ConfigError
from .lockstep import LayerCosts, Link, predict_devices
from .memory import MemoryModel, calibrate, compiled, footprint, tree_bytes

CHECK_TOLERANCE = 0.10


@dataclasses.dataclass
class Candidate:
    schedule: str
    stages: int
    data: int
    microbatches: int
    residuals: str
    step_s: float = float("nan")
    bubble: float = float("nan")
    memory: float = float("nan")           # bytes per device, predicted (or compiled, once checked)
    compiled_memory: Optional[float] = None
    dropped: str = ""

    def pipeline_kwargs(self) -> dict:
        """What to give ``jp.Pipeline`` (with the model cut into :meth:`model_stages` stages)."""
        from ..runtime.mesh import make_mesh
        return {"schedule": self.schedule, "num_microbatches": self.microbatches, "residuals": self.residuals,
                "mesh": make_mesh(stages=self.stages, data=self.data),
                "options": self._options()}

    def _options(self) -> dict:
        """Two model chunks a device where the method stacks chunks (interleaved's ``virtual``), as the search
        in :mod:`.search` uses it."""
        return {"virtual": 2} if "virtual" in _schedules.method(self.schedule).options else {}

    @property
    def model_stages(self) -> int:
        per = _schedules.method(self.schedule).stages_per_device(self._options())
        return self.stages * per

    def label(self) -> str:
        return f"{self.schedule} stage={self.stages} data={self.data} M={self.microbatches} residuals={self.residuals}"


@dataclasses.dataclass
class Configuration:
    best: Candidate
    candidates: List[Candidate]
    budget: float
    _built: dict = dataclasses.field(default_factory=dict, repr=False)
    _batch: dict = dataclasses.field(default_factory=dict, repr=False)

    def within(self, memory_budget: float) -> "Configuration":
        """The choice under another budget, from the same predictions (compiling only what the check needs)."""
        cands = [dataclasses.replace(c) for c in self.candidates]
        built = {id(n): self._built[id(o)] for o, n in zip(self.candidates, cands) if id(o) in self._built}
        for c in cands:
            if c.dropped.startswith(("needs", "compiled")):
                c.dropped = ""
        return _choose(cands, built, self._batch, memory_budget)

    def table(self) -> str:
        """The candidates, fitting ones fastest first, then the dropped ones with why."""
        ok = sorted((c for c in self.candidates if not c.dropped), key=lambda c: c.step_s)
        rows = ["| candidate | predicted step | bubble | memory / device | compiled | note |", "|---|---|---|---|---|---|"]
        for c in ok + [c for c in self.candidates if c.dropped]:
            comp = "" if c.compiled_memory is None else f"{c.compiled_memory / 2**20:,.1f} MiB"
            note = c.dropped or ("chosen" if c is self.best else "")
            step = "" if np.isnan(c.step_s) else f"{c.step_s * 1e3:.2f} ms"
            bub = "" if np.isnan(c.bubble) else f"{c.bubble:.0%}"
            mem = "" if np.isnan(c.memory) else f"{c.memory / 2**20:,.1f} MiB"
            rows.append(f"| {c.label()} | {step} | {bub} | {mem} | {comp} | {note} |")
        return "\n".join(rows)


def _candidates(devices, rows, names, microbatches, residuals) -> List[Candidate]:
    out = []
    for D in [d for d in range(1, devices + 1) if devices % d == 0]:
        for name in names:
            for M in microbatches:
                for res in residuals:
                    c = Candidate(name, D, devices // D, M, res)
                    if rows % (c.data * M):
                        c.dropped = f"{rows} rows do not split into data={c.data} x M={M} micro-batches"
                    out.append(c)
    return out


def configure(make_model: Callable[[int], object], batch: Dict[str, np.ndarray], optimizer, *, devices: int,
              memory_budget: float, schedules: Sequence[str] = ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b"),
              microbatches: Sequence[int] = (2, 4, 8), residuals: Sequence[str] = ("all", "inputs"),
              verbose: bool = True) -> Configuration:
    """The predicted-fastest configuration of ``make_model(num_stages)`` (a ``PipelineModel`` of that many
    stages) on ``devices`` devices within ``memory_budget`` bytes per device (module docstring).  ``batch``:
    one step's host batch (its rows are split over ``data`` and micro-batches)."""
    from ..pipeline import Pipeline
    rows = int(jax.tree.leaves(batch)[0].shape[0])
    cands = _candidates(devices, rows, schedules, microbatches, residuals)
    built, fams = {}, {}
    for c in cands:
        if c.dropped:
            continue
        try:
            pipe = Pipeline(make_model(c.model_stages), optimizer=optimizer, **c.pipeline_kwargs())
        except (ConfigError, ValueError) as e:
            c.dropped = f"not buildable: {str(e).splitlines()[0][:80]}"
            continue
        state = pipe.init()
        fp = footprint(pipe, batch, state)
        built[id(c)] = (pipe, state, fp)
        fams.setdefault(fp.family, []).append(c)
    model = MemoryModel({})
    for fam, cs in fams.items():      # two compiles a family, at its two most different micro-batch sizes
        by_work = sorted(cs, key=lambda c: built[id(c)][2].working)
        pts = []
        for c in {id(by_work[0]): by_work[0], id(by_work[-1]): by_work[-1]}.values():
            pipe, state, fp = built[id(c)]
            c.compiled_memory = compiled(pipe, batch, state)["total"]
            pts.append((fp, c.compiled_memory - fp.state))
        if len(pts) == 2 and pts[0][0].working != pts[1][0].working:
            model = calibrate(pts, model)
        else:
            model.lines[fam] = (0.0, float(pts[0][1] - pts[0][0].stash))
    _predict_times(cands, built, batch, devices)
    for c in cands:
        if id(c) in built:
            c.memory = c.compiled_memory if c.compiled_memory is not None else model.total(built[id(c)][2])
    conf = _choose(cands, built, batch, memory_budget)
    if verbose:
        print(conf.table(), flush=True)
    return conf


def _choose(cands, built, batch, budget) -> Configuration:
    for c in cands:
        if id(c) in built and not c.dropped and c.memory > budget:
            c.dropped = f"needs {c.memory / 2**20:,.1f} MiB a device > the budget {budget / 2**20:,.1f}"
    return Configuration(_checked_best(cands, built, batch, budget), cands, budget, built, batch)


def _checked_best(cands, built, batch, budget) -> Candidate:
    """The fastest fitting candidate, its prediction and the runner-up's checked by compiling (module docstring)."""
    while True:
        ok = sorted((c for c in cands if not c.dropped), key=lambda c: c.step_s)
        if not ok:
            raise ConfigError(f"no configuration fits {budget / 2**20:,.1f} MiB a device; the smallest needs "
                              f"{min(c.memory for c in cands if not np.isnan(c.memory)) / 2**20:,.1f} MiB: raise the "
                              f"budget, add devices, or allow more micro-batches / residuals='inputs'")
        redo = False
        for c in ok[:2]:
            if c.compiled_memory is None:
                pipe, state, _ = built[id(c)]
                c.compiled_memory = compiled(pipe, batch, state)["total"]
                if abs(c.compiled_memory - c.memory) > CHECK_TOLERANCE * c.compiled_memory:
                    redo = True
                c.memory = c.compiled_memory
                if c.memory > budget:
                    c.dropped = f"compiled: {c.memory / 2**20:,.1f} MiB a device > the budget"
                    redo = True
        if not redo:
            return ok[0]


def _predict_times(cands, built, batch, devices) -> None:
    """Each built candidate's predicted step and bubble (module docstring); costs measured per micro-batch size."""
    from .microbench import allreduce_alpha_beta, p2p_alpha_beta
    alpha, beta = p2p_alpha_beta(devices) if devices > 1 else (0.0, 0.0)
    link = Link(alpha, beta)
    per_size, reduce = {}, {}
    for c in cands:
        if id(c) not in built:
            continue
        pipe, _, fp = built[id(c)]
        if c.data not in reduce:
            reduce[c.data] = allreduce_alpha_beta(devices, group=c.data) if c.data > 1 else (0.0, 0.0)
        rows = int(jax.tree.leaves(batch)[0].shape[0]) // (c.data * c.microbatches)
        key = (c.model_stages, c.residuals, rows, pipe.schedule.has_w())
        if key not in per_size:
            per_size[key] = _stage_costs(pipe.model, batch, rows, key[-1])
        lc, act = per_size[key]
        # the stage as the executor runs it: a recomputing policy's backward reruns the forward in its pullback
        parts = predict_devices(pipe.schedule, lc, 1.0, 0.0, link, act, 0.0, placement=pipe.placement)
        # the data replicas' gradient all-reduce after the pipeline (Rabenseifner's model, measured here)
        a, b = reduce[c.data]
        r = c.data
        m = pipe.model
        grads = tree_bytes((m.stage_params, m.pre_params, m.post_params)) / c.stages
        allreduce = (2 * np.log2(r) * a + 2 * (r - 1) / r * b * grads) if r > 1 else 0.0
        c.step_s, c.bubble = parts["step"] + allreduce, 1.0 - parts["busy"] / max(parts["compute"], 1e-30)



def _stage_costs(m, batch, rows, split):
    """(one stage's F and B on a micro-batch of ``rows`` rows measured here -- B's input and weight parts too
    where the schedule splits it -- ; the activation's bytes)."""
    from .microbench import op_costs
    mb = jax.tree.map(lambda a: np.asarray(a[:rows]), batch)
    x = m.pre(m.pre_params, mb)
    w = jax.tree.map(lambda a: a[0], m.stage_params)
    ctx = m.example_context(mb)
    fn = (lambda w, h: m.stage_fn(w, h, ctx)) if m.context else m.stage_fn
    act = tree_bytes(x)
    whole = op_costs(fn, w, x, 1, [1])
    f, b = whole["F"][0], whole["B"][0]
    b_in = op_costs(fn, w, x, 1, [1], split=True)["B"][0] if split else b / 2
    return LayerCosts(f=f, b=b, b_input=b_in, w=max(b - b_in, 0.0)), act
