"""A pipeline's memory per device, predicted without compiling and calibrated on a few compiles (the
first part of automatic configuration).

What a compiled step holds per device (XLA's ``memory_analysis()``; BUILD_NOTES, "Choosing a configuration";
32 configurations of a GPT): its **arguments** (the stage's parameters, the optimizer
state, the batch's share -- known exactly before compiling, from the state's own shards) and its **temp**,
which is

    temp = stash slots x R + frontier slots + a x R_all + b

with ``R`` the residual bytes one micro-batch leaves in the stash under the residual policy (the plan's
``stash_capacity`` slots; none where the plan hands them over directly), ``R_all`` the residual bytes of one
micro-batch through one chunk with every residual kept (the backward's working set: a recomputing policy
rebuilds them during B), zero-bubble's frontier slots where they are buffers of their own
(:func:`frontier_bytes`), and ``a``, ``b`` fitted per *family* -- residual policy, split backward or not,
chunks per device; a one-stage plan that hands its residuals straight to B (``"direct"``) is a family of its
own -- on two compiles at different micro-batch sizes (:func:`calibrate`). Measured there: a line through 1F1B
at D = 2, M = 4 and 8 predicts D = 4, M = 4 and 8 within 1%; the families differ (a 1.1 for 1F1B with every
residual kept, 0.9 recomputing).

:func:`footprint` needs no compile (the plan, the stage's residual avals, the state's shards);
:func:`compiled` compiles the step and reads XLA's figures -- what a configuration search checks its choice
and runner-up against.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Sequence, Tuple

import jax
import numpy as np

from ..jax_internals import hoisted_constant_bytes


def tree_bytes(tree) -> int:
    """Bytes of every array (or aval) in a pytree."""
    return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def _all_residuals(stage_fn):
    """The stage function under the ``"all"`` policy: ``jax.checkpoint``'s wrapped function, or the stage
    that :class:`~jaxpipe.runtime.residuals.RecomputedAtForwardWeights` reruns."""
    inner = getattr(stage_fn, "__wrapped__", None) or getattr(stage_fn, "stage_fn", None)
    return stage_fn if inner is None else _all_residuals(inner)


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes per device of a built ``Pipeline`` on a batch, from its plan and avals (no compile).
    ``family``: what the calibration is per -- (residual policy, split backward, chunks per device[, the model
    axes' sizes])."""

    family: tuple
    state: int  # the arguments: parameters, optimizer state and the batch's share on one device
    stash: int  # stash slots x R
    residuals: int  # R: one micro-batch's stashed residuals through one chunk under the policy
    working: int  # R_all: the same with every residual kept
    frontier: int = 0  # zero-bubble's frontier slots in buffers of their own (not packed into the stash)

    @property
    def known(self) -> int:
        """The temp known before compiling: the stash slots and the frontier slots.  (Several chunks a device
        added two of the device's stage bytes until their state held each chunk apart: none now.)"""
        return self.stash + self.frontier


def footprint(
    pipe, batch, state=None, *, known_state=None, known_residuals=None, known_frontier=None, axes: tuple = ()
) -> Footprint:
    """The :class:`Footprint` of ``pipe`` (a synchronous, flushing ``Pipeline``) on ``batch`` (host arrays,
    the whole step's rows); ``state``: ``pipe.init()``'s (made here when not given).  ``known_state`` /
    ``known_residuals`` / ``known_frontier``: :func:`state_bytes` / :func:`residual_bytes` /
    :func:`frontier_bytes` already known (a search shares them between candidates of the same split and
    micro-batch size); ``axes``: added to the family (the model axes' sizes: sharded residuals, a line of
    their own)."""
    if not pipe.method.flushes or pipe.lane_plan is None:
        raise ValueError(
            f"footprint() models a flushing schedule's lane plan; {pipe.schedule.name} keeps "
            f"micro-batches in flight between steps (measure it with compiled())"
        )
    data = max(pipe.data_parallel, 1)
    if known_state is None:
        known_state = state_bytes(pipe.init() if state is None else state)
    on_device = known_state + tree_bytes(batch) // data
    rows = jax.tree.leaves(batch)[0].shape[0] // (pipe.num_microbatches * data)
    r_pol, r_all = known_residuals or residual_bytes(pipe.model, batch, rows)
    plan = pipe.lane_plan
    slots = 0 if plan.direct else plan.stash_capacity
    chunks = pipe.schedule.num_model_stages // pipe.schedule.D
    # a plan that hands the residuals straight to B (one stage: no stash) is a family of its own, whatever the
    # policy: its temp is the backward's working set alone (the guide's configure search: a line through one
    # such point and one pipelined one predicted the others up to 83% off)
    policy = "direct" if plan.direct else "all" if r_pol == r_all else "recompute"
    front = 0
    if pipe.schedule.has_w() and not plan.direct:
        front = (
            frontier_bytes(pipe.model, batch, rows, plan.front_capacity)
            if known_frontier is None
            else known_frontier
        )
    return Footprint(
        (policy, pipe.schedule.has_w(), chunks) + tuple(axes), on_device, slots * r_pol, r_pol, r_all, front
    )


