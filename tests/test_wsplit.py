"""ZB's W from the per-layer output gradients B keeps (jaxpipe.runtime.wsplit): B and W together compute
what the fused backward computes -- the same bits, no matmul twice -- and the executor runs it that way."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.bench import make_tanh_mlp
from jaxpipe.runtime.stage import StageOps
from jaxpipe.runtime.wsplit import split_backward
from helpers import assert_same, reference, rel_err, small_model


def _dots(f, *args) -> int:
    """Matrix products in the compiled program (XLA drops the dead ones)."""
    return jax.jit(f).lower(*args).compile().as_text().count(" dot(")


def _stage(kind):
    if kind == "tanh":
        model, mb, width = make_tanh_mlp(4, 3, 32), None, 32
    else:
        model, batch_fn = small_model(kind, 4)
        mb = jax.tree.map(jnp.asarray, batch_fn(4))
        width = 16
    w = jax.tree.map(lambda a: a[0], model.stage_params)
    x = model.pre(model.pre_params, mb) if mb is not None else jnp.ones((4, width))
    ops, avals = StageOps.build(model, w, x, mb)
    k = jax.random.split(jax.random.key(0), 3)
    res = [
        jax.random.normal(k[0], a.shape, a.dtype)
        if jnp.issubdtype(a.dtype, jnp.floating)
        else jnp.zeros(a.shape, a.dtype)
        for a in avals
    ]
    dy = jax.tree.map(lambda a: jax.random.normal(k[1], a.shape, a.dtype), x)
    return ops, avals, w, res, dy


@pytest.mark.parametrize("kind", ["tanh", "mlp", "gpt"])
def test_split_is_the_fused_backward_without_recomputation(kind):
    ops, avals, w, res, dy = _stage(kind)
    sp = split_backward(ops.backward, w, res, dy, avals)
    assert sp is not None
    dw, dx = jax.jit(ops.backward)(w, res, dy)
    dx2, front = jax.jit(sp.input_part)(w, res, dy)
    dw2 = jax.jit(sp.weight_part)(w, res, dy, front)
    # two compiled programs: equal to rounding in an optimised build (measured <= 1.4e-7 on the GPT stage),
    # bit-equal with the suite's --xla_backend_optimization_level=0 on XLA's MLIR fusion emitters (the older
    # LLVM IR ones, which the suite takes where jaxlib has them, round the GPT stage's two programs apart)
    assert rel_err((dw2, dx2), (dw, dx)) <= 1e-6
    if "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "") and not os.environ.get(
        "JAXPIPE_TEST_LEGACY_EMITTERS"
    ):
        for a, b in zip(jax.tree.leaves((dw, dx)), jax.tree.leaves((dw2, dx2))):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    fused = _dots(ops.backward, w, res, dy)
    b_only, w_only = _dots(sp.input_part, w, res, dy), _dots(sp.weight_part, w, res, dy, front)
    w_recomputed = _dots(lambda *a: ops.backward(*a)[0], w, res, dy)
    assert b_only + w_only == fused
    assert w_only < w_recomputed, (w_only, w_recomputed)  # the old W went through the stage again


def _scanned(L=3):
    def stage_fn(p, h):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, p)[0]

    w = jax.random.normal(jax.random.key(0), (L, 8, 8)) / 3
    return stage_fn, w


def _split_of(stage_fn, w):
    """``(ops, stash avals, residuals, dy, split)`` of one stage ``stage_fn`` with weights ``w`` on a 4 x 8
    input."""
    x, dy = jax.random.normal(jax.random.key(1), (4, 8)), jax.random.normal(jax.random.key(2), (4, 8))
    model = jp.PipelineModel(
        stage_fn=stage_fn, stage_params=jnp.stack([w, w]), post_loss=lambda p, h, b: jnp.mean(h**2)
    )
    ops, avals = StageOps.build(model, w, x, None)
    _, res, _ = ops.forward(w, x, None, (), (), False, False, None)
    return ops, avals, res, dy, split_backward(ops.backward, w, res, dy, avals)


def test_layers_inside_one_scan_are_split():
    """A stage whose layers are one lax.scan (the adapters' and MaxText's form): B runs a scan of the
    input-gradient equations only and stacks each layer's output gradient; W maps the weight-gradient
    equations over the layers. Together they equal the fused backward bit for bit, B does one matrix product
    per layer, and the frontier is smaller than the stash."""
    stage_fn, w = _scanned()
    ops, avals, res, dy, sp = _split_of(stage_fn, w)
    assert sp is not None
    dw, dx = ops.backward(w, res, dy)
    dx_b, front = sp.input_part(w, res, dy)
    assert_same(dx_b, dx)
    assert_same(sp.weight_part(w, res, dy, front), dw)
    dots = lambda f: str(jax.make_jaxpr(f)(w, res, dy)).count("dot_general")
    # in the scan bodies: B's one product per layer (dx); the fused backward's two (dx, dw), plus the dead
    # forward its rebuilt pullback traces (XLA drops it)
    assert dots(sp.input_part) == 1 and dots(ops.backward) >= 2
    nbytes = lambda avs: sum(int(np.prod(a.shape)) * 4 for a in avs)
    assert nbytes(sp.frontier_avals) < nbytes(avals)


def _top_level_adds(f, *args, shape):
    """``add`` equations of ``f``'s jaxpr (outside its loops) whose result has ``shape``."""
    return sum(
        e.primitive.name == "add" and tuple(e.outvars[0].aval.shape) == tuple(shape)
        for e in jax.make_jaxpr(f)(*args).jaxpr.eqns
    )


