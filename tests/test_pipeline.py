"""Pipeline API behaviour: updates equal the plain optax step, training reduces the loss, compile reuse."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import rel_err, small_model


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_equals_plain_optax_update(schedule):
    # SGD with momentum: Adam divides by sqrt(v) and so turns float noise in near-zero gradients into
    # lr-sized steps, which would make a parameter comparison meaningless (gradients are compared exactly
    # in test_exactness).
    model, batch_fn = small_model("gpt", 4)
    opt = optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1, momentum=0.9))
    pipe = jp.Pipeline(
        model, schedule=schedule, num_microbatches=4, optimizer=opt, mesh=jp.make_mesh(stages=4)
    )
    state = pipe.init()
    params, opt_state = model.params, opt.init(model.params)
    ref_grad = jax.jit(jax.value_and_grad(model.loss))
    for i in range(3):
        batch = batch_fn(8, s=i)
        state, metrics = pipe.step(state, batch)
        loss, g = ref_grad(params, batch)
        upd, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, upd)
        assert abs(float(metrics["loss"]) - float(loss)) <= 1e-5 * abs(float(loss))
    assert int(metrics["step"]) == 3
    assert rel_err(pipe.params(state), params) <= 1e-5


def test_training_reduces_loss_on_digits():
    train, _ = jp.data.digits()
    model = jp.models.residual_mlp(2, 64, 10, width=32)
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=4, optimizer=optax.adam(3e-3), mesh=jp.make_mesh(stages=2)
    )
    state = pipe.init()
    it = jp.data.class_batches(train, 64)
    losses = []
    for _ in range(40):
        state, m = pipe.step(state, next(it))
        losses.append(float(m["loss"]))
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3])


def test_model_params_survive_donation_and_compile_is_reused():
    model, batch_fn = small_model("mlp", 2)
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    state = pipe.init()
    for i in range(3):
        state, _ = pipe.step(state, batch_fn(4, s=i))
    assert len(pipe._runner._compiled) == 1
    jax.tree.map(lambda a: np.asarray(a), model.params)  # still alive after donated steps
    state2 = pipe.init()
    assert rel_err(pipe.params(state2), model.params) == 0.0


def test_compile_time_flat_in_microbatches():
    """The program is a scan over ticks: its size does not grow with M (HLO text within 10%)."""
    model, _ = small_model("mlp", 4)
    sizes = []
    for M in (4, 32):
        pipe = jp.Pipeline(
            model, schedule="1f1b", num_microbatches=M, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=4)
        )
        batch = {"x": jnp.zeros((2 * M, 12)), "y": jnp.zeros((2 * M,), jnp.int32)}
        text = pipe.lower("step", pipe.init(), batch).as_text()
        sizes.append(len(re.sub(r"dense<[^>]*>", "", text)))  # the schedule table constant grows with M
    assert sizes[1] < 1.1 * sizes[0]
