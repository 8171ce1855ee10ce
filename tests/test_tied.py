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
        stage_fn=lambda w, x: x + jnp.tanh(x @ w["w"]), stage_params=stage_params,
        pre=lambda p, b: p["emb"][b["x"]] + p["pos"], pre_params={"emb": E, "pos": jnp.zeros((T, DM))},
        post_loss=post_loss, post_params={"emb": E, "b": jnp.zeros((V,))},
        tied=[(("emb",), ("emb",))] if tied else ())


def batch_of(n, seed=1):
    r = np.random.default_rng(seed)
    return {"x": r.integers(0, V, (n, T)).astype(np.int32), "y": r.integers(0, V, (n, T)).astype(np.int32)}


def canonical(model):
    s, pre, post = model.params
    return (s, pre, {**post, "emb": None})


def tied_loss(model):
    return lambda c, b: model.loss((c[0], c[1], {**c[2], "emb": c[1]["emb"]}), b)


@pytest.mark.parametrize("schedule,kw", [("gpipe", {}), ("1f1b", {}), ("interleaved_1f1b", {"virtual": 2}),
                                         ("zb_h1", {}), ("chimera", {})])
def test_tied_gradient_is_the_sum_of_both_uses(schedule, kw):
    D = 2 if schedule == "interleaved_1f1b" else 4
    model = tied_lm(D * kw.get("virtual", 1))
    batch = batch_of(8)
    pipe = jp.Pipeline(model, schedule=schedule, num_microbatches=4, optimizer=optax.adamw(1e-2),
                       mesh=jp.make_mesh(stages=D), **kw)
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
    assert np.array_equal(np.asarray(got[1]["emb"]), np.asarray(got[2]["emb"]))     # one array
    assert rel_err(got[1], c[1]) <= 1e-5 and rel_err(got[0], c[0]) <= 1e-5
    # untied (two copies, each with half the uses): the copies drift apart -- what tying prevents
    untied = jp.Pipeline(tied_lm(4, tied=False), schedule="1f1b", num_microbatches=4, optimizer=opt,
                         mesh=jp.make_mesh(stages=4))
    st = untied.init()
    for b in batches:
        st, _ = untied.step(st, b)
    p = untied.params(st)
    assert rel_err(p[2]["emb"], p[1]["emb"]) > 1e-2


def test_tying_is_checked():
    model = tied_lm(2)
    import dataclasses
    with pytest.raises(jp.ConfigError, match="no entry"):
        jp.Pipeline(dataclasses.replace(model, tied=[(("embedding",), ("emb",))]), schedule="1f1b",
                    num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2))
    bad = dataclasses.replace(model, post_params={**model.post_params, "emb": model.post_params["emb"].T})
    with pytest.raises(jp.ConfigError, match="transpose inside"):
        jp.Pipeline(bad, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2))
    with pytest.raises(jp.ConfigError, match="synchronous schedules"):
        jp.Pipeline(model, schedule="pipedream", num_microbatches=2, optimizer=optax.sgd(0.1),
                    mesh=jp.make_mesh(stages=2))


def test_tied_checkpoint_resumes_bit_equal(tmp_path):
    """The train state holds the tied array once (None at the post path); a restore continues bit-equal."""
    def make():
        return jp.Pipeline(tied_lm(2), schedule="1f1b", num_microbatches=2, optimizer=optax.adamw(1e-2),
                           mesh=jp.make_mesh(stages=2))
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
    state2, _, step = jp.Checkpointer(tmp_path / "ck", pipe2).restore_latest(pipe2.init())
    assert step == 2
    for k in range(2, 4):
        state2, _ = pipe2.step(state2, batch_of(4, seed=k))
    want, got = jax.tree.leaves(pipe.params(state)), jax.tree.leaves(pipe2.params(state2))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got))
    ck.close()