def test_w_adds_a_scanned_stages_gradient_into_the_sums_layer_by_layer():
    """``weight_part_into``: the sums plus W's gradient, as ``add`` makes them, with the stacked weight
    gradient added slice by slice inside the loop over layers (no stacked buffer and no whole-array add after
    it: 7.8
    -> 5.1 ms a W on the two-process testbed's stage)."""
    stage_fn, w = _scanned()
    ops, avals, res, dy, sp = _split_of(stage_fn, w)
    _, front = sp.input_part(w, res, dy)
    sums = jax.random.normal(jax.random.key(3), w.shape)
    add = lambda u, v: u + v / 3.0
    into = sp.weight_part_into(w, res, dy, front, sums, add)
    assert rel_err(into, add(sums, sp.weight_part(w, res, dy, front))) <= 1e-6
    assert sp.in_place
    assert (
        _top_level_adds(lambda *a: sp.weight_part_into(*a, add), w, res, dy, front, sums, shape=w.shape) == 0
    )
    # the stacked form has that add (what the check would see if W stacked first)
    assert (
        _top_level_adds(
            lambda *a: add(a[-1], sp.weight_part(*a[:-1])), w, res, dy, front, sums, shape=w.shape
        )
        == 1
    )
    with pytest.raises(ValueError, match="not shaped like the weight gradient"):
        sp.weight_part_into(w, res, dy, front, {"w": sums}, add)


def test_w_into_the_sums_where_the_scans_gradient_is_not_the_stages_own():
    """A stage reading its stacked weights outside the scan too: the scan's weight gradient is one part of the
    stage's, so W stacks it and adds the whole -- still the sums plus W's gradient."""

    def stage_fn(p, h):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, p)[0] @ p[0]

    _, w = _scanned()
    ops, avals, res, dy, sp = _split_of(stage_fn, w)
    assert sp is not None and not sp.in_place  # the flushing B keeps its fused backward here
    _, front = sp.input_part(w, res, dy)
    sums = jax.random.normal(jax.random.key(3), w.shape)
    assert (
        rel_err(sp.weight_part_into(w, res, dy, front, sums, jnp.add), sums + ops.backward(w, res, dy)[0])
        <= 1e-5
    )


def test_zb_h1_with_scanned_stages_matches_jax_grad():
    """ZB-H1 over stages that scan their layers: exact with NaN bubbles, and fewer products with the
    frontier."""
    stage_fn, w = _scanned()
    W = jnp.stack([w, w * 0.5])
    model = jp.PipelineModel(
        stage_fn=stage_fn, stage_params=W, post_loss=lambda p, h, b: jnp.mean((h - b["y"]) ** 2)
    )
    r = np.random.default_rng(0)
    batch = {"x": r.normal(size=(8, 8)).astype(np.float32), "y": r.normal(size=(8, 8)).astype(np.float32)}
    ref = jax.grad(model.loss)(model.params, batch)
    counts = {}
    for wf in ("frontier", "recompute"):
        pipe = jp.Pipeline(
            model,
            schedule="zb_h1",
            num_microbatches=4,
            mesh=jp.make_mesh(stages=2),
            options={"w_from": wf},
            nan_bubbles=True,
        )
        state = pipe.init()
        _, grads = pipe.loss_and_grad(state, batch)
        assert rel_err(grads, ref) <= 1e-5
        counts[wf] = pipe.lower("grad", state, batch).compile().as_text().count(" dot(")
    assert counts["frontier"] < counts["recompute"]


@pytest.mark.parametrize("w_from", ["frontier", "recompute"])
def test_executor_runs_w_from_the_frontier(w_from):
    """The compiled zb_h1 program has fewer matrix products with the frontier (W no longer goes through the
    stage again), and both forms equal jax.grad."""
    model, batch_fn = small_model("mlp", 2)
    batch = batch_fn(8)
    counts = {}
    for wf in ("frontier", "recompute"):
        pipe = jp.Pipeline(
            model,
            schedule="zb_h1",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=2),
            options={"w_from": wf},
        )
        state = pipe.init()
        counts[wf] = pipe.lower("step", state, batch).compile().as_text().count(" dot(")
        if wf == w_from:
            loss, grads = pipe.loss_and_grad(state, batch)
            assert rel_err(grads, reference(model, batch)[1]) <= 1e-5
    assert counts["frontier"] < counts["recompute"], counts
    # the ordered placement defers W further: its frontier needs several slots (the lanes' one)
    pipe = jp.Pipeline(
        model,
        schedule="zb_h1",
        num_microbatches=4,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=2),
        options={"w_from": w_from},
        placement="ordered",
    )
    assert w_from == "recompute" or pipe.lane_plan.front_capacity > 1
    assert rel_err(pipe.loss_and_grad(pipe.init(), batch)[1], reference(model, batch)[1]) <= 1e-5


