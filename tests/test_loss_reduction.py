"""Loss normalisation (issue #15): a ``post_loss`` returning ``(sum, count)`` is divided by the count summed
over every micro-batch and data replica, so a masked token loss with variable lengths equals the unpipelined
full-batch masked mean; the scalar form stays the mean of micro-batch means (the default)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.optim.reference import serial_reference
from helpers import rel_err, small_model


def masked_gpt(D):
    """The test GPT with a padding mask: post_loss returns (sum of real tokens' losses, number of them)."""
    model, _ = small_model("gpt", D)

    def post_loss(p, h, b):
        logits = model.head(p, h)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], -1)[..., 0]
        m = b["mask"].astype(ce.dtype)
        return jnp.sum(ce * m), jnp.sum(m)

    def mean_of_means(p, h, b):
        s, n = post_loss(p, h, b)
        return s / n

    return dataclasses.replace(model, post_loss=post_loss), dataclasses.replace(
        model, post_loss=mean_of_means
    )


def padded_batch(n, seed=1):
    """Sequences of very different lengths (1..8 real tokens): a mean of means weighs them wrongly."""
    r = np.random.default_rng(seed)
    t = r.integers(0, 32, (n, 9)).astype(np.int32)
    lengths = r.integers(1, 9, n)
    mask = (np.arange(8)[None] < lengths[:, None]).astype(np.float32)
    return {"x": t[:, :-1], "y": t[:, 1:], "mask": mask}


@pytest.mark.parametrize(
    "schedule,kw,data",
    [
        ("gpipe", {}, 1),
        ("1f1b", {}, 2),
        ("1f1b", {"placement": "ordered"}, 1),
        ("zb_h1", {}, 1),
        ("interleaved_1f1b", {"options": {"virtual": 2}}, 1),
        ("chimera", {}, 1),
    ],
)
def test_summed_loss_equals_full_batch_masked_mean(schedule, kw, data):
    D, M = 2 if schedule == "interleaved_1f1b" else 4, 4
    model, _ = masked_gpt(D * kw.get("options", {}).get("virtual", 1))
    batch = padded_batch(2 * M * data)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss))(model.params, batch)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=D, data=data),
        **kw,
    )
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5


def test_mean_of_means_is_what_the_scalar_form_gives_and_differs():
    """The scalar form is the mean of the micro-batch means (documented default); on this batch it is far
    from the true masked mean (so the summed test above could fail)."""
    summed, scalar = masked_gpt(4)
    batch = padded_batch(8)
    pipe = jp.Pipeline(
        scalar, schedule="1f1b", num_microbatches=4, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=4)
    )
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    mbs = [jax.tree.map(lambda a: a[2 * j : 2 * j + 2], batch) for j in range(4)]
    mom = lambda p: sum(scalar.loss(p, mb) for mb in mbs) / 4
    ref_loss, ref_grads = jax.value_and_grad(mom)(scalar.params)
    assert rel_err(grads, ref_grads) <= 1e-5
    true_grads = jax.grad(summed.loss)(summed.params, batch)
    assert rel_err(grads, true_grads) > 1e-2


def test_summed_loss_in_a_per_microbatch_updater_equals_its_reference():
    """PipeDream with data = 2: each micro-batch's loss is its sum over both replicas' real tokens / their
    count (the serial reference's global micro-batch mean)."""
    model, _ = masked_gpt(2)
    M, data = 2, 2
    batches = [padded_batch(2 * M * data, seed=s) for s in (3, 4)]
    pipe = jp.Pipeline(
        model,
        schedule="pipedream",
        num_microbatches=M,
        optimizer=optax.sgd(0.05),
        mesh=jp.make_mesh(stages=2, data=data),
    )
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    state, _ = pipe.drain(state)
    ref = serial_reference(model, "pipedream", optax.sgd(0.05), M, batches, data_parallel=data)
    got = pipe.params(state)
    assert rel_err(got, ref["params"]) <= 1e-5
    change = jax.tree.map(lambda a, b: a - b, got, model.params)
    ref_change = jax.tree.map(lambda a, b: a - b, ref["params"], model.params)
    assert rel_err(change, ref_change) <= 1e-4


