"""Stage context (issue #15): ``stage_fn(w, x, ctx)`` reads the micro-batch's side inputs (an attention
padding mask, never sent between stages), a PRNG key that depends only on (step, micro-batch, stage) --
dropout -- and the stage index.  Every schedule equals the unpipelined model run micro-batch by micro-batch
with ``model.loss(params, mb, key=jp.microbatch_key(seed, step, r * M + j))``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import rel_err

T, DM, V = 6, 8, 11


def context_model(num_stages, rate=0.25, seed=0):
    """A small attention + MLP block per stage: padding mask from ctx.inputs, dropout from ctx.key, a
    per-stage residual scale from ctx.stage."""
    r = np.random.default_rng(seed)
    stage_params = {
        "qkv": jnp.asarray(r.normal(size=(num_stages, DM, 3 * DM)) / 3, jnp.float32),
        "mlp": jnp.asarray(r.normal(size=(num_stages, DM, DM)) / 3, jnp.float32),
    }
    emb = jnp.asarray(r.normal(size=(V, DM)), jnp.float32)
    head = jnp.asarray(r.normal(size=(DM, V)) / 3, jnp.float32)

    def stage_fn(w, x, ctx):
        q, k, v = jnp.split(x @ w["qkv"], 3, axis=-1)
        keep = ctx.inputs["mask"][:, None, :] > 0  # [B, 1, T]: attend to real tokens
        att = jnp.where(keep, q @ jnp.swapaxes(k, 1, 2) / np.sqrt(DM), -1e9)
        h = jax.nn.softmax(att, axis=-1) @ v
        drop = jax.random.bernoulli(ctx.key, 1 - rate, h.shape)
        h = jnp.where(drop, h / (1 - rate), 0.0)
        return x + (1.0 + 0.1 * ctx.stage) * jnp.tanh(h @ w["mlp"])

    def post_loss(p, x, b):
        logits = x @ p
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], -1)[..., 0]
        return jnp.mean(ce)

    return jp.PipelineModel(
        stage_fn=stage_fn,
        stage_params=stage_params,
        pre=lambda p, b: p[b["x"]],
        pre_params=emb,
        post_loss=post_loss,
        post_params=head,
        stage_inputs=("mask",),
    )


def batch_of(n, seed=1):
    r = np.random.default_rng(seed)
    lengths = r.integers(2, T + 1, n)
    return {
        "x": r.integers(0, V, (n, T)).astype(np.int32),
        "y": r.integers(0, V, (n, T)).astype(np.int32),
        "mask": (np.arange(T)[None] < lengths[:, None]).astype(np.float32),
    }


def reference(model, params, batch, M, R, seed, step):
    """The unpipelined model, micro-batch by micro-batch, with the keys the pipeline uses."""
    n = batch["x"].shape[0] // (R * M)

    def loss(p):
        tot = 0.0
        for r in range(R):
            for j in range(M):
                mb = jax.tree.map(lambda a: a[(r * M + j) * n : (r * M + j + 1) * n], batch)
                tot = tot + model.loss(p, mb, key=jp.microbatch_key(seed, step, r * M + j))
        return tot / (R * M)

    return jax.value_and_grad(loss)(params)


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
def test_context_model_equals_its_microbatched_reference(schedule, kw, data):
    D, M = (2 if schedule == "interleaved_1f1b" else 4), 4
    model = context_model(D * kw.get("options", {}).get("virtual", 1))
    batch = batch_of(2 * M * data)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=D, data=data),
        seed=7,
        **kw,
    )
    state = pipe.init()
    loss, grads = pipe.loss_and_grad(state, batch)
    ref_loss, ref_grads = reference(model, model.params, batch, M, data, seed=7, step=0)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5


def test_keys_advance_with_the_step_and_the_seed_and_dropout_matters():
    """After one update the pipeline uses step 1's keys (equal to the reference at step 1); another seed or
    step gives other gradients (so the equality above could fail)."""
    model = context_model(4)
    batch = batch_of(8)
    pipe = jp.Pipeline(
        model,
        schedule="1f1b",
        num_microbatches=4,
        optimizer=optax.sgd(0.0),
        mesh=jp.make_mesh(stages=4),
        seed=3,
    )
    state = pipe.init()
    state, _ = pipe.step(state, batch)  # lr 0: parameters unchanged, step -> 1
    _, grads = pipe.loss_and_grad(state, batch)
    _, ref1 = reference(model, model.params, batch, 4, 1, seed=3, step=1)
    _, ref0 = reference(model, model.params, batch, 4, 1, seed=3, step=0)
    _, other = reference(model, model.params, batch, 4, 1, seed=4, step=1)
    assert rel_err(grads, ref1) <= 1e-5
    assert rel_err(grads, ref0) > 1e-2 and rel_err(grads, other) > 1e-2


def test_the_mask_reaches_the_stages():
    """The same batch with another padding mask gives another loss: the stages read ctx.inputs (so the
    equality with the reference above is a check of the mask too)."""
    model = context_model(2, rate=0.0)
    batch = batch_of(4)
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    state = pipe.init()
    l1, _ = pipe.loss_and_grad(state, batch)
    l2, _ = pipe.loss_and_grad(state, {**batch, "mask": np.ones_like(batch["mask"])})
    assert abs(float(l1) - float(l2)) > 1e-4


def test_missing_stage_input_is_a_clear_error():
    model = context_model(2)
    batch = batch_of(4)
    del batch["mask"]
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match="stage_inputs"):
        pipe.loss_and_grad(pipe.init(), batch)


@pytest.mark.parametrize("schedule", ["pipedream", "pipeoptim", "pipedream_2bw", "wpipe"])
def test_context_model_in_no_flush_methods_equals_the_serial_reference(schedule):
    """The no-flush methods give micro-batch j of step b the synchronous schedules' keys (b, j, stage): two
    steps and a drain equal the serial reference run with the same keys."""
    from jaxpipe.optim.reference import serial_reference

    D, M = 2, 2
    model = context_model(2 * D if schedule == "wpipe" else D)
    batches = [batch_of(2 * M, seed=s) for s in (5, 6)]
    opt = optax.sgd(0.05)
    pipe = jp.Pipeline(
        model, schedule=schedule, num_microbatches=M, optimizer=opt, mesh=jp.make_mesh(stages=D), seed=11
    )
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    state, _ = pipe.drain(state)
    ref = serial_reference(model, schedule, opt, M, batches, seed=11)
    got = pipe.params(state)
    change = jax.tree.map(lambda a, b: a - b, got, model.params)
    ref_change = jax.tree.map(lambda a, b: a - b, ref["params"], model.params)
    assert rel_err(change, ref_change) <= 1e-4
    other = serial_reference(model, schedule, opt, M, batches, seed=12)
    other_change = jax.tree.map(lambda a, b: a - b, other["params"], model.params)
    assert rel_err(other_change, ref_change) > 1e-2


@pytest.mark.parametrize(
    "schedule,kw",
    [("1f1b", {"residuals": "inputs"}), ("chimera", {"options": {"concat": "forward_doubling"}})],
)
def test_context_with_recomputation(schedule, kw):
    """jax.checkpoint keeps the context (stage index, key) as residuals: they must be stashed like the
    activation (a stage-varying index once broke the lane executor's branch types)."""
    model = context_model(4)
    batch = batch_of(16)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=8,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=4),
        seed=7,
        **kw,
    )
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, model.params, batch, 8, 1, seed=7, step=0)
    assert rel_err(grads, ref_grads) <= 1e-5
