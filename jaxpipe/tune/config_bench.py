"""What :func:`jaxpipe.tune.configure.configure` measures, each thing once.

A search over stage x data splits, schedules, micro-batch counts and residual policies needs, per candidate,
its state's bytes, one micro-batch's residual bytes, a stage's F / B and, for a few, XLA's compiled memory.
Most candidates share them: the state depends on the split and the cut only, the residuals and op costs on the
micro-batch size and policy only.  :class:`Bench` computes each of them once, keeps them in a
:class:`~jaxpipe.tune.measure_cache.MeasureCache` keyed by (model, backend), and times one stage only: the cut
with the most stages of the search, scaled to the others by their share of the model (a stage of a model cut
in ``n`` holds ``N / n`` of the blocks a stage of the finest cut ``N`` holds).  Compiles of several candidates
run two at a time: XLA's compile releases the GIL (two compiles of the step took 11.5 s side by side against
17.6 s one after the other on the 2-core build machine).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Sequence

import jax
import numpy as np

from .lockstep import EdgeCosts, LayerCosts
from .measure_cache import MeasureCache, backend_key, model_key
from .memory import (
    footprint,
    frontier_bytes,
    memory_analysis,
    memory_total,
    residual_bytes,
    residual_bytes_on,
    state_bytes,
    tree_bytes,
)

#: compiles run side by side (XLA's compile releases the GIL)
COMPILE_THREADS = 2


class Bench:
    """Measurements of ``make_model(n)`` on ``batch`` with ``optimizer`` on this backend, each made once."""

    def __init__(self, make_model: Callable[[int], object], batch, optimizer, cache: MeasureCache):
        self.make_model, self.batch, self.optimizer, self.cache = make_model, batch, optimizer, cache
        self.rows = int(jax.tree.leaves(batch)[0].shape[0])
        self.backend = backend_key()
        self._models: Dict[int, object] = {}
        self._keys: Dict[int, str] = {}
        self._residuals: Dict[tuple, tuple] = {}
        self._states: Dict[tuple, object] = {}
        self._cut_models: Dict[tuple, object] = {}

    # --- the model, cut in n ------------------------------------------------------------------------------
    def model(self, n: int):
        if n not in self._models:
            self._models[n] = _checked_model(self.make_model(n), n)
        return self._models[n]

    def model_for(self, c):
        """Candidate ``c``'s model: ``make_model(c.model_stages)``, or its blocks cut as ``c.cut`` says; with
        its ``param_specs`` dropped where ``c`` has no model axis (its weights replicated: a mesh without
        them)."""
        plain = c.model_axes == (1, 1)
        if c.cut is None and not (plain and getattr(self.model(c.model_stages), "param_specs", None)):
            return self.model(c.model_stages)
        key = (c.model_stages, c.cut, plain)
        if key not in self._cut_models:
            from ..cuts.balanced import recut

            m = self.model(c.model_stages) if c.cut is None else recut(self.model(c.model_stages), c.cut)
            self._cut_models[key] = dataclasses.replace(m, param_specs=None) if plain else m
        return self._cut_models[key]

    def model_axis_names(self) -> set:
        """The mesh axes the model's ``param_specs`` name (``make_model(1)``'s)."""
        from ..sharding import is_spec

        names = set()
        for tree in getattr(self.model(1), "param_specs", None) or ():
            for spec in jax.tree.leaves(tree, is_leaf=is_spec):
                for entry in spec or ():
                    names.update((entry,) if isinstance(entry, str) else (entry or ()))
        return names

    def footprint(self, c, pipe):
        """:func:`~jaxpipe.tune.memory.footprint` of candidate ``c`` built as ``pipe``, from the shared
        measurements; its family carries the model axes (their residuals are sharded: a line of their own)."""
        rows = self.rows // (c.data * c.microbatches)
        axes = () if c.model_axes == (1, 1) else c.model_axes
        return footprint(
            pipe,
            self.batch,
            known_state=self.state_bytes(c, pipe),
            known_residuals=self.residuals(c, pipe, rows),
            known_frontier=self.frontier(c, pipe, rows),
            axes=axes,
        )

    def parts(self, rows: int):
        """:class:`~jaxpipe.cuts.balanced.PartCosts` of one block, the embedding and the head on ``rows``-row
        micro-batches (the model of the finest cut measured; every cut holds the same blocks)."""
        from ..cuts.balanced import PartCosts, measure_parts, per_block

        n = max(self._models)

        def measure():
            mb = self._microbatch(rows)
            return agreed(dataclasses.asdict(measure_parts(per_block(self.model(n)), mb)))

        return self.cache.get(self._key("parts", n, rows), measure, use=lambda v: PartCosts(**_numbers_of(v)))

    def _microbatch(self, rows: int):
        """The first ``rows`` rows of the example batch, as host arrays (what every probe runs on)."""
        return jax.tree.map(lambda a: np.asarray(a[:rows]), self.batch)

    def model_key(self, n: int) -> str:
        if n not in self._keys:
            one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1,) + tuple(a.shape[1:]), a.dtype), self.batch)
            self._keys[n] = model_key(self.model(n), one, self.optimizer)
        return self._keys[n]

    def _key(self, what, n, *rest):
        return [what, self.backend, self.model_key(n), *rest]

    # --- memory ---------------------------------------------------------------------------------------------
    def state_bytes(self, c, pipe) -> int:
        """One device's state bytes: the same for every schedule, M and policy of one split and cut."""
        return self.cache.get(
            self._key("state", c.model_stages, c.stages, c.data, *_cut(c), *_axes(c)),
            lambda: state_bytes(self.state(c, pipe)),
            use=_count,
        )

    def state(self, c, pipe):
        """``pipe.init()``, made once per (schedule, split) (the layout of a schedule's stages may differ)."""
        key = (c.schedule, c.model_stages, c.stages, c.data, c.cut, c.model_axes)
        if key not in self._states:
            self._states[key] = pipe.init()
        return self._states[key]

    def residuals(self, c, pipe, rows: int):
        key = (c.model_stages, c.residuals, rows, *_cut(c), *_axes(c))
        if key not in self._residuals:

            def measure():
                if c.model_axes == (1, 1):
                    return residual_bytes(pipe.model, self.batch, rows)
                mesh, w_specs, batch_spec = placement(pipe)
                return residual_bytes_on(pipe.model, self.batch, rows, mesh, w_specs, batch_spec)

            self._residuals[key] = self.cache.get(
                self._key("residuals", *key), measure, use=lambda v: _counts(v, 2)
            )
        return self._residuals[key]

    def frontier(self, c, pipe, rows: int) -> int:
        """Zero-bubble's own frontier slots (:func:`~jaxpipe.tune.memory.frontier_bytes`) per (cut, policy,
        rows, slots); 0 without a split backward."""
        slots = pipe.lane_plan.front_capacity
        if not pipe.schedule.has_w() or pipe.lane_plan.direct:
            return 0
        return self.cache.get(
            self._key("frontier", c.model_stages, c.residuals, rows, slots, *_cut(c), *_axes(c)),
            lambda: frontier_bytes(pipe.model, self.batch, rows, slots),
            use=_count,
        )

    def compile_memory(self, jobs: Sequence[tuple]) -> None:
        """Set ``c.compiled_memory`` (XLA's total per device) for every ``(candidate, pipe)`` of ``jobs``:
        from the cache, or compiled (:data:`COMPILE_THREADS` at a time, the next lowered meanwhile)."""
        todo = []
        for c, pipe in jobs:
            key = self._key("compiled", c.model_stages, c.label(), self._batch_shapes())
            found, value = self.cache.lookup(key)
            if found and _is_count(value):
                c.compiled_memory = value
            else:
                todo.append((c, pipe, key))
        if not todo:
            return
        # each program compiled while the next is lowered (lowering is Python, compiling is not: the guide's
        # search 45 -> 41 s on 2 cores)
        with ThreadPoolExecutor(min(COMPILE_THREADS, len(todo))) as ex:
            pending = [
                ex.submit(
                    memory_analysis, pipe.lower("step", self.state(c, pipe), pipe.shard_batch(self.batch))
                )
                for c, pipe, _ in todo
            ]
            analyses = [f.result() for f in pending]
        for (c, _, key), ma in zip(todo, analyses):
            c.compiled_memory = memory_total(ma)
            self.cache.put(key, c.compiled_memory)

    def _batch_shapes(self):
        return str(
            [(k, tuple(np.shape(v)), str(np.asarray(v).dtype)) for k, v in sorted(self.batch.items())]
            if isinstance(self.batch, dict)
            else [tuple(np.shape(a)) for a in jax.tree.leaves(self.batch)]
        )

    # --- time -----------------------------------------------------------------------------------------------
    def stage_costs(
        self,
        finest: int,
        n: int,
        residuals: str,
        rows: int,
        split: bool,
        pipe_of: Callable,
        axes: tuple = (1, 1),
    ):
        """:class:`LayerCosts` of one stage of the model cut in ``n`` on ``rows``-row micro-batches under the
        policy, as the executor runs it -- residuals through a stash, zero-bubble's W from the executor's own
        split (:func:`jaxpipe.tune.stage_bench.stashed_stage_costs`): one stage of the finest cut (``finest``
        stages; ``pipe_of(n, policy)`` builds it) timed, times ``finest / n``; and the activation's bytes per
        device.  One program measures F, B, B-input and W, so a split and a fused schedule of the same cut,
        policy and rows share it (there were two).  With model ``axes`` ``(fsdp, tensor)``, the stage runs on
        that many devices, its weights sharded as the pipeline shards them (XLA's collectives included)."""
        from .stage_bench import stashed_stage_costs

        key = self._key(
            "stashed_stage_costs",
            finest,
            residuals,
            rows,
            "all ops",
            *(() if tuple(axes) == (1, 1) else (("fsdp", "tensor"), tuple(axes))),
        )

        def measure():
            pipe = pipe_of(finest, residuals)
            m = pipe.model
            mb = self._microbatch(rows)
            x = m.pre(m.pre_params, mb)
            w = jax.tree.map(lambda a: a[0], m.stage_params)
            act = tree_bytes(x)
            if tuple(axes) != (1, 1):
                from jax.sharding import NamedSharding, PartitionSpec as P

                mesh, w_specs, b_spec = placement(pipe)
                put = lambda t, spec: jax.tree.map(
                    lambda a: _put(a, NamedSharding(mesh, spec if np.ndim(a) else P())), t
                )
                w = jax.tree.map(lambda a, sp: _put(a, NamedSharding(mesh, sp)), w, w_specs)
                x, mb = put(x, b_spec), put(mb, b_spec)
                act //= axes[0] if b_spec != P() else 1
            out = stashed_stage_costs(m, w, x, mb, split=True)
            out["act"] = act
            return out

        got = self.cache.get(
            key,
            lambda: agreed(measure()),
            use=lambda v: _numbers_of(v, ("F", "B", "B_input", "W", "act", "splits")),
        )
        s = finest / n
        f, b = got["F"] * s, got["B"] * s
        b_in, w = (got["B_input"] * s, got["W"] * s) if split else (b / 2, b / 2)
        return LayerCosts(f=f, b=b, b_input=b_in, w=w), got["act"]

    def edges(self, rows: int):
        """:class:`EdgeCosts` of the embedding and the head on ``rows``-row micro-batches (any cut's
        model)."""
        from .microbench import edge_costs

        n = min(self._models)

        def measure():
            mb = self._microbatch(rows)
            return agreed(edge_costs(self.model(n), mb))

        return self.cache.get(self._key("edges", n, rows), measure, use=lambda v: EdgeCosts(**_numbers_of(v)))

    def link(self, devices: int):
        from .microbench import p2p_alpha_beta

        return self.cache.get(
            ["p2p", self.backend, devices],
            lambda: agreed(list(p2p_alpha_beta(devices))),
            use=lambda v: _numbers(v, 2),
        )

    def tick(self, finest: int, rows: int, devices: int, pipe_of: Callable) -> float:
        """Seconds a tick's exchange adds on ``devices`` devices, one stage of the finest cut's forward on
        ``rows``-row micro-batches as its work (:func:`~jaxpipe.tune.running_costs.tick_price`); its bytes'
        part is the :meth:`link`'s, the rest the rendezvous every tick pays."""
        from .running_costs import tick_price

        def measure():
            mb = self._microbatch(rows)
            return agreed([tick_price(pipe_of(finest).model, mb, devices)])[0]

        return self.cache.get(self._key("tick_uneven", finest, rows, devices), measure, use=_number)

    def update(self, c, pipe) -> float:
        """Seconds of the optimizer's update of one device's parameters (its stages' share, with the embedding
        and the head: the device holding them is the one the step waits for; on model axes, its shards), on
        one device."""
        from jax.sharding import Mesh, PartitionSpec
        from .microbench import update_time

        mesh = Mesh(np.array(jax.local_devices()[:1]), ("x",))
        return self.cache.get(
            self._key("update", c.model_stages, c.stages, *_axes(c)),
            lambda: agreed([update_time(self.optimizer, _device_share(c, pipe), mesh, PartitionSpec())])[0],
            use=_number,
        )

    def allreduce(self, c, pipe, devices: int) -> float:
        """Seconds of the data replicas' gradient all-reduce: a pytree shaped like one device's gradients,
        each leaf its own all-reduce as in the step (:func:`~jaxpipe.tune.microbench.tree_allreduce_time`)."""
        from .microbench import tree_allreduce_time

        share = _device_share(c, pipe)
        return self.cache.get(
            self._key("allreduce", c.model_stages, c.stages, c.data, devices, *_axes(c)),
            lambda: agreed([tree_allreduce_time(share, devices, c.data)])[0],
            use=_number,
        )


