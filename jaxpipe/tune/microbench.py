"""Micro-benchmarks on the running backend for the performance model (Chimera §3.4): the time of one
stage's forward / backward on one micro-batch with n devices busy at once, ``ppermute`` and all-reduce
alpha-beta, and the optimizer update.  Each is a small ``shard_map`` program timed as the median of a few
calls, every call looping ``reps`` times on the device (so dispatch does not count)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .perf_model import Costs


def _flat_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _timeit(fn: Callable, args, calls: int = 5, best: bool = False) -> float:
    """The median (``best``: the least) of ``calls`` timed calls, after one untimed (compile + warm-up)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return min(ts) if best else statistics.median(ts)


def op_costs(stage_fn, w, x, devices: int, busy: Sequence[int], reps: int = 8, split: bool = False
             ) -> Dict[str, List[float]]:
    """``{"F": [...], "B": [...] (, "W": [...])}``: seconds per op with n of ``devices`` busy, for every n
    in 1..devices (measured at ``busy``, linearly interpolated between).  B is the pullback only (the
    executor rebuilds it from stashed residuals, it does not rerun the forward); with ``split`` B is the
    input gradient and W the weight gradient (zero-bubble)."""
    mesh = _flat_mesh(devices)
    rep_spec = jax.tree.map(lambda _: P(), (w, x))

    def program(kind, n):
        def body(w, x):
            me = lax.axis_index("x")
            y, pull = jax.vjp(stage_fn, w, x)

            def f_loop(h):
                return lax.fori_loop(0, reps, lambda i, h: stage_fn(w, h).astype(h.dtype), h)

            def b_loop(h):
                # the weight gradient is added to a carried sum, as the executor does: a scalar sum of it
                # let XLA skip most of its matmul (W measured at an eighth of B's input part)
                def one(i, c):
                    dh, acc = c
                    dw, dx = pull(dh)
                    acc_dw = jax.tree.map(jnp.add, acc, dw)
                    if kind == "W":
                        return dh * (1 + 1e-30 * i), acc_dw
                    if kind == "B" and split:
                        return dx.astype(dh.dtype), acc
                    return dx.astype(dh.dtype), acc_dw
                zeros = jax.tree.map(jnp.zeros_like, w)
                dh, acc = lax.fori_loop(0, reps, one, (h, zeros))
                return dh + 1e-30 * sum(jnp.sum(l[..., :1]) for l in jax.tree.leaves(acc))

            run = f_loop if kind == "F" else b_loop
            out = lax.cond(me < n, run, lambda h: h, y)
            return jnp.sum(out)[None]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=rep_spec, out_specs=P("x"), check_vma=False))

    kinds = ["F", "B"] + (["W"] if split else [])
    w_r = jax.device_put(w, NamedSharding(mesh, P()))
    x_r = jax.device_put(x, NamedSharding(mesh, P()))
    out = {}
    for kind in kinds:
        pts = {n: _timeit(program(kind, n), (w_r, x_r)) / reps for n in busy}
        xs = sorted(pts)
        out[kind] = [float(np.interp(n, xs, [pts[k] for k in xs])) for n in range(1, devices + 1)]
    return out


def stage_costs(stage_fn, w, x, split: bool = True, reps: int = 8, calls: int = 9) -> Dict[str, float]:
    """``{"F", "B", "B_input"}``: seconds per call of one stage on one device, from ONE compiled program
    (issue #53 item 5: a configuration search measures many micro-batch sizes and policies) -- the op is a
    runtime argument of a ``lax.switch``, so F, the whole pullback and its input-gradient part (zero-bubble's
    B, with ``split``) share a compile.  As :func:`op_costs` measures them: B is the pullback from the stashed
    residuals (a recomputing policy's pullback reruns the forward), its weight gradient added to a carried sum.
    The fastest of ``calls`` calls: a search ranks a stage's two residual policies by it, and a median of five
    calls of a stage of a few microseconds put the recomputing one first in one run of three."""
    def body(kind, w, x):
        y, pull = jax.vjp(stage_fn, w, x)

        def f_loop(h):
            return lax.fori_loop(0, reps, lambda i, h: stage_fn(w, h).astype(h.dtype), h)

        def b_loop(keep_dw):
            def run(h):
                def one(i, c):
                    dh, acc = c
                    dw, dx = pull(dh)
                    return dx.astype(dh.dtype), (jax.tree.map(jnp.add, acc, dw) if keep_dw else acc)
                dh, acc = lax.fori_loop(0, reps, one, (h, jax.tree.map(jnp.zeros_like, w)))
                return dh + 1e-30 * sum(jnp.sum(l[..., :1]) for l in jax.tree.leaves(acc))
            return run

        branches = [f_loop, b_loop(True)] + ([b_loop(False)] if split else [])
        return jnp.sum(lax.switch(kind, branches, y))

    fn = jax.jit(body)
    kinds = ["F", "B"] + (["B_input"] if split else [])
    jax.block_until_ready(fn(jnp.int32(0), w, x))            # the one compile
    return {k: _timeit(fn, (jnp.int32(i), w, x), calls=calls, best=True) / reps for i, k in enumerate(kinds)}


