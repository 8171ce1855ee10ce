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

from ..optim.policies import LeafAdd
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


def per_iteration(loops: Dict, lengths: Sequence[int] = (4, 16), calls: int = 5) -> Dict:
    """Seconds one iteration adds to a compiled loop, for each of ``loops``.

    ``loops[key](n)`` builds the loop of ``n`` iterations as a thunk (a jitted call with its arguments
    bound).  Each key's loop is built at the two ``lengths``, every loop is called once untimed (compile,
    warm-up), then ``calls`` rounds time every loop in turn -- so a drift of the machine touches each alike
    -- and each keeps its least call (a loaded machine's slow calls drop out).  The short loop's time is
    subtracted from the long one's, over the extra iterations: what a call pays once (its dispatch, the
    wait for the other processes to enter it, 1-3 ms between two processes) cancels.

    Args:
        loops: ``{key: n -> thunk}``.
        lengths: the short and the long loop's iterations.
        calls: timed rounds.

    Returns:
        ``{key: seconds per iteration}``, each at least 0.
    """
    short, long = lengths
    thunks = {(key, n): make(n) for key, make in loops.items() for n in (short, long)}
    for thunk in thunks.values():
        jax.block_until_ready(thunk())
    best = dict.fromkeys(thunks, float("inf"))
    for _ in range(calls):
        for at, thunk in thunks.items():
            t0 = time.perf_counter()
            jax.block_until_ready(thunk())
            best[at] = min(best[at], time.perf_counter() - t0)
    return {key: iteration_seconds(best, key, lengths) for key in loops}


def iteration_seconds(least: Dict, key, lengths: Sequence[int]) -> float:
    """Seconds one iteration of loop ``key`` adds, at least 0: its short loop's least call (``least[(key,
    n)]``) subtracted from its long one's, over the extra iterations (:func:`per_iteration`)."""
    short, long = lengths
    return max(least[(key, long)] - least[(key, short)], 0.0) / (long - short)


def time_branches(fn: Callable, n: int, args, calls: int, per: int) -> List[float]:
    """Seconds per unit (a call over ``per``) of ``fn(kind, *args)`` for each ``kind`` in ``range(n)`` -- one
    program whose op is a runtime ``lax.switch`` argument: one compile, every branch warmed up, then ``calls``
    rounds timing the kinds in turns (a drift of the machine touches each alike), the least of each kind."""
    kinds = [jnp.int32(i) for i in range(n)]
    for k in kinds:
        jax.block_until_ready(fn(k, *args))
    t = [float("inf")] * n
    for _ in range(calls):
        for i, k in enumerate(kinds):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(k, *args))
            t[i] = min(t[i], (time.perf_counter() - t0) / per)
    return t


#: the summing policies' add: a scanned stage's weight gradient goes into its slice of the sums as one
#: scatter-add, as the executor adds it
_ADD = LeafAdd()


class _Backward:
    """One stage's backward at the weights ``w`` and input ``x`` as a summing schedule's executor runs it:
    the activation-dependent residuals stashed, the rest rebuilt from ``w`` (``runtime.residuals``), and
    where the stage scans its layers, the input part and then the weight gradient added into the sums in
    place (``runtime.lanes_backward.bwd``).  Timed as the fused pullback instead, the probe paid a
    zero-filled stacked weight gradient and a pass adding it that the running program does not: B
    13.6-14.1 against 8.9-9.5 ms on one core for the testbed's stage at 32 rows (BUILD_NOTES.md, "The
    executor")."""

    def __init__(self, stage_fn, w, x, in_place: bool = True):
        from ..runtime.residuals import rebuild_pullback, residual_mask, split_residuals
        from ..runtime.wsplit import split_backward

        mask, _ = residual_mask(stage_fn, w, x)
        self.w, self.res = w, split_residuals(stage_fn, w, x, mask)[1]
        x_like = jnp.zeros_like(x)
        pullback = lambda w_, r, d: rebuild_pullback(stage_fn, w_, x_like, r, mask)(d)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.res]
        # zero-bubble's split at the frontier, as the executor's W reads it (None: W recomputes)
        self.at_frontier = split_backward(pullback, w, self.res, jnp.zeros_like(x), avals)
        sp = self.at_frontier
        self.split = sp if in_place and sp is not None and sp.in_place else None
        self.pull = jax.vjp(stage_fn, w, x)[1]  # the fused pullback, its residuals closed over

    def whole(self, dh, acc):
        """``(dx, acc + dw)``."""
        if self.split is None:
            dw, dx = self.pull(dh)
            return dx, jax.tree.map(jnp.add, acc, dw)
        dx, front = self.split.input_part(self.w, self.res, dh)
        return dx, self.split.weight_part_into(self.w, self.res, dh, front, acc, _ADD)

    def input(self, dh):
        """``dx`` alone (zero-bubble's B; what only the weight gradient needs is dead code)."""
        if self.split is None:
            return self.pull(dh)[1]
        return self.split.input_part(self.w, self.res, dh)[0]

    def frontier(self, dh):
        """What zero-bubble's B keeps for W at the cotangent ``dh`` (with :attr:`at_frontier` only)."""
        return self.at_frontier.input_part(self.w, self.res, dh)[1]

    def weight(self, dh, acc, front=None):
        """``acc + dw``: zero-bubble's W.  From ``front`` (:meth:`frontier`, kept by an earlier B) the weight
        products alone, as the executor's W lane runs them; without it the input part first, then them
        (a stage whose W recomputes: the fused pullback's weight gradient)."""
        if front is not None:
            return self.at_frontier.weight_part_into(self.w, self.res, dh, front, acc, _ADD)
        if self.split is None:
            return jax.tree.map(jnp.add, acc, self.pull(dh)[0])
        front = self.split.input_part(self.w, self.res, dh)[1]
        return self.split.weight_part_into(self.w, self.res, dh, front, acc, _ADD)


