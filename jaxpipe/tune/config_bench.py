"""What :func:`jaxpipe.tune.configure.configure` measures, each thing once (issue #53 item 5).

A search over stage x data splits, schedules, micro-batch counts and residual policies needs, per candidate,
its state's bytes, one micro-batch's residual bytes, a stage's F / B and, for a few, XLA's compiled memory.
Most candidates share them: the state depends on the split and the cut only, the residuals and op costs on the
micro-batch size and policy only.  :class:`Bench` computes each of them once, keeps them in a
:class:`~jaxpipe.tune.measure_cache.MeasureCache` keyed by (model, backend), and times one stage only: the cut
with the most stages of the search, scaled to the others by their share of the model (a stage of a model cut in
``n`` holds ``N / n`` of the blocks a stage of the finest cut ``N`` holds).  Compiles of several candidates
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
from .memory import frontier_bytes, memory_analysis, memory_total, residual_bytes, state_bytes, tree_bytes

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
            self._models[n] = self.make_model(n)
        return self._models[n]

    def model_for(self, c):
        """Candidate ``c``'s model: ``make_model(c.model_stages)``, or its blocks cut as ``c.cut`` says."""
        if c.cut is None:
            return self.model(c.model_stages)
        key = (c.model_stages, c.cut)
        if key not in self._cut_models:
            from .cut import recut
            self._cut_models[key] = recut(self.model(c.model_stages), c.cut)
        return self._cut_models[key]

    def parts(self, rows: int):
        """:class:`~jaxpipe.tune.cut.PartCosts` of one block, the embedding and the head on ``rows``-row
        micro-batches (the model of the finest cut measured; every cut holds the same blocks)."""
        from .cut import PartCosts, measure_parts, per_block
        n = max(self._models)

        def measure():
            mb = jax.tree.map(lambda a: np.asarray(a[:rows]), self.batch)
            return agreed(dataclasses.asdict(measure_parts(per_block(self.model(n)), mb)))
        return PartCosts(**self.cache.get(self._key("parts", n, rows), measure))

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
        return self.cache.get(self._key("state", c.model_stages, c.stages, c.data, *_cut(c)),
                              lambda: state_bytes(self.state(c, pipe)))

    def state(self, c, pipe):
        """``pipe.init()``, made once per (schedule, split) (the layout of a schedule's stages may differ)."""
        key = (c.schedule, c.model_stages, c.stages, c.data, c.cut)
        if key not in self._states:
            self._states[key] = pipe.init()
        return self._states[key]

    def residuals(self, c, pipe, rows: int):
        key = (c.model_stages, c.residuals, rows, *_cut(c))
        if key not in self._residuals:
            self._residuals[key] = tuple(self.cache.get(self._key("residuals", *key),
                                                        lambda: residual_bytes(pipe.model, self.batch, rows)))
        return self._residuals[key]

    def frontier(self, c, pipe, rows: int) -> int:
        """Zero-bubble's own frontier slots (:func:`~jaxpipe.tune.memory.frontier_bytes`) per (cut, policy, rows,
        slots); 0 without a split backward."""
        slots = pipe.lane_plan.front_capacity
        if not pipe.schedule.has_w() or pipe.lane_plan.direct:
            return 0
        return int(self.cache.get(self._key("frontier", c.model_stages, c.residuals, rows, slots, *_cut(c)),
                                  lambda: frontier_bytes(pipe.model, self.batch, rows, slots)))

    def compile_memory(self, jobs: Sequence[tuple]) -> None:
        """Set ``c.compiled_memory`` (XLA's total per device) for every ``(candidate, pipe)`` of ``jobs``: from the
        cache, or compiled (:data:`COMPILE_THREADS` at a time, the next lowered meanwhile)."""
        todo = []
        for c, pipe in jobs:
            key = self._key("compiled", c.model_stages, c.label(), self._batch_shapes())
            found, value = self.cache.lookup(key)
            if found:
                c.compiled_memory = value
            else:
                todo.append((c, pipe, key))
        if not todo:
            return
        # each program compiled while the next is lowered (lowering is Python, compiling is not: README's search
        # 45 -> 41 s on 2 cores)
        with ThreadPoolExecutor(min(COMPILE_THREADS, len(todo))) as ex:
            pending = [ex.submit(memory_analysis, pipe.lower("step", self.state(c, pipe), pipe.shard_batch(self.batch)))
                       for c, pipe, _ in todo]
            analyses = [f.result() for f in pending]
        for (c, _, key), ma in zip(todo, analyses):
            c.compiled_memory = memory_total(ma)
            self.cache.put(key, c.compiled_memory)

    def _batch_shapes(self):
        return str([(k, tuple(np.shape(v)), str(np.asarray(v).dtype)) for k, v in sorted(self.batch.items())]
                   if isinstance(self.batch, dict) else [tuple(np.shape(a)) for a in jax.tree.leaves(self.batch)])

    # --- time -----------------------------------------------------------------------------------------------
    def stage_costs(self, finest: int, n: int, residuals: str, rows: int, split: bool, model_of: Callable):
        """:class:`LayerCosts` of one stage of the model cut in ``n`` on ``rows``-row micro-batches under the
        policy, as the executor runs it -- residuals through a stash, zero-bubble's W from the executor's own
        split (:func:`jaxpipe.tune.stage_bench.stashed_stage_costs`): one stage of the finest cut (``finest``
        stages) timed, times ``finest / n``; and the activation's bytes.  One program measures F, B, B-input
        and W, so a split and a fused schedule of the same cut, policy and rows share it (there were two)."""
        from .stage_bench import stashed_stage_costs
        key = self._key("stashed_stage_costs", finest, residuals, rows, "all ops")

        def measure():
            m = model_of(finest, residuals)
            mb = jax.tree.map(lambda a: np.asarray(a[:rows]), self.batch)
            x = m.pre(m.pre_params, mb)
            w = jax.tree.map(lambda a: a[0], m.stage_params)
            out = stashed_stage_costs(m, w, x, mb, split=True)
            out["act"] = tree_bytes(x)
            return out

        got = self.cache.get(key, lambda: agreed(measure()))
        s = finest / n
        f, b = got["F"] * s, got["B"] * s
        b_in, w = (got["B_input"] * s, got["W"] * s) if split else (b / 2, b / 2)
        return LayerCosts(f=f, b=b, b_input=b_in, w=w), got["act"]

    def edges(self, rows: int):
        """:class:`EdgeCosts` of the embedding and the head on ``rows``-row micro-batches (any cut's model)."""
        from .microbench import edge_costs
        n = min(self._models)

        def measure():
            mb = jax.tree.map(lambda a: np.asarray(a[:rows]), self.batch)
            return agreed(edge_costs(self.model(n), mb))
        return EdgeCosts(**self.cache.get(self._key("edges", n, rows), measure))

    def link(self, devices: int):
        from .microbench import p2p_alpha_beta
        return tuple(self.cache.get(["p2p", self.backend, devices], lambda: agreed(list(p2p_alpha_beta(devices)))))

    def update(self, c, pipe) -> float:
        """Seconds of the optimizer's update of one device's parameters (its stages' share, with the embedding
        and the head: the device holding them is the one the step waits for), on one device."""
        from jax.sharding import Mesh, PartitionSpec
        from .microbench import update_time
        m = pipe.model
        share = (jax.tree.map(lambda a: a[: max(a.shape[0] // c.stages, 1)], m.stage_params), m.pre_params,
                 m.post_params)
        mesh = Mesh(np.array(jax.local_devices()[:1]), ("x",))
        return float(self.cache.get(self._key("update", c.model_stages, c.stages),
                                    lambda: agreed([update_time(self.optimizer, share, mesh, PartitionSpec())])[0]))

    def allreduce(self, c, pipe, devices: int) -> float:
        """Seconds of the data replicas' gradient all-reduce: a pytree shaped like one device's gradients, each
        leaf its own all-reduce as in the step (:func:`~jaxpipe.tune.microbench.tree_allreduce_time`)."""
        from .microbench import tree_allreduce_time
        m = pipe.model
        share = (jax.tree.map(lambda a: np.zeros((max(a.shape[0] // c.stages, 1),) + a.shape[1:], a.dtype),
                              m.stage_params), m.pre_params, m.post_params)
        share = jax.tree.map(lambda a: np.zeros(np.shape(a), np.asarray(a).dtype), share)
        return float(self.cache.get(self._key("allreduce", c.model_stages, c.stages, c.data, devices),
                                    lambda: agreed([tree_allreduce_time(share, devices, c.data)])[0]))


def _cut(c) -> tuple:
    """What a candidate's cut adds to its keys: nothing for the model's own cut (the keys stay as they were)."""
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
