"""Pytree activations (issue #15): the activation sent between stages may be any pytree of float arrays
(here a dict of a hidden state and a running sum of the stages' outputs, in two dtypes' worth of shapes)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.optim.reference import serial_reference
from helpers import rel_err, reference

DIN, DM, C = 6, 8, 4


def pytree_model(num_stages, seed=0):
    r = np.random.default_rng(seed)
    stage_params = {
        "w": jnp.asarray(r.normal(size=(num_stages, DM, DM)) / 3, jnp.float32),
        "u": jnp.asarray(r.normal(size=(num_stages, DM, 2)) / 3, jnp.float32),
    }

    def stage_fn(w, x):
        h = jnp.tanh(x["h"] @ w["w"])
        return {
            "h": h,
            "side": (x["side"][0] + h @ w["u"], x["side"][1] * 0.9 + jnp.sum(h, -1, keepdims=True)),
        }

    def post_loss(p, x, b):
        logits = x["h"] @ p["out"] + jnp.concatenate([x["side"][0], x["side"][1]], -1) @ p["side"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], -1))

    pre = lambda p, b: {
        "h": b["x"] @ p,
        "side": (jnp.zeros((b["x"].shape[0], 2)), jnp.ones((b["x"].shape[0], 1))),
    }
    return jp.PipelineModel(
        stage_fn=stage_fn,
        stage_params=stage_params,
        pre=pre,
        pre_params=jnp.asarray(r.normal(size=(DIN, DM)) / 2, jnp.float32),
        post_loss=post_loss,
        post_params={
            "out": jnp.asarray(r.normal(size=(DM, C)), jnp.float32),
            "side": jnp.asarray(r.normal(size=(3, C)), jnp.float32),
        },
    )


def batch_of(n, seed=1):
    r = np.random.default_rng(seed)
    return {"x": r.normal(size=(n, DIN)).astype(np.float32), "y": r.integers(0, C, n).astype(np.int32)}


@pytest.mark.parametrize(
    "schedule,kw,data",
    [
        ("gpipe", {}, 1),
        ("1f1b", {}, 2),
        ("zb_h1", {}, 1),
        ("interleaved_1f1b", {"options": {"virtual": 2}}, 1),
        ("chimera", {}, 1),
    ],
)
def test_pytree_activation_equals_jax_grad(schedule, kw, data):
    D, M = (2 if schedule == "interleaved_1f1b" else 4), 4
    model = pytree_model(D * kw.get("options", {}).get("virtual", 1))
    batch = batch_of(2 * M * data)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=D, data=data),
        nan_bubbles=True,
        **kw,
    )
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("schedule", ["pipedream", "pipeoptim", "pipedream_2bw", "wpipe"])
def test_pytree_activation_in_no_flush_methods(schedule):
    D, M = 2, 2
    model = pytree_model(2 * D if schedule == "wpipe" else D)
    batches = [batch_of(2 * M, seed=s) for s in (3, 4)]
    opt = optax.sgd(0.05)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=opt,
        mesh=jp.make_mesh(stages=D),
        nan_bubbles=True,
    )
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    state, _ = pipe.drain(state)
    ref = serial_reference(model, schedule, opt, M, batches)
    change = jax.tree.map(lambda a, b: a - b, pipe.params(state), model.params)
    ref_change = jax.tree.map(lambda a, b: a - b, ref["params"], model.params)
    assert rel_err(change, ref_change) <= 1e-4


def test_cyclic_data_parallel_takes_pytree_activations():
    model = pytree_model(2)
    cdp = jp.CyclicDataParallel(model, optax.sgd(0.05), rule="v1", mesh=jp.make_mesh(stages=1, data=2))
    state = cdp.init()
    for s in range(3):
        state, m = cdp.step(state, batch_of(4, seed=s))
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(cdp.params(state)))


def test_activation_errors_are_clear():
    model = pytree_model(2)
    changes = dataclasses.replace(model, stage_fn=lambda w, x: {"h": x["h"]})
    pipe = jp.Pipeline(
        changes, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match="same shape and dtype"):
        pipe.loss_and_grad(pipe.init(), batch_of(4))
    ints = dataclasses.replace(
        model,
        pre=lambda p, b: {"h": b["x"] @ p, "side": (jnp.zeros((4, 2)), b["y"][:, None])},
        stage_fn=lambda w, x: {"h": jnp.tanh(x["h"] @ w["w"]), "side": x["side"]},
    )
    pipe = jp.Pipeline(
        ints, schedule="1f1b", num_microbatches=1, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match="stage_inputs"):
        pipe.loss_and_grad(pipe.init(), batch_of(4))
