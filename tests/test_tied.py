"""Tied parameters (issue #15): an embedding used by ``pre`` and by ``post_loss`` is one array -- one
gradient (the sum of its uses), one optimizer state, one update, bit-identical wherever it is read."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import rel_err

V, DM, T = 13, 8, 5


def tied_lm(num_stages, tied=True, seed=0):
    r = np.random.default_rng(seed)
    E = jnp.asarray(r.normal(size=(V, DM)) / 2, jnp.float32)
    stage_params = {"w": jnp.asarray(r.normal(size=(num_stages, DM, DM)) / 3, jnp.float32)}

    def post_loss(p, h, b):
        logits = h @ p["emb"].T + p["b"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], -1))

    return jp.PipelineModel(
        stage_fn=lambda w, x: x + jnp.tanh(x @ w["w"]),
        stage_params=stage_params,
        pre=lambda p, b: p["emb"][b["x"]] + p["pos"],
        pre_params={"emb": E, "pos": jnp.zeros((T, DM))},
        post_loss=post_loss,
        post_params={"emb": E, "b": jnp.zeros((V,))},
        tied=[(("emb",), ("emb",))] if tied else (),
    )


def batch_of(n, seed=1):
    r = np.random.default_rng(seed)
    return {"x": r.integers(0, V, (n, T)).astype(np.int32), "y": r.integers(0, V, (n, T)).astype(np.int32)}


def canonical(model):
    s, pre, post = model.params
    return (s, pre, {**post, "emb": None})


def tied_loss(model):
    return lambda c, b: model.loss((c[0], c[1], {**c[2], "emb": c[1]["emb"]}), b)


@pytest.mark.parametrize(
    "schedule,kw",
    [("gpipe", {}), ("1f1b", {}), ("interleaved_1f1b", {"virtual": 2}), ("zb_h1", {}), ("chimera", {})],
)
def test_tied_gradient_is_the_sum_of_both_uses(schedule, kw):
    D = 2 if schedule == "interleaved_1f1b" else 4
    model = tied_lm(D * kw.get("virtual", 1))
    batch = batch_of(8)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        optimizer=optax.adamw(1e-2),
        mesh=jp.make_mesh(stages=D),
        options=kw or None,
    )
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = jax.value_and_grad(tied_loss(model))(canonical(model), batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5


def test_tied_training_equals_one_array_trained_by_optax_and_stays_identical():
    model = tied_lm(4)
    opt = optax.adamw(3e-2)
    batches = [batch_of(8, seed=s) for s in range(4)]
    pipe = jp.Pipeline(model, schedule="1f1b", num_microbatches=4, optimizer=opt, mesh=jp.make_mesh(stages=4))
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    c, o = canonical(model), None
    o = opt.init(c)
    g_fn = jax.jit(jax.grad(tied_loss(model)))
    for b in batches:
        u, o = opt.update(g_fn(c, b), o, c)
        c = optax.apply_updates(c, u)
    got = pipe.params(state)
    assert np.array_equal(np.asarray(got[1]["emb"]), np.asarray(got[2]["emb"]))  # one array
    assert rel_err(got[1], c[1]) <= 1e-5 and rel_err(got[0], c[0]) <= 1e-5
    # untied (two copies, each with half the uses): the copies drift apart -- what tying prevents
    untied = jp.Pipeline(
        tied_lm(4, tied=False),
        schedule="1f1b",
        num_microbatches=4,
        optimizer=opt,
        mesh=jp.make_mesh(stages=4),
    )
    st = untied.init()
    for b in batches:
        st, _ = untied.step(st, b)
    p = untied.params(st)
    assert rel_err(p[2]["emb"], p[1]["emb"]) > 1e-2


def test_tying_is_checked():
    model = tied_lm(2)
    import dataclasses

    with pytest.raises(jp.ConfigError, match="no entry"):
        jp.Pipeline(
            dataclasses.replace(model, tied=[(("embedding",), ("emb",))]),
            schedule="1f1b",
            num_microbatches=2,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=2),
        )
    bad = dataclasses.replace(model, post_params={**model.post_params, "emb": model.post_params["emb"].T})
    with pytest.raises(jp.ConfigError, match="transpose inside"):
        jp.Pipeline(
            bad, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
        )
    # two arrays of one shape but different values: the post one would be dropped silently
    other = dataclasses.replace(model, post_params={**model.post_params, "emb": model.post_params["emb"] * 2})
    for schedule in ("1f1b", "pipeoptim"):
        with pytest.raises(
            jp.ConfigError,
            match=r"pre_params\['emb'\] and post_params\['emb'\] hold different "
            r"values \(largest difference [0-9.e+-]+\)",
        ):
            jp.Pipeline(
                other,
                schedule=schedule,
                num_microbatches=2,
                optimizer=optax.sgd(0.1),
                mesh=jp.make_mesh(stages=2),
            )
    copy = dataclasses.replace(
        model, post_params={**model.post_params, "emb": jnp.array(model.post_params["emb"])}
    )
    jp.Pipeline(
        copy, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )


@pytest.mark.parametrize("schedule", ["1f1b", "pipeoptim"])
def test_tied_checkpoint_resumes_bit_equal(schedule, tmp_path):
    """The train state holds the tied array once (None at the post path); a restore continues bit-equal
    (pipeoptim: mid-stream, with the tied versions and gradients in flight in the carry)."""

    def make():
        return jp.Pipeline(
            tied_lm(2),
            schedule=schedule,
            num_microbatches=2,
            optimizer=optax.adamw(1e-2),
            mesh=jp.make_mesh(stages=2),
        )

    pipe = make()
    state = pipe.init()
    assert state.params[2]["emb"] is None
    ck = jp.Checkpointer(tmp_path / "ck", pipe, async_save=False)
    for k in range(2):
        state, _ = pipe.step(state, batch_of(4, seed=k))
    ck.save(2, state)
    for k in range(2, 4):
        state, _ = pipe.step(state, batch_of(4, seed=k))
    pipe2 = make()
    template = pipe2.prepare(pipe2.init(), batch_of(4))
    state2, _, step = jp.Checkpointer(tmp_path / "ck", pipe2).restore_latest(template)
    assert step == 2
    for k in range(2, 4):
        state2, _ = pipe2.step(state2, batch_of(4, seed=k))
    want, got = jax.tree.leaves(pipe.params(state)), jax.tree.leaves(pipe2.params(state2))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got))
    ck.close()


# ---------------------------------------------------------------- no-flush methods (jaxpipe.tying's rule)
def change(params, model):
    """Parameter change since init: what the methods' rules decide (the initial values dominate the
    params)."""
    return jax.tree.map(
        lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), params, model.params
    )


def run_no_flush(method, model, D, M, opt, batches):
    pipe = jp.Pipeline(
        model,
        schedule=method,
        num_microbatches=M,
        optimizer=opt,
        mesh=jp.make_mesh(stages=D),
        nan_bubbles=True,
    )
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    state, m = pipe.drain(state)
    return pipe.params(state), m


@pytest.mark.parametrize(
    "method,D",
    [
        ("pipedream", 4),
        ("pipeoptim", 4),
        ("spectrain", 4),
        ("pipedream_2bw", 4),
        ("cdp_v1", 4),
        ("cdp_v2", 4),
        ("wpipe", 2),
        ("wpipe", 1),
    ],
)
def test_no_flush_tying_equals_serial_reference(method, D):
    """One tied array under each method's own rule: the last stage reads the version stage 0's forward read
    for the same micro-batch, its gradient joins stage 0's; equal to the serial reference, NaN bubbles stay
    out, and both uses read one array (bit-identical in the returned parameters)."""
    from jaxpipe.optim.reference import serial_reference

    stages = 2 * D if method == "wpipe" else D
    model = tied_lm(stages)
    opt = optax.sgd(0.1, momentum=0.9) if method == "spectrain" else optax.adamw(3e-2)
    batches = [batch_of(8, seed=s) for s in range(3)]
    got, m = run_no_flush(method, model, D, 4, opt, batches)
    assert int(m.get("version_errors", 0)) == 0
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(got))
    assert np.array_equal(np.asarray(got[1]["emb"]), np.asarray(got[2]["emb"]))
    ref = serial_reference(model, method, opt, 4, batches)["params"]
    assert rel_err(change(got, model), change(ref, model)) <= 1e-5


def test_tied_reference_is_plain_optax_when_the_pipeline_is_one_stage():
    """Degenerate case, independent of the executor's code: at D = 1 PipeDream is one optax update per
    micro-batch on jax.grad of the tied loss."""
    from jaxpipe.optim.reference import global_microbatches, serial_reference

    model, opt = tied_lm(1), optax.adamw(3e-2)
    batches = [batch_of(8, seed=s) for s in range(2)]
    c = canonical(model)
    o = opt.init(c)
    g_fn = jax.jit(jax.grad(tied_loss(model)))
    for b in batches:
        for mb in global_microbatches(b, 4):
            u, o = opt.update(g_fn(c, mb), o, c)
            c = optax.apply_updates(c, u)
    want = (c[0], c[1], {**c[2], "emb": c[1]["emb"]})
    ref = serial_reference(model, "pipedream", opt, 4, batches)["params"]
    assert rel_err(change(ref, model), change(want, model)) <= 1e-5
    got, _ = run_no_flush("pipedream", model, 1, 4, opt, batches)
    assert rel_err(change(got, model), change(want, model)) <= 1e-5


def test_tying_changes_what_a_no_flush_method_computes():
    """The rule is visible: the tied run differs from the untied one (two arrays, each with its own use) by
    far more than the tolerance, and an untied pair drifts apart where the tied array cannot."""
    from jaxpipe.optim.reference import serial_reference

    opt, batches = optax.adamw(3e-2), [batch_of(8, seed=s) for s in range(3)]
    tied = serial_reference(tied_lm(4), "pipeoptim", opt, 4, batches)["params"]
    untied_model = tied_lm(4, tied=False)
    untied = serial_reference(untied_model, "pipeoptim", opt, 4, batches)["params"]
    assert rel_err(change(untied, untied_model)[1], change(tied, untied_model)[1]) > 1e-3
    assert rel_err(untied[2]["emb"], untied[1]["emb"]) > 1e-3


def test_tied_cyclic_data_parallel_and_avgpipe():
    from jaxpipe.optim.reference import avgpipe_reference, serial_reference

    opt = optax.adamw(3e-2)
    model = tied_lm(4)
    batches = [batch_of(8, seed=s) for s in range(3)]
    cdp = jp.CyclicDataParallel(model, opt, rule="v2", mesh=jp.make_mesh(data=4))
    st = cdp.init()
    for b in batches:
        st, _ = cdp.step(st, b)
    st, m = cdp.drain(st)
    got = cdp.params(st)
    assert int(m["version_errors"]) == 0 and np.array_equal(
        np.asarray(got[1]["emb"]), np.asarray(got[2]["emb"])
    )
    ref = serial_reference(model, "cdp_v2", opt, 4, batches)["params"]
    assert rel_err(change(got, model), change(ref, model)) <= 1e-5
    model = tied_lm(2)
    pipe = jp.Pipeline(
        model,
        schedule="avgpipe",
        num_microbatches=2,
        optimizer=opt,
        mesh=jp.make_mesh(stages=2, pipes=2),
        options={"advance": 0},
        nan_bubbles=True,
    )
    st = pipe.init()
    assert st.params[2]["emb"] is None  # held once per replica
    for b in batches:
        st, _ = pipe.step(st, b)
    got = pipe.params(st)
    ref = avgpipe_reference(model, opt, 2, 2, batches)["params"]
    assert rel_err(change(got, model), change(ref, model)) <= 1e-5
