"""Dropout keys written out by hand (issue #43, item 2): no jaxpipe function on the reference side, so a key
derivation that ignores the stage, the micro-batch or the step cannot pass through both sides unnoticed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import rel_err

D, M, N_ROWS, SEED, WIDTH = 2, 2, 4, 3, 8


def _key(step, j, s, drop=()):
    """fold_in(fold_in(fold_in(PRNGKey(seed), step), micro-batch), stage), each part removable."""
    k = jax.random.PRNGKey(SEED)
    for name, v in (("step", step), ("microbatch", j), ("stage", s)):
        if name not in drop:
            k = jax.random.fold_in(k, v)
    return k


def _stage_fn(w, h, ctx):
    return jnp.tanh(h @ w["w"]) + 0.5 * jax.random.uniform(ctx.key, h.shape)


def _loss_by_hand(W, batch, step, drop=()):
    tot = 0.0
    for j in range(M):
        h = batch["x"][j * N_ROWS : (j + 1) * N_ROWS]
        for s in range(D):
            h = jnp.tanh(h @ W[s]) + 0.5 * jax.random.uniform(_key(step, j, s, drop), h.shape)
        tot = tot + jnp.mean((h - batch["y"][j * N_ROWS : (j + 1) * N_ROWS]) ** 2)
    return tot / M


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_every_stage_microbatch_and_step_has_its_own_key(schedule):
    r = np.random.default_rng(0)
    W = jnp.asarray(r.normal(size=(D, WIDTH, WIDTH)) / 3, jnp.float32)
    model = jp.PipelineModel(
        stage_fn=_stage_fn,
        stage_params={"w": W},
        context=True,
        post_loss=lambda p, h, b: jnp.mean((h - b["y"]) ** 2),
    )
    batch = {
        "x": jnp.asarray(r.normal(size=(M * N_ROWS, WIDTH)), jnp.float32),
        "y": jnp.asarray(r.normal(size=(M * N_ROWS, WIDTH)), jnp.float32),
    }
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=optax.sgd(0.0),
        mesh=jp.make_mesh(stages=D),
        seed=SEED,
        nan_bubbles=True,
    )
    state = pipe.init()
    for step in (0, 1):
        loss, grads = pipe.loss_and_grad(state, batch)
        ref_loss, ref_g = jax.value_and_grad(_loss_by_hand)(W, batch, step)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), (step, loss, ref_loss)
        assert rel_err(grads[0]["w"], ref_g) <= 1e-5
        # each part of the key matters here: the same keys without it give another gradient, far beyond the
        # equality's tolerance
        for drop in ("stage", "microbatch", "step"):
            other = jax.grad(_loss_by_hand)(W, batch, step, drop=(drop,))
            assert rel_err(other, ref_g) > 100 * 1e-5, drop
        state, _ = pipe.step(state, batch)  # lr 0: the weights stay, the step counter moves on
        assert int(state.step) == step + 1
