"""The caches of measured costs (``jaxpipe.tune.measure_cache``, ``jaxpipe.cuts.part_costs``): two setups that
measure differently never share a key, the same setup always gets its own key back; a bad file is named, set
aside and measured again; a bad path is refused before anything is measured."""

import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.errors import ConfigError
from jaxpipe.cuts import part_costs
from jaxpipe.tune.measure_cache import MeasureCache, model_key

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
    """A model of ``stage_inputs=("mask",)`` whose stage tests the mask (``mask > 0``), keyed from a
    micro-batch of ``ShapeDtypeStruct``s (what the search holds): the context is built inside the trace, so
    the user's code sees tracers (it saw the placeholders: a TypeError inside the user's attention)."""
    import jax

    def stage(w, h, ctx):
        return jnp.tanh(h @ w) * (ctx.inputs["mask"] > 0)[..., None]

    model = jp.PipelineModel(
        stage_fn=stage,
        stage_params=jnp.ones((2, 8, 8)) / 8,
        stage_inputs=("mask",),
        pre=lambda p, b: b["x"] @ p,
        pre_params=jnp.ones((4, 8)),
        post_loss=lambda p, h, b: jnp.mean((h @ p - b["y"]) ** 2),
        post_params=jnp.ones((8, 1)),
    )
    mb = {
        "x": jax.ShapeDtypeStruct((2, T, 4), jnp.float32),
        "y": jax.ShapeDtypeStruct((2, T, 1), jnp.float32),
        "mask": jax.ShapeDtypeStruct((2, T), jnp.float32),
    }
    key = model_key(model, mb, optax.sgd(0.1))
    assert key == model_key(model, mb, optax.sgd(0.1))
    assert key != model_key(model, dict(mb, mask=jax.ShapeDtypeStruct((2, T), jnp.int32)), optax.sgd(0.1))


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2, 3]", '"a string"'])
def test_a_bad_measurements_file_is_named_set_aside_and_measured_again(tmp_path, text):
    path = tmp_path / "measurements.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match=rf"the cache file {path} .*moved to {path}.bad; measuring again"):
        cache = MeasureCache(str(path))
    assert (tmp_path / "measurements.json.bad").read_text() == text
    assert cache.get(["k"], lambda: 3) == 3 and cache.misses == 1
    assert json.loads(path.read_text()) == {'["k"]': 3}  # written anew, whole


def test_an_entry_of_another_shape_is_measured_again_with_a_warning(tmp_path):
    """Valid JSON whose entry does not convert (a hand edit, another version's table): measured again, never a
    KeyError from deep inside the search."""
    from jaxpipe.cuts.balanced import PartCosts

    path = tmp_path / "measurements.json"
    path.write_text(json.dumps({'["parts"]': {"f_block": 1.0}, '["n"]': "many"}))
    cache = MeasureCache(str(path))
    with pytest.warns(UserWarning, match=r"holds an entry of another shape for \[\"parts\"\]"):
        got = cache.get(["parts"], lambda: {"f_block": 1.0, "b_block": 2.0}, use=lambda v: PartCosts(**v))
    assert got.b_block == 2.0
    with pytest.warns(UserWarning, match="another shape"):
        assert cache.get(["n"], lambda: 7, use=int) == 7
    assert cache.get(["n"], lambda: pytest.fail("measured again"), use=int) == 7  # the new value is kept


def test_a_bad_cache_path_is_refused_before_anything_is_measured(tmp_path, monkeypatch):
    from jaxpipe.tune.configure import configure

    with pytest.raises(
        ConfigError, match=rf"{tmp_path} is a directory; the measurements are kept in one JSON"
    ):
        MeasureCache(str(tmp_path))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("JAXPIPE_CACHE_DIR", str(blocker))
    never = lambda n: pytest.fail("the model was built before the cache path was checked")
    with pytest.raises(ConfigError, match=rf"lies under {blocker}, which is a file, not a directory"):
        configure(never, _mb(8), optax.sgd(0.1), devices=2, memory_budget=1 << 30, verbose=False)
    with pytest.raises(ConfigError, match=r"the cut costs' cache .* a file"):
        part_costs.check_directory(os.path.join(str(blocker), "cuts"))


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "",
        "[]",
        '{"rounds": [{"f_block": 1.0}]}',
        '{"rounds": [{"f_block": 1, "fb_block": 2, "f_pre": 0, "fb_pre": 0, "f_post": "x", "fb_post": 1}]}',
    ],
)
def test_a_bad_cut_costs_file_is_named_set_aside_and_not_read(tmp_path, text):
    (tmp_path / "k.json").write_text(text)
    with pytest.warns(UserWarning, match=rf"{tmp_path / 'k.json'} .*moved to .*k.json.bad; measuring again"):
        assert part_costs.load(str(tmp_path), "k") is None
    assert not (tmp_path / "k.json").exists() and (tmp_path / "k.json.bad").exists()
    good = [{k: 1.0 for k in part_costs.ROUND_KEYS}]
    part_costs.store(str(tmp_path), "k", good)
    assert part_costs.load(str(tmp_path), "k") == good


def test_the_backend_key_changes_with_what_the_compiler_is_told(monkeypatch):
    """Measurements under other XLA flags (another device count, another optimisation level) are others: the
    backend part of every key holds the flags, the device kind and count and the versions."""
    from jaxpipe.tune.measure_cache import backend_key

    here = backend_key()
    assert backend_key() == here
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    assert backend_key() != here