def test_bad_w_from():
    model, _ = small_model("mlp", 2)
    with pytest.raises(
        jp.ConfigError, match=r"options\['w_from'\]='both' \(str\); it must be one of 'frontier', 'recompute'"
    ):
        jp.Pipeline(
            model,
            schedule="zb_h1",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=2),
            options={"w_from": "both"},
        )


def test_scan_layout_reads_this_jax():
    """The one place that reads JAX internals understands this JAX's scan equation (0.10's
    num_consts/num_carry,
    0.11+'s ft_in): constants, carry and scanned inputs counted as the program passes them."""
    from jaxpipe.jax_internals import scan_layout

    def f(c0, w, k):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi) * k, c.sum()), c0, w)

    jx = jax.make_jaxpr(f)(jnp.ones((2, 4)), jnp.ones((3, 4, 4)), jnp.float32(2.0))
    eqn = next(e for e in jx.jaxpr.eqns if e.primitive.name == "scan")
    lay = scan_layout(eqn)
    assert (lay.num_consts, lay.num_carry, lay.length, lay.reverse) == (1, 1, 3, False)
    assert len(lay.body.jaxpr.invars) == len(eqn.invars) == 3


def test_an_unreadable_scan_falls_back_to_recomputing_w_exactly(monkeypatch):
    """Where jaxpipe cannot read a JAX's scan parameters, ZB's W recomputes the stage's backward (exact, one
    warning) instead of crashing."""
    import warnings
    from jaxpipe.jax_internals import UnknownJaxprLayout
    from jaxpipe.runtime import wsplit

    def unreadable(eqn):
        raise UnknownJaxprLayout("a scan equation with parameters ['future']")

    monkeypatch.setattr(wsplit, "scan_layout", unreadable)
    monkeypatch.setattr(wsplit, "_WARNED", set())
    stage_fn, w = _scanned()
    model = jp.PipelineModel(
        stage_fn=stage_fn,
        stage_params=jnp.stack([w, w * 0.5]),
        post_loss=lambda p, h, b: jnp.mean((h - b["y"]) ** 2),
    )
    r = np.random.default_rng(0)
    batch = {"x": r.normal(size=(8, 8)).astype(np.float32), "y": r.normal(size=(8, 8)).astype(np.float32)}
    pipe = jp.Pipeline(
        model, schedule="zb_h1", num_microbatches=4, mesh=jp.make_mesh(stages=2), nan_bubbles=True
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, grads = pipe.loss_and_grad(pipe.init(), batch)
    assert rel_err(grads, jax.grad(model.loss)(model.params, batch)) <= 1e-5
    said = [str(c.message) for c in caught if "recomputes" in str(c.message)]
    assert len(said) == 1 and "jaxpipe.jax_internals" in said[0]


@pytest.mark.parametrize(
    "schedule,stages,options",
    [("1f1b", 2, {}), ("gpipe", 2, {}), ("interleaved_1f1b", 4, {"virtual": 2}), ("chimera", 2, {})],
)
def test_flushing_schedules_add_a_scanned_stages_gradient_in_place(monkeypatch, schedule, stages, options):
    """A flushing schedule's B (the ``gradient`` policy's sums) runs as B's input part then W added into the
    sums layer by layer (``weight_part_into``): exact against jax.grad with NaN bubbles, and that path
    traced."""
    import jaxpipe.runtime.executor as executor

    used = []

    def recording(*a, **k):
        sp = split_backward(*a, **k)
        if sp is None:
            return None
        return sp._replace(weight_part_into=lambda *b: used.append(1) or sp.weight_part_into(*b))

    monkeypatch.setattr(executor, "split_backward", recording)
    stage_fn, w = _scanned()
    W = jnp.stack([w * (1 - 0.1 * s) for s in range(stages)])
    model = jp.PipelineModel(
        stage_fn=stage_fn, stage_params=W, post_loss=lambda p, h, b: jnp.mean((h - b["y"]) ** 2)
    )
    r = np.random.default_rng(0)
    batch = {"x": r.normal(size=(8, 8)).astype(np.float32), "y": r.normal(size=(8, 8)).astype(np.float32)}
    ref = jax.grad(model.loss)(model.params, batch)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        mesh=jp.make_mesh(stages=2),
        options=options,
        nan_bubbles=True,
    )
    _, grads = pipe.loss_and_grad(pipe.init(), batch)
    assert rel_err(grads, ref) <= 1e-5
    assert used, "the summing B did not add its weight gradient in place"