def _change(p, model):
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), p, model.params)


@pytest.mark.parametrize(
    "schedule,D,data", [("pipedream_2bw", 2, 1), ("cdp_v2", 2, 2), ("wpipe", 2, 1), ("wpipe", 1, 2)]
)
def test_summed_loss_in_an_accumulating_method_equals_its_reference(schedule, D, data):
    """2BW / CDP / WPipe sum a step's micro-batch gradients of the summed losses; every micro-batch's global
    count travels back with dL/dy (WPipe: through the wrap-around too) and each stage divides its step's sum
    by the step's count -- the serial reference's exact masked mean per step, far from the mean of means."""
    M = 2
    model, scalar = masked_gpt(2 * D if schedule == "wpipe" else D)
    batches = [padded_batch(2 * M * data, seed=s) for s in (3, 4, 5)]
    opt = optax.sgd(0.05, momentum=0.9)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=opt,
        mesh=jp.make_mesh(stages=D, data=data),
        nan_bubbles=True,
    )
    state = pipe.init()
    for b in batches:
        state, m = pipe.step(state, b)
        assert np.isfinite(float(m["loss"]))
    state, _ = pipe.drain(state)
    ref = serial_reference(model, schedule, opt, M, batches, data_parallel=data)["params"]
    got = pipe.params(state)
    assert rel_err(_change(got, model), _change(ref, model)) <= 1e-5
    mom = serial_reference(scalar, schedule, opt, M, batches, data_parallel=data)["params"]
    assert rel_err(_change(mom, model), _change(ref, model)) > 1e-2


def test_summed_loss_in_cyclic_data_parallel_equals_its_reference():
    N = 4
    model, _ = masked_gpt(N)
    batches = [padded_batch(2 * N, seed=s) for s in (3, 4, 5)]
    opt = optax.sgd(0.05, momentum=0.9)
    cdp = jp.CyclicDataParallel(model, opt, rule="v2", mesh=jp.make_mesh(data=N))
    state = cdp.init()
    for b in batches:
        state, _ = cdp.step(state, b)
    state, m = cdp.drain(state)
    assert int(m["version_errors"]) == 0
    ref = serial_reference(model, "cdp_v2", opt, N, batches)["params"]
    assert rel_err(_change(cdp.params(state), model), _change(ref, model)) <= 1e-5


def test_post_loss_of_a_wrong_form_is_a_clear_error():
    model, _ = small_model("mlp", 2)
    bad = dataclasses.replace(model, post_loss=lambda p, h, b: (jnp.sum(h), jnp.sum(h), 1.0))
    pipe = jp.Pipeline(
        bad, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    x = {"x": np.zeros((4, 12), np.float32), "y": np.zeros((4,), np.int32)}
    with pytest.raises(jp.ConfigError, match="scalar mean loss"):
        pipe.loss_and_grad(pipe.init(), x)


@pytest.mark.parametrize("schedule", ["pipedream", "pipeoptim", "pipedream_2bw", "1f1b"])
def test_a_fully_masked_micro_batch_contributes_nothing(schedule):
    """A (sum, count) loss whose micro-batch has no real token: 0 / 0 made every parameter NaN in the
    per-micro-batch updaters; now that micro-batch's gradient is zero (its update still runs: the optimizer's
    step with a zero gradient), equal to the serial reference, and the parameters stay finite."""
    model, _ = masked_gpt(2)
    M = 2
    batches = [padded_batch(2 * M, seed=s) for s in (3, 4)]
    batches[0]["mask"][2:] = 0.0  # micro-batch 1 of the first step: nothing to learn from
    opt = optax.sgd(0.05)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=opt,
        mesh=jp.make_mesh(stages=2),
        nan_bubbles=True,
    )
    state = pipe.init()
    for b in batches:
        state, m = pipe.step(state, b)
        assert np.isfinite(float(m["loss"]))
    if pipe.is_async:
        state, _ = pipe.drain(state)
    got = pipe.params(state)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(got))
    if schedule != "1f1b":
        ref = serial_reference(model, schedule, opt, M, batches)["params"]
        assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(ref))
        assert rel_err(_change(got, model), _change(ref, model)) <= 1e-5