def state_bytes(state) -> int:
    """Bytes of one device's shards of an initialised pipeline state (XLA's ``argument_size_in_bytes`` of a
    step less the batch)."""
    shard = lambda a: (
        int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
        if hasattr(a, "sharding")
        else np.asarray(a).nbytes
    )
    return int(sum(shard(a) for a in jax.tree.leaves(state)))


def _stage_inputs(model, batch, rows: int):
    """Zeros of one stage's weights, activation and micro-batch of ``rows`` rows (host arrays, for
    tracing)."""
    from ..runtime.buffers import host_zeros

    mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows,) + tuple(a.shape[1:]), a.dtype), batch)
    x = jax.eval_shape(model.pre, model.pre_params, mb)
    w = host_zeros(jax.eval_shape(lambda p: jax.tree.map(lambda a: a[0], p), model.stage_params))
    return w, host_zeros(x), host_zeros(mb)


def frontier_bytes(model, batch, rows: int, slots: int) -> int:
    """Zero-bubble's frontier slots in buffers of their own for a plan of ``slots`` frontier slots
    (:func:`jaxpipe.runtime.wsplit.frontier_slot_bytes`; 0 where W recomputes or the frontier is packed)."""
    from ..runtime.wsplit import frontier_slot_bytes

    return frontier_slot_bytes(model, *_stage_inputs(model, batch, rows), slots)


def residual_bytes(model, batch, rows: int) -> Tuple[int, int]:
    """``(R, R_all)``: one micro-batch of ``rows`` rows' stashed residual bytes through one stage of ``model``
    under its residual policy, and with every residual kept."""
    from ..runtime.stage import stage_residuals

    w, x0, mb0 = _stage_inputs(model, batch, rows)
    r_pol = tree_bytes(stage_residuals(model, w, x0, mb0)[1])
    full = dataclasses.replace(model, stage_fn=_all_residuals(model.stage_fn))
    return r_pol, tree_bytes(stage_residuals(full, w, x0, mb0)[1])


