"""Flax adapters (issue #15): a transformer written as Flax modules by someone else -- NNX instances, or
Linen modules with their parameter dicts -- pipelines through ``jp.models.from_nnx`` / ``from_linen`` and
equals the unpipelined modules' own loss and gradients; trained parameters go back into the modules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpipe as jp
from helpers import rel_err

V, D_, T = 17, 16, 6


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(D_, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D_, decode=False, rngs=rngs)
        self.mlp = nnx.Linear(D_, D_, rngs=rngs)

    def __call__(self, x):
        h = self.ln(x)
        x = x + self.attn(h, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
        return x + jax.nn.gelu(self.mlp(x))


def xent(logits, b):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], -1))


def close(a, b, tol=1e-5):
    """Per-leaf relative error, except leaves whose true gradient is zero (attention's key bias cannot
    change a softmax: its gradient is float32 noise, ~1e-9) -- those must be tiny in absolute terms."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if np.linalg.norm(y) < 1e-6:
            assert np.max(np.abs(x)) < 1e-6
        else:
            assert np.linalg.norm(x - y) / np.linalg.norm(y) <= tol
    return True


def batch_of(n, seed=1):
    r = np.random.default_rng(seed)
    return {"x": r.integers(0, V, (n, T)).astype(np.int32), "y": r.integers(0, V, (n, T)).astype(np.int32)}


def nnx_pieces():
    rngs = nnx.Rngs(0)
    return [NBlock(rngs) for _ in range(4)], nnx.Embed(V, D_, rngs=rngs), nnx.Linear(D_, V, rngs=rngs)


def nnx_loss(blocks, embed, head, batch):
    x = embed(batch["x"])
    for b in blocks:
        x = b(x)
    return xent(head(x), batch)