def layer_costs(stage_fn, w, x, layers: int, reps: int = 8):
    """:class:`~jaxpipe.tune.lockstep.LayerCosts` per layer, measured on one device: a stage of ``layers``
    layers (``w``) on one micro-batch ``x``, its F, whole B and zero-bubble's B (the input gradient alone),
    divided by ``layers``.  W is what the whole B costs beyond the input gradient: the executor's W reads the
    per-layer output gradients B kept (``runtime.wsplit``), so it runs the weight products alone (W measured
    apart would back-propagate through the stage again: ``w_from="recompute"``)."""
    from .lockstep import LayerCosts
    whole = op_costs(stage_fn, w, x, 1, [1], reps=reps)
    split = op_costs(stage_fn, w, x, 1, [1], reps=reps, split=True)
    f, b, b_in = whole["F"][0] / layers, whole["B"][0] / layers, split["B"][0] / layers
    return LayerCosts(f=f, b=b, b_input=b_in, w=max(b - b_in, 0.0))


def _global_ones(mesh, spec, n: int):
    """``n`` float32 ones laid out over ``mesh`` by ``spec``, made by a jitted program (so also where the mesh
    spans several processes, which may not pass host arrays to a multi-process program)."""
    return jax.jit(lambda: jnp.ones((n,), jnp.float32), out_shardings=NamedSharding(mesh, spec))()


def p2p_alpha_beta(devices: int, sizes=(1 << 12, 1 << 16, 1 << 20), reps: int = 16):
    """Least-squares alpha, beta of one ring ``ppermute`` of L bytes (float32) on ``devices`` devices, timed
    *inside* a compiled loop as the executor's ticks run it: loops of ``reps // 4`` and ``reps`` exchanges,
    their difference over the extra exchanges (a separately jitted exchange also pays the call's dispatch on
    every process, 2.4 ms between two processes here: a step's fixed cost, not a tick's)."""
    mesh = _flat_mesh(devices)
    perm = [(d, (d + 1) % devices) for d in range(devices)]
    ts = []
    for L in sizes:
        a = _global_ones(mesh, P("x"), devices * (L // 4))
        per = []
        for k in (reps // 4, reps):
            def body(a, k=k):
                return lax.fori_loop(0, k, lambda i, a: lax.ppermute(a, "x", perm) * 1.0000001, a)
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
            per.append(_timeit(fn, (a,)))
        ts.append(max(per[1] - per[0], 0.0) / (reps - reps // 4))
    beta, alpha = np.polyfit(np.array(sizes, float), np.array(ts), 1)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def allreduce_alpha_beta(devices: int, sizes=(1 << 12, 1 << 16, 1 << 20), reps: int = 8, group: int = 0):
    """alpha, beta of Rabenseifner's model fitted to ``psum`` over groups of ``group`` devices (default: all
    of ``devices``), all groups reducing at once -- as the data-parallel gradient all-reduce of a
    ``W x D`` mesh runs D groups of W together."""
    group = group or devices
    if group < 2:
        return 0.0, 0.0
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices // group, group), ("g", "x"))
    ts = []
    for L in sizes:           # inside a compiled loop, as p2p_alpha_beta: loops of reps // 4 and reps
        a = _global_ones(mesh, P(("g", "x")), devices * (L // 4))
        per = []
        for k in (reps // 4, reps):
            def body(a, k=k):
                return lax.fori_loop(0, k, lambda i, a: lax.psum(a, "x") * (1.0 / group), a)
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("g", "x")), out_specs=P(("g", "x")),
                                       check_vma=False))
            per.append(_timeit(fn, (a,)))
        ts.append(max(per[1] - per[0], 0.0) / (reps - reps // 4))
    slope, icpt = np.polyfit(np.array(sizes, float), np.array(ts), 1)
    r = group
    return max(float(icpt), 0.0) / (2 * np.log2(r)), max(float(slope), 0.0) * r / (2 * (r - 1))


def update_time(opt, params, mesh, spec) -> float:
    """The optimizer update of ``params`` placed with ``spec`` on ``mesh`` (one jitted call)."""
    import optax
    sh = jax.tree.map(lambda _: NamedSharding(mesh, spec), params)
    p = jax.device_put(params, sh)
    state = jax.jit(opt.init)(p)
    g = jax.tree.map(jnp.ones_like, p)

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    return _timeit(step, (p, state, g))


def measure(stage_fn, w, x, devices: int, split: bool = False, busy: Sequence[int] = ()) -> Costs:
    """Every measured cost except the update (see :func:`update_time`)."""
    if not busy:
        busy = {1, 2, devices} if devices > 2 else set(range(1, devices + 1))
    busy = sorted(set(busy))
    ops = op_costs(stage_fn, w, x, devices, busy, split=split)
    pa, pb = p2p_alpha_beta(devices) if devices > 1 else (0.0, 0.0)
    aa, ab = allreduce_alpha_beta(devices)
    return Costs(op=ops, p2p_alpha=pa, p2p_beta=pb, ar_alpha=aa, ar_beta=ab)