def residual_bytes_on(model, batch, rows: int, mesh, w_specs, batch_spec) -> Tuple[int, int]:
    """:func:`residual_bytes` per device where a stage's weights are sharded over model axes: ``mesh`` (the
    model axes), ``w_specs`` (a PartitionSpec per leaf of one stage's weights), ``batch_spec`` (the
    micro-batch's and the activation's, e.g. ``P("fsdp")`` where FSDP splits the batch).  The residuals'
    shards are what XLA's sharding propagation gives a compiled forward's outputs (a compile of one stage's
    forward per policy)."""
    from jax.sharding import NamedSharding
    from ..runtime.stage import StageOps

    w, x0, mb0 = _stage_inputs(model, batch, rows)
    on = lambda spec: NamedSharding(mesh, spec)
    w_sh = jax.tree.map(on, w_specs, is_leaf=lambda a: isinstance(a, jax.sharding.PartitionSpec))
    b_sh = lambda t: jax.tree.map(lambda a: on(batch_spec if np.ndim(a) else jax.sharding.PartitionSpec()), t)

    def per_device(m):
        def residuals(w, x, mb):
            sop, _ = StageOps.build(m, w, x, mb)
            return sop.forward(w, x, context=m.example_context(mb))[1]

        # shapes with their shardings, not host arrays: the mesh may span processes
        sds = lambda t, sh: jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s), t, sh
        )
        out = jax.jit(residuals).lower(sds(w, w_sh), sds(x0, b_sh(x0)), sds(mb0, b_sh(mb0))).compile()
        shapes = jax.eval_shape(residuals, w, x0, mb0)
        return int(
            sum(
                int(np.prod(sh.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
                for a, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(out.output_shardings))
            )
        )

    full = dataclasses.replace(model, stage_fn=_all_residuals(model.stage_fn))
    return per_device(model), per_device(full)


def compiled(pipe, batch, state=None) -> Dict[str, int]:
    """XLA's figures for ``pipe``'s compiled step, per device: ``temp``, ``arguments``, ``outputs``, ``alias``
    and ``total`` (arguments + temp + outputs not aliased to an argument); ``constants``: the part of
    ``arguments`` that is the program's own constants, hoisted by JAX into arguments (the plan's tables over
    1 KiB on jax >= 0.11; 0 on 0.10: :func:`jaxpipe.jax_internals.hoisted_constant_bytes`), so that
    ``arguments - constants`` is the state and the batch's share (:attr:`Footprint.state`)."""
    state = pipe.init() if state is None else state
    lowered = pipe.lower("step", state, pipe.shard_batch(batch))
    ma = memory_analysis(lowered)
    out = {
        "constants": hoisted_constant_bytes(lowered),
        "temp": ma.temp_size_in_bytes,
        "arguments": ma.argument_size_in_bytes,
        "outputs": ma.output_size_in_bytes,
        "alias": ma.alias_size_in_bytes,
    }
    out["total"] = memory_total(ma)
    return out


#: compiler options for a program compiled only for its memory figures, per platform: on CPU the backend's
#: (LLVM's) optimisation off and the fusion kernels from XLA's LLVM IR emitters instead of its MLIR ones --
#: XLA assigns the buffers before either runs, so ``memory_analysis()`` is the same (the older emitters'
#: kernels keep a few hundred bytes more scratch: 320 of 1.27 MB in tests/test_memory_model.py) and the
#: compile shorter (GPT d 32 steps on 4 CPU devices: 3.2-3.4 -> 2.4-2.6 s for the first, a third less again
#: for the second, BUILD_NOTES).  Elsewhere the default options (not measured there).
FIGURES_ONLY_OPTIONS = {"cpu": {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}}
#: options a jaxlib may not have (0.12 has only the MLIR emitters): dropped where the compile refuses them
OPTIONAL_OPTIONS = ("xla_cpu_use_fusion_emitters",)
_refused = set()


def memory_analysis(lowered):
    """XLA's ``memory_analysis()`` of ``lowered`` (a ``jax.stages.Lowered``), compiled for its figures only
    (:data:`FIGURES_ONLY_OPTIONS`): the compiled program is not kept."""
    opts = {k: v for k, v in FIGURES_ONLY_OPTIONS.get(jax.default_backend(), {}).items() if k not in _refused}
    try:
        return (lowered.compile(opts) if opts else lowered.compile()).memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        bad = [k for k in OPTIONAL_OPTIONS if k in opts and f"'{k}'" in str(e)]
        if not bad:
            raise
        _refused.update(bad)
        return memory_analysis(lowered)


def memory_total(ma) -> int:
    """Bytes per device of a compiled program's ``memory_analysis()``: arguments + temp + the outputs not
    aliased to an argument."""
    return int(
        ma.argument_size_in_bytes
        + ma.temp_size_in_bytes
        + max(ma.output_size_in_bytes - ma.alias_size_in_bytes, 0)
    )


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """``temp = stash + a x working + b`` per family (module docstring), fitted by :func:`calibrate`."""

    lines: Dict[Tuple[str, bool, int], Tuple[float, float]]

    def temp(self, fp: Footprint) -> float:
        if fp.family not in self.lines:
            raise KeyError(
                f"no calibration for the family {fp.family} (residual policy, split backward, "
                f"chunks per device); calibrate on two of its configurations first"
            )
        a, b = self.lines[fp.family]
        return fp.known + a * fp.working + b

    def total(self, fp: Footprint) -> float:
        """Bytes per device: the arguments and the predicted temp."""
        return fp.state + self.temp(fp)


def calibrate(points: Sequence[Tuple[Footprint, int]], model: MemoryModel = None) -> MemoryModel:
    """Fit ``a``, ``b`` per family from ``(footprint, compiled temp)`` points (at least two per family, at
    different ``working``: two micro-batch sizes); ``model``: lines kept for other families."""
    lines = dict(model.lines) if model is not None else {}
    fams = {}
    for fp, temp in points:
        fams.setdefault(fp.family, []).append((fp.working, temp - fp.known))
    for fam, pts in fams.items():
        xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
        if len(pts) < 2 or np.ptp(xs) == 0:
            raise ValueError(
                f"calibrating {fam} needs two configurations whose micro-batches differ in size "
                f"(working set {sorted(set(xs.tolist()))} bytes)"
            )
        a, b = np.polyfit(xs, ys, 1)
        lines[fam] = (float(a), float(b))
    return MemoryModel(lines)