def _checked_model(model, n: int):
    """``make_model(n)``'s result, or a ConfigError saying what it returned and what would work."""
    from ..errors import ConfigError
    from ..model import PipelineModel

    if isinstance(model, PipelineModel):
        if model.num_stages != n:
            raise ConfigError(
                f"configure: make_model({n}) returned a model of {model.num_stages} stages; it must "
                f"cut the model into the {n} stages asked for (e.g. lambda n: jp.models.gpt(n))"
            )
        return model
    hint = (
        " -- from_nnx / from_linen return (model, to_modules): return the first, e.g. lambda n: "
        "jp.models.from_nnx(..., num_stages=n)[0]"
        if isinstance(model, tuple) and model and isinstance(model[0], PipelineModel)
        else ""
    )
    raise ConfigError(
        f"configure: make_model({n}) returned a {type(model).__name__}, not a jp.PipelineModel{hint}"
    )


# --- what a cache entry must be (MeasureCache.get's ``use``: a ValueError / TypeError / KeyError remeasures)
# ---
def _number(v) -> float:
    """A measured time or size: a finite number >= 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
        raise ValueError(f"{v!r} is not a finite number >= 0")
    return float(v)


def _is_count(v) -> bool:
    return (
        isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and v >= 0 and v == int(v)
    )


def _count(v) -> int:
    """A byte count: a whole number >= 0."""
    if not _is_count(v):
        raise ValueError(f"{v!r} is not a byte count")
    return int(v)


def _numbers(v, n: int) -> tuple:
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise ValueError(f"{v!r} is not {n} numbers")
    return tuple(_number(x) for x in v)


def _counts(v, n: int) -> tuple:
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise ValueError(f"{v!r} is not {n} byte counts")
    return tuple(_count(x) for x in v)


def _numbers_of(v, keys=None) -> dict:
    """A table of measured numbers (with ``keys``, at least those); a flag (bool) stays a flag."""
    if not isinstance(v, dict) or (keys is not None and not set(keys) <= set(v)):
        raise KeyError(f"a table of {sorted(keys) if keys else 'numbers'} expected, found {v!r}"[:200])
    return {k: x if isinstance(x, bool) else _number(x) for k, x in v.items()}


def _put(a, sharding):
    """The host value ``a`` (the same on every process) as an array placed by ``sharding``, which may span
    processes."""
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def _device_share(c, pipe):
    """Zeros shaped like one device's parameters: its stages' share of the stage leaves, the embedding and the
    head, each leaf the shard its sharding gives a device (model axes)."""
    m = pipe.model
    per = lambda a: max(np.shape(a)[0] // c.stages, 1)
    stage = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((per(a),) + tuple(np.shape(a)[1:]), a.dtype), m.stage_params
    )
    full = (stage, m.pre_params, m.post_params)
    zeros = lambda shape, a: np.zeros(shape, np.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype)
    if c.model_axes == (1, 1):
        return jax.tree.map(lambda a: zeros(tuple(np.shape(a)), a), full)
    try:
        return (
            jax.tree.map(
                lambda a, sh: zeros(
                    (per(a),) + tuple(sh.shard_shape((c.stages,) + tuple(np.shape(a)[1:])))[1:], a
                ),
                m.stage_params,
                pipe.param_shardings[0],
            ),
            jax.tree.map(
                lambda a, sh: zeros(tuple(sh.shard_shape(np.shape(a))), a),
                m.pre_params,
                pipe.param_shardings[1],
            ),
            jax.tree.map(
                lambda a, sh: zeros(tuple(sh.shard_shape(np.shape(a))), a),
                m.post_params,
                pipe.param_shardings[2],
            ),
        )
    except (ValueError, TypeError):  # a tied copy left out of the shardings: the unsharded shapes
        return jax.tree.map(lambda a: zeros(tuple(np.shape(a)), a), full)


def _axes(c) -> tuple:
    """What a candidate's model axes add to its keys: nothing where it has none."""
    return () if c.model_axes == (1, 1) else (("fsdp", "tensor"), tuple(c.model_axes))