def _scaled(front, scale):
    """The frontier's float leaves times ``scale`` (an iteration's 1 + 1e-30 i: the same numbers, but XLA
    cannot hoist what reads them out of the loop)."""
    return [f * scale.astype(f.dtype) if jnp.issubdtype(f.dtype, jnp.floating) else f for f in front]


def _backward_loop(stage_fn, ws, x, h, kind: str, split: bool, in_place: bool, iterations: int):
    """:func:`op_costs`' B or W program: ``iterations`` rounds of the op on each copy of the weights ``ws``
    (a :class:`_Backward` each, at input ``x``), from the cotangent ``h``, each copy's weight gradient added
    to its own carried sum as the executor does (a scalar sum of it let XLA skip most of its matmul: W
    measured at an eighth of B's input part)."""
    backs = [_Backward(stage_fn, w, x, in_place) for w in ws]
    # W from a frontier B kept before the loop, as the executor's W lane reads it (with the input part in
    # each call, W came out at the fused backward's cost)
    fronts = [back.frontier(h) if kind == "W" and back.at_frontier is not None else None for back in backs]

    def one(i, dh, acc, back, front):
        if kind == "W":
            scale = 1 + 1e-30 * i
            return dh * scale, back.weight(dh, acc, None if front is None else _scaled(front, scale))
        if kind == "B" and split:
            return back.input(dh), acc
        return back.whole(dh, acc)

    def cycle(i, carry):
        dh, sums = carry[0], list(carry[1])
        for k, back in enumerate(backs):
            dh, sums[k] = one(i, dh, sums[k], back, fronts[k])
            dh = dh.astype(h.dtype)
        return dh, tuple(sums)

    zeros = tuple(jax.tree.map(jnp.zeros_like, w) for w in ws)
    dh, sums = lax.fori_loop(0, iterations, cycle, (h, zeros))
    return dh + 1e-30 * sum(jnp.sum(leaf[..., :1]) for leaf in jax.tree.leaves(sums))