@pytest.mark.parametrize("stages,schedule", [(2, "1f1b"), (4, "gpipe")])
def test_nnx_model_equals_its_own_modules(stages, schedule):
    blocks, embed, head = nnx_pieces()
    model, to_modules = jp.models.from_nnx(blocks, embed, head, xent, num_stages=stages)
    batch = batch_of(8)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=2,
        optimizer=optax.adamw(1e-2),
        mesh=jp.make_mesh(stages=stages),
    )
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref = nnx_loss(blocks, embed, head, batch)
    assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref))
    # gradients: the modules' own nnx.grad, laid out the adapter's way
    g_blocks, g_embed, g_head = nnx.grad(lambda bs, e, h: nnx_loss(bs, e, h, batch), argnums=(0, 1, 2))(
        nnx.List(blocks), embed, head
    )
    per = [nnx.to_pure_dict(g_blocks[i]) for i in range(4)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs).reshape((stages, 4 // stages) + xs[0].shape), *per)
    assert close(grads, (stacked, nnx.to_pure_dict(g_embed), nnx.to_pure_dict(g_head)))
    # trained parameters go back into modules that compute the pipeline's own loss
    state = pipe.init()
    state, _ = pipe.step(state, batch)
    nb, ne, nh = to_modules(pipe.params(state))
    assert abs(float(nnx_loss(nb, ne, nh, batch)) - float(model.loss(pipe.params(state), batch))) <= 1e-5


class LBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        return x + nn.Dense(D_)(jax.nn.gelu(nn.Dense(D_)(h)))


def test_linen_model_equals_its_own_modules():
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    x0 = jnp.zeros((2, T, D_))
    block = LBlock()
    bps = [block.init(k, x0)["params"] for k in keys[:4]]
    emb, hd = nn.Embed(V, D_), nn.Dense(V)
    ep = emb.init(keys[4], jnp.zeros((2, T), jnp.int32))["params"]
    hp = hd.init(keys[5], x0)["params"]
    model, to_params = jp.models.from_linen(block, bps, (emb, ep), (hd, hp), xent, num_stages=2)
    batch = batch_of(8)

    def ref_loss(bps, ep, hp):
        x = emb.apply({"params": ep}, batch["x"])
        for p in bps:
            x = block.apply({"params": p}, x)
        return xent(hd.apply({"params": hp}, x), batch)

    pipe = jp.Pipeline(
        model, schedule="zb_h1", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    rl, (gb, ge, gh) = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(bps, ep, hp)
    assert abs(float(loss) - float(rl)) <= 1e-5 * abs(float(rl))
    blocks, gpre, gpost = to_params(grads)
    assert rel_err((blocks, gpre, gpost), (gb, ge, gh)) <= 1e-5


def test_adapter_errors():
    blocks, embed, head = nnx_pieces()
    with pytest.raises(jp.ConfigError, match="equal stages"):
        jp.models.from_nnx(blocks[:3], embed, head, xent, num_stages=2)


def _tied_nnx():
    from flax import nnx
    import jax.numpy as jnp

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.l(x))

    class Head(nnx.Module):  # the LM head reuses the token embedding's Variable
        def __init__(self, emb):
            self.emb, self.b = emb, nnx.Param(jnp.zeros(7))

        def __call__(self, h):
            return h @ self.emb.embedding[...].T + self.b[...]

    rngs = nnx.Rngs(0)
    emb = nnx.Embed(7, 4, rngs=rngs)
    return [Block(rngs) for _ in range(4)], emb, Head(emb)


def _tied_loss(logits, b):
    return -jax.numpy.mean(jax.numpy.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], -1))


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream", "wpipe"])
def test_from_nnx_finds_and_keeps_a_tie(schedule):
    """A head sharing the embedding's Variable: from_nnx ties it (one array in the state); the synchronous
    gradient equals nnx.value_and_grad of the untouched model; every family keeps one array through training
    (equal to its serial reference) and to_modules shares the Variable again."""
    from flax import nnx
    from jaxpipe.optim.reference import serial_reference

    blocks, emb, head = _tied_nnx()
    r = np.random.default_rng(0)
    batch = {"x": r.integers(0, 7, (8, 3)).astype(np.int32), "y": r.integers(0, 7, (8, 3)).astype(np.int32)}
    model, to_modules = jp.models.from_nnx(
        blocks, emb, head, _tied_loss, num_stages=4 if schedule == "wpipe" else 2
    )
    assert model.tied == ((("embedding",), ("emb", "embedding")),)
    opt = optax.sgd(0.1)
    pipe = jp.Pipeline(
        model, schedule=schedule, num_microbatches=2, optimizer=opt, mesh=jp.make_mesh(stages=2)
    )
    state = pipe.init()
    if schedule == "1f1b":

        class All(nnx.Module):
            def __init__(self):
                self.emb, self.blocks, self.head = emb, nnx.List(blocks), head

        def full(m):
            h = m.emb(batch["x"])
            for b in m.blocks:
                h = b(h)
            return _tied_loss(m.head(h), batch)

        ref_loss, ref_g = nnx.value_and_grad(full)(All())
        loss, (g_stage, g_pre, g_post) = pipe.loss_and_grad(state, batch)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        # relative to the array's norm (float32 rounding differs by XLA version: an element of 2.5e-3 was
        # 1.5e-7 off on jax 0.12), as every exactness check: rel. error <= 1e-5
        assert rel_err(g_pre["embedding"], ref_g["emb"]["embedding"][...]) <= 1e-5
    batches = [batch] * 3
    for b in batches:
        state, _ = pipe.step(state, b)
    if schedule != "1f1b":
        state, _ = pipe.drain(state)
        ref = serial_reference(model, schedule, opt, 2, batches)
        assert rel_err(pipe.params(state), ref["params"]) <= 1e-5
    _, e2, h2 = to_modules(pipe.params(state))
    assert h2.emb.embedding is e2.embedding


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_v"])
def test_two_chunk_schedules_cut_the_model_as_written(schedule):
    """Issue #32 item 5: the model as written (4 blocks in 2 stages, one per device) runs under a schedule
    that holds two chunks per device: the adapter's model is cut into 4 stages of one block, exact against the
    modules' own nnx.grad; to_modules gives the blocks back in order."""
    blocks, embed, head = nnx_pieces()
    model, to_modules = jp.models.from_nnx(blocks, embed, head, xent, num_stages=2)
    batch = batch_of(8)
    pipe = jp.Pipeline(
        model, schedule=schedule, num_microbatches=4, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    assert pipe.model.num_stages == 4 and model.num_stages == 2
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    assert abs(float(loss) - float(nnx_loss(blocks, embed, head, batch))) <= 1e-5 * abs(float(loss))
    g_blocks, g_embed, g_head = nnx.grad(lambda bs, e, h: nnx_loss(bs, e, h, batch), argnums=(0, 1, 2))(
        nnx.List(blocks), embed, head
    )
    per = [nnx.to_pure_dict(g_blocks[i]) for i in range(4)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs).reshape((4, 1) + xs[0].shape), *per)
    assert close(grads, (stacked, nnx.to_pure_dict(g_embed), nnx.to_pure_dict(g_head)))
    nb, ne, nh = to_modules(pipe.params(pipe.init()))
    assert abs(float(nnx_loss(nb, ne, nh, batch)) - float(loss)) <= 1e-5 * abs(float(loss))