def placement(pipe):
    """``(mesh, stage weight specs, batch spec)`` of ``pipe``'s stage on its model axes alone: a mesh of the
    model axes' devices (this process's first ones), one stage's weights sharded as the pipeline shards them
    (the ``stage`` entry dropped), the micro-batch split over ``fsdp`` where the pipeline splits it so."""
    from jax.sharding import PartitionSpec as P
    from ..runtime.mesh import make_mesh

    shape = pipe.mesh.shape
    f, t = shape.get("fsdp", 1), shape.get("tensor", 1)
    local = jax.local_devices()
    # this process's devices where it has enough; else the job's first ones (one device a process: every
    # process runs the benchmark, its collectives between them, as the pipeline's stage would)
    mesh = make_mesh(fsdp=f, tensor=t, devices=local if len(local) >= f * t else jax.devices())
    specs = jax.tree.map(
        lambda sh: P(*tuple(sh.spec)[1:]), pipe.param_shardings[0], is_leaf=lambda x: hasattr(x, "spec")
    )
    return mesh, specs, P("fsdp") if "fsdp" in pipe.batch_axes and f > 1 else P()


def _cut(c) -> tuple:
    """What a candidate's cut adds to its keys: nothing for the model's own cut (the keys stay as they
    were)."""
    return () if c.cut is None else (c.cut,)


def agreed(value):
    """A timing every process of a multi-process job agrees on: process 0's (a dict of floats or a list).
    Each process times on its own devices; were the figures left as each measured them, two processes could
    rank two candidates differently and build different programs -- a job whose collectives never meet."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    keys = sorted(value) if isinstance(value, dict) else range(len(value))
    got = multihost_utils.broadcast_one_to_all(np.array([float(value[k]) for k in keys], np.float32))
    out = {k: float(v) for k, v in zip(keys, np.asarray(got))}
    return out if isinstance(value, dict) else [out[k] for k in keys]
