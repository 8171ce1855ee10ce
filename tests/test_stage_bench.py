"""The configuration search's stage costs as the executor runs them (issue #53): residuals through a stash,
and zero-bubble's W priced by the executor's own split.  Structure only, no timing comparisons (the machine
decides those; BUILD_NOTES has the measurements)."""

import jax
import numpy as np
import pytest

import jaxpipe as jp
from jaxpipe.tune.stage_bench import stashed_stage_costs


def _stage(model, batch, rows=2):
    mb = jax.tree.map(lambda a: np.asarray(a[:rows]), batch)
    return model, jax.tree.map(lambda a: a[0], model.stage_params), model.pre(model.pre_params, mb), mb


def _gpt_batch(n=4, T=16, vocab=32):
    tok = np.random.default_rng(0).integers(0, vocab, (n, T + 1)).astype(np.int32)
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def test_a_stage_whose_blocks_scan_is_split_and_every_op_is_timed():
    model = jp.models.gpt(2, vocab=32, d_model=16, heads=2, blocks_per_stage=2, seq_len=16)
    got = stashed_stage_costs(*_stage(model, _gpt_batch()), split=True, slots=2, calls=2)
    assert set(got) == {"F", "B", "B_input", "W", "splits"}
    assert got["splits"] is True  # the executor's W runs from B's frontier here
    # F is a time; the others are differences of two times, which a loaded machine can bring to (clipped) 0
    assert got["F"] > 0 and all(got[k] >= 0 for k in ("B", "B_input", "W"))


def test_a_context_model_under_a_recomputing_policy_reports_that_w_recomputes():
    # dropout: the stage needs its context (keys); residuals="inputs": the executor's W recomputes the
    # backward
    model = jp.models.gpt(2, vocab=32, d_model=16, heads=2, blocks_per_stage=1, seq_len=16, dropout=0.1)
    pipe = jp.Pipeline(
        model, schedule="zb_h1", num_microbatches=2, residuals="inputs", mesh=jp.make_mesh(stages=2, data=1)
    )
    got = stashed_stage_costs(*_stage(pipe.model, _gpt_batch()), split=True, slots=2, calls=2)
    assert got["splits"] is False and got["W"] >= 0


def test_without_the_split_b_input_and_w_are_halves_of_b():
    model = jp.models.gpt(2, vocab=32, d_model=16, heads=2, blocks_per_stage=1, seq_len=16)
    got = stashed_stage_costs(*_stage(model, _gpt_batch()), split=False, slots=2, calls=2)
    assert got["splits"] is False and got["B_input"] == pytest.approx(got["B"] / 2) == pytest.approx(got["W"])