def test_a_model_that_cannot_be_cut_says_what_to_change():
    blocks, embed, head = nnx_pieces()
    model, _ = jp.models.from_nnx(blocks[:2], embed, head, xent, num_stages=2)  # 2 blocks, 2 stages
    with pytest.raises(
        jp.ConfigError,
        match=r"interleaved_1f1b holds 2 model stages per device, 4 in all, but "
        r"this model's blocks cannot be cut so: 2 blocks cannot be cut into 4",
    ):
        jp.Pipeline(
            model,
            schedule="interleaved_1f1b",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=2),
        )


def test_linen_tied_head_is_found_and_exact():
    """Issue #32 item 1 (Linen): the head is the embedding's own ``attend`` on the same parameters -- found by
    array identity and tied; and a tie given by path (two equal copies) does the same.  Exact against
    jax.grad of the Linen model, whose embedding gradient sums both uses."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x0 = jnp.zeros((2, T, D_))
    block = LBlock()
    bps = [block.init(k, x0)["params"] for k in keys[:4]]
    emb = nn.Embed(V, D_)
    ep = emb.init(keys[4], jnp.zeros((2, T), jnp.int32))["params"]
    batch = batch_of(8)

    def ref_loss(bps, ep):
        x = emb.apply({"params": ep}, batch["x"])
        for p in bps:
            x = block.apply({"params": p}, x)
        return xent(emb.apply({"params": ep}, x, method="attend"), batch)

    rl, (gb, ge) = jax.value_and_grad(ref_loss, argnums=(0, 1))(bps, ep)
    copy = jax.tree.map(jnp.array, ep)  # equal values, another object: needs tied=
    for head, tied in (
        ((emb, ep, "attend"), ()),
        ((emb, copy, "attend"), [(("embedding",), ("embedding",))]),
    ):
        model, to_params = jp.models.from_linen(block, bps, (emb, ep), head, xent, num_stages=2, tied=tied)
        assert model.tied == ((("embedding",), ("embedding",)),)
        pipe = jp.Pipeline(
            model, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
        )
        loss, grads = pipe.loss_and_grad(pipe.init(), batch)
        assert abs(float(loss) - float(rl)) <= 1e-5 * abs(float(rl))
        blocks, gpre, gpost = to_params(grads)
        assert rel_err((blocks, gpre), (gb, ge)) <= 1e-5
        assert gpost["embedding"] is None  # reported once, at the embedding


def test_from_nnx_and_from_linen_take_integer_inputs_and_a_recut_keeps_them():
    """Issue #52 item 4: the checks' hint told a ``from_nnx`` user to pass
    ``PipelineModel(integer_inputs=...)``, an argument they do not have; the adapters take it now, and a model
    cut again (``cut=``) keeps it."""
    blocks, embed, head = nnx_pieces()
    ids = {"x": V, "y": V}
    model, _ = jp.models.from_nnx(blocks, embed, head, xent, num_stages=2, integer_inputs=ids)
    assert model.integer_inputs == ids and model.recut(4).integer_inputs == ids
    pipe = jp.Pipeline(model, schedule="gpipe", num_microbatches=2, mesh=jp.make_mesh(stages=2))
    bad = batch_of(4)
    bad["y"][0, 0] = V  # one id past the head's table
    with pytest.raises(jp.ConfigError, match=r"batch\['y'\] holds 17, outside \[0, 17\)"):
        pipe.loss_and_grad(pipe.init(), bad)