def op_costs(
    stage_fn,
    w,
    x,
    devices: int,
    busy: Sequence[int],
    reps: int = 8,
    split: bool = False,
    kinds: Sequence[str] = (),
    best: bool = False,
    copies: int = 1,
    in_place: bool = True,
) -> Dict[str, List[float]]:
    """``{"F": [...], "B": [...] (, "W": [...])}``: seconds per op with n of ``devices`` busy, for every n
    in 1..devices (measured at ``busy``, linearly interpolated between).  B is the backward from stashed
    residuals as the executor runs it (it does not rerun the forward; ``in_place``: where the stage scans
    its layers, the weight gradient added into the sums in place, as a summing schedule's B does -- else
    the fused pullback and a pass adding its gradient); with ``split`` B is the input gradient and W the
    weight gradient alone (zero-bubble): its weight products from the frontier a B kept, as the executor's
    W lane runs them (where the stage has a frontier), else the whole backward again.  ``kinds``: only
    these; ``best``: the least of the timed calls, not their median.  ``copies``: the
    ops cycle through that many copies of ``w``, each with its own gradient sum -- the memory a device
    holding as many stages streams (Chimera's stage and its replica: on one core of the CPU testbed a
    backward over two copies cost 15-23% more than over one)."""
    mesh = _flat_mesh(devices)
    reps = max(reps // copies, 1) * copies

    def program(kind, n):
        def body(ws, x):
            me = lax.axis_index("x")
            y = stage_fn(ws[0], x)

            def f_loop(h):
                def cycle(i, h):
                    for w in ws:
                        h = stage_fn(w, h).astype(h.dtype)
                    return h

                return lax.fori_loop(0, reps // copies, cycle, h)

            def b_loop(h):
                return _backward_loop(stage_fn, ws, x, h, kind, split, in_place, reps // copies)

            run = f_loop if kind == "F" else b_loop
            out = lax.cond(me < n, run, lambda h: h, y)
            return jnp.sum(out)[None]

        rep_spec = jax.tree.map(lambda _: P(), ([w] * copies, x))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=rep_spec, out_specs=P("x"), check_vma=False))

    kinds = list(kinds) or ["F", "B"] + (["W"] if split else [])
    # each copy its own buffers (a copy of the host arrays put apart), as a device's stages are
    w_r = [jax.device_put(jax.tree.map(np.array, w), NamedSharding(mesh, P())) for _ in range(copies)]
    x_r = jax.device_put(x, NamedSharding(mesh, P()))
    out = {}
    for kind in kinds:
        pts = {n: _timeit(program(kind, n), (w_r, x_r), best=best) / reps for n in busy}
        xs = sorted(pts)
        out[kind] = [float(np.interp(n, xs, [pts[k] for k in xs])) for n in range(1, devices + 1)]
    return out


def edge_costs(model, mb, calls: int = 9) -> Dict[str, float]:
    """``{"f_pre", "b_pre", "f_post", "b_post"}``: seconds of the embedding's (``pre``) and the
    head-and-loss's (``post_loss``) forward and backward (the pullback, residuals kept) on the micro-batch
    ``mb``, each the least of ``calls`` calls, on the default device
    (:class:`~jaxpipe.tune.lockstep.EdgeCosts`)."""
    x = jax.jit(model.pre)(model.pre_params, mb)
    parts = {
        "pre": (lambda p: model.pre(p, mb), (model.pre_params,)),
        "post": (lambda p, h: model.post_loss(p, h, mb), (model.post_params, x)),
    }
    out = {}
    for name, (f, args) in parts.items():
        ct = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), jax.eval_shape(f, *args))
        fwd = _timeit(jax.jit(f), args, calls=calls, best=True)
        both = _timeit(jax.jit(lambda *a, f=f, ct=ct: jax.vjp(f, *a)[1](ct)), args, calls=calls, best=True)
        out[f"f_{name}"], out[f"b_{name}"] = fwd, max(both - fwd, 0.0)
    return out


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


