"""The keys of the configuration search's measurement cache (``jaxpipe.tune.measure_cache``): two setups that
measure differently never share a key, the same setup always gets its own key back."""
import jax.numpy as jnp
import numpy as np
import optax

import jaxpipe as jp
from jaxpipe.tune.measure_cache import model_key

T = 8


def _mb(rows=2):
    tok = np.zeros((rows, T + 1), np.int32)
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def _gpt(d=16, **kw):
    return jp.models.gpt(2, vocab=32, d_model=d, heads=2, seq_len=T, **kw)


def test_optimizers_whose_states_differ_only_in_dtype_get_two_keys():
    """``adam`` and ``adam(mu_dtype=bfloat16)``: the same shapes, another state size -- the search must not
    reuse one's memory figures for the other."""
    model = _gpt()
    a = model_key(model, _mb(), optax.adam(1e-3))
    assert a != model_key(model, _mb(), optax.adam(1e-3, mu_dtype=jnp.bfloat16))
    assert a == model_key(model, _mb(), optax.adam(1e-3))
    assert a != model_key(model, _mb(), optax.sgd(1e-3, momentum=0.9))


def test_models_that_differ_in_width_dtype_or_micro_batch_get_their_own_keys():
    base = model_key(_gpt(), _mb(), optax.sgd(0.1))
    assert base != model_key(_gpt(32), _mb(), optax.sgd(0.1))
    assert base != model_key(_gpt(), _mb(4), optax.sgd(0.1))
    # the same shapes in bfloat16 (parameters and compute)
    half = jp.with_precision(_gpt(), jp.Precision(params="bfloat16", compute="bfloat16"))
    assert base != model_key(half, _mb(), optax.sgd(0.1))


def test_a_model_whose_stages_read_a_mask_gets_a_key_from_shape_placeholders():
    """A model of ``stage_inputs=("mask",)`` whose stage tests the mask (``mask > 0``), keyed from a micro-batch
    of ``ShapeDtypeStruct``s (what the search holds): the context is built inside the trace, so the user's code
    sees tracers (it saw the placeholders: a TypeError inside the user's attention)."""
    import jax

    def stage(w, h, ctx):
        return jnp.tanh(h @ w) * (ctx.inputs["mask"] > 0)[..., None]
    model = jp.PipelineModel(stage_fn=stage, stage_params=jnp.ones((2, 8, 8)) / 8, stage_inputs=("mask",),
                             pre=lambda p, b: b["x"] @ p, pre_params=jnp.ones((4, 8)),
                             post_loss=lambda p, h, b: jnp.mean((h @ p - b["y"]) ** 2), post_params=jnp.ones((8, 1)))
    mb = {"x": jax.ShapeDtypeStruct((2, T, 4), jnp.float32), "y": jax.ShapeDtypeStruct((2, T, 1), jnp.float32),
          "mask": jax.ShapeDtypeStruct((2, T), jnp.float32)}
    key = model_key(model, mb, optax.sgd(0.1))
    assert key == model_key(model, mb, optax.sgd(0.1))
    assert key != model_key(model, dict(mb, mask=jax.ShapeDtypeStruct((2, T), jnp.int32)), optax.sgd(0.1))