def _collective_seconds(mesh, spec, sizes, lengths, op, indexed: bool = False) -> List[float]:
    """Seconds of one ``op`` (a collective of one float32 array; ``indexed``: ``op(i, a)``, the loop's index
    too) per message size in bytes, inside a compiled loop as the executor's ticks run it
    (:func:`per_iteration`)."""
    devices = mesh.devices.size
    step = op if indexed else (lambda i, a: op(a))

    def loop(size):
        a = _global_ones(mesh, spec, devices * (size // 4))

        def make(n):
            body = lambda a: lax.fori_loop(0, n, step, a)
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
            return lambda: fn(a)

        return make

    per = per_iteration({size: loop(size) for size in sizes}, lengths, calls=5)
    return [per[size] for size in sizes]


def p2p_alpha_beta(devices: int, sizes=(1 << 12, 1 << 16, 1 << 20), reps: int = 16):
    """Least-squares alpha, beta of one ring ``ppermute`` of L bytes (float32) on ``devices`` devices, timed
    *inside* a compiled loop as the executor's ticks run it: loops of ``reps // 4`` and ``reps`` exchanges,
    their difference over the extra exchanges (a separately jitted exchange also pays the call's dispatch on
    every process, 2.4 ms between two processes here: a step's fixed cost, not a tick's); each loop the least
    of its timed calls (their median, under a second test process on two cores, once fitted a slope <= 0)."""
    mesh = _flat_mesh(devices)
    perm = [(d, (d + 1) % devices) for d in range(devices)]

    ts = _collective_seconds(
        mesh, P("x"), sizes, (reps // 4, reps), lambda a: lax.ppermute(a, "x", perm) * 1.0000001
    )
    beta, alpha = np.polyfit(np.array(sizes, float), np.array(ts), 1)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def replica_exchange_seconds(
    devices: int, pairs, stage_bytes: float, largest: int = 64 << 20, reps: int = 4
) -> float:
    """Seconds a step spends on one chunk of stage replicas held away from their owners (Chimera's second
    pipeline, §3.1 of *Chimera: Efficiently Training Large-Scale Neural Networks with Bidirectional
    Pipelines*): the replica's weights fetched along ``pairs`` (one ``ppermute``), its gradient sums started
    at zero, sent home along the reverse pairs and added to the owner's -- the executor's work outside the
    ticks, one chunk.  Timed as one program inside a compiled loop (:func:`per_iteration`), so the fill and
    the add share the core with the exchanges as they do in the step (on a one-core process the link's I/O
    thread waits for them: priced as two messages alone, Chimera's step ran 8-9% past its prediction).

    Args:
        devices: the pipeline's devices (the program runs on the first ``devices``).
        pairs: the fetch's ``(source, destination)`` pairs.
        stage_bytes: a stage's parameter bytes (a float32 array of that many bytes stands for it).
        largest: the largest array the probe allocates (three of them live at once); a larger stage is
            priced on the line through this size and a quarter of it.
        reps: the long loop's iterations (the short one's: 1).

    Returns:
        Seconds of one chunk's fetch, zero fill, return and add at ``stage_bytes``.
    """
    mesh = _flat_mesh(devices)
    home = [(dst, src) for src, dst in pairs]
    spec = P("x")

    def exchange(i, a):
        replica = lax.ppermute(a, "x", pairs)
        # the sums' zero fill, once an iteration (a zero XLA cannot hoist out of the loop)
        zero = lax.optimization_barrier(i.astype(a.dtype)) - i.astype(a.dtype)
        replica, sums = lax.optimization_barrier((replica, jnp.broadcast_to(zero, a.shape)))
        return replica + lax.ppermute(sums, "x", home)

    big = int(min(max(stage_bytes, 1 << 12), largest)) // 4 * 4
    sizes = [big] if stage_bytes <= big else [big // 16 * 4, big]
    per = dict(zip(sizes, _collective_seconds(mesh, spec, sizes, (1, reps), exchange, indexed=True)))
    if len(sizes) == 1:
        return per[big] * stage_bytes / big
    slope = max(per[big] - per[sizes[0]], 0.0) / (big - sizes[0])  # never cheaper for more bytes
    return per[big] + slope * (stage_bytes - big)


def allreduce_alpha_beta(devices: int, sizes=(1 << 12, 1 << 16, 1 << 20), reps: int = 8, group: int = 0):
    """alpha, beta of Rabenseifner's model fitted to ``psum`` over groups of ``group`` devices (default: all
    of ``devices``), all groups reducing at once -- as the data-parallel gradient all-reduce of a
    ``W x D`` mesh runs D groups of W together."""
    group = group or devices
    if group < 2:
        return 0.0, 0.0
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices // group, group), ("g", "x"))
    spec = P(("g", "x"))

    ts = _collective_seconds(mesh, spec, sizes, (reps // 4, reps), lambda a: lax.psum(a, "x") * (1.0 / group))
    slope, icpt = np.polyfit(np.array(sizes, float), np.array(ts), 1)
    r = group
    return max(float(icpt), 0.0) / (2 * np.log2(r)), max(float(slope), 0.0) * r / (2 * (r - 1))


def tree_allreduce_time(tree, devices: int, group: int, reps: int = 4) -> float:
    """Seconds of one ``psum`` of a pytree shaped like ``tree`` (a device's gradients: every leaf its own
    all-reduce, as the step has them) over groups of ``group`` of ``devices`` devices, inside a compiled loop
    (loops of 1 and ``reps``, the difference).  Between two processes over Gloo each all-reduce paid ~4 ms
    whatever its size: a GPT's 54 leaves of 3.3 MB took 226 ms, one flat array of the same bytes 5 ms."""
    if group < 2:
        return 0.0
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices // group, group), ("g", "x"))
    spec = P(("g", "x"))
    # every leaf's zeros from one program (a program per leaf compiled ~60 times for a GPT: 10 s of a cold
    # search)
    shapes = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((devices,) + tuple(np.shape(a)), jnp.asarray(a).dtype), tree
    )
    t = jax.jit(
        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
        out_shardings=jax.tree.map(lambda _: NamedSharding(mesh, spec), shapes),
    )()

    def make(n):
        step = lambda i, t: jax.tree.map(lambda a: (lax.psum(a, "x") * (1.0 / group)).astype(a.dtype), t)
        fn = jax.jit(
            jax.shard_map(
                lambda t: lax.fori_loop(0, n, step, t),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
                check_vma=False,
            )
        )
        return lambda: fn(t)

    return per_iteration({"tree": make}, (1, reps), calls=3)["tree"]


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
