"""Errors that say what to do (issue #48, item 6): the reference GPT's cut=, residuals= policies, schedule
errors as ConfigErrors, interleaved 1F1B's balanced cut, and the GPT's even <-> cut checkpoint move."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import small_model

TINY = dict(vocab=32, d_model=16, heads=2, seq_len=8)


@pytest.mark.parametrize(
    "cut,match",
    [
        (
            "3,3,3,1",
            r"cut='3,3,3,1': give a list of block counts per stage \(as a list: cut=\[3, 3, 3, 1\]\), or "
            r"'balanced'",
        ),
        ("balanced", r"cut='balanced' measures .* balance=\{'example': one_microbatch\}"),
        ("even", r"cut='even': give a list of block counts per stage, or 'balanced'"),
        ([3, "x", 1, 1], r"cut=\[3, 'x', 1, 1\]: give one block count per stage, e.g. \[1, 1, 1, 1\]"),
    ],
)
def test_the_gpt_cut_is_checked_like_the_adapters(cut, match):
    with pytest.raises(jp.ConfigError, match=match):
        jp.models.gpt(4, cut=cut, **TINY)


def test_interleaved_balanced_cut_takes_the_pipelines_default_virtual():
    """The balancer cuts for interleaved 1F1B's chunks (virtual 2 by default, as the Pipeline's), and the
    model it gives runs there (issue #48: it raised "stack 8 stages (virtual=2)")."""
    example = next(jp.data.lm_batches(np.random.default_rng(0).integers(0, 32, 2000).astype(np.uint8), 2, 8))
    model = jp.models.gpt(
        2,
        blocks_per_stage=3,
        cut="balanced",
        **TINY,
        balance={"example": example, "schedule": "interleaved_1f1b"},
    )
    assert sum(model.cut) == 6 and min(model.cut) >= 2  # each stage holds its two chunks
    pipe = jp.Pipeline(model, schedule="interleaved_1f1b", num_microbatches=2, mesh=jp.make_mesh(stages=2))
    assert pipe.schedule.num_model_stages == 4
    three = jp.models.gpt(
        2,
        blocks_per_stage=3,
        cut="balanced",
        **TINY,
        balance={"example": example, "schedule": "interleaved_1f1b", "options": {"virtual": 3}},
    )
    assert min(three.cut) >= 3


@pytest.mark.parametrize("policy", [jax.checkpoint_policies.save_only_these_names, print, lambda prim: True])
def test_a_residuals_policy_that_is_not_one_is_refused_at_construction(policy):
    model, _ = small_model("mlp", 2)
    with pytest.raises(
        jp.ConfigError,
        match=r"residuals=.*not a jax.checkpoint policy.*policy\(primitive, "
        r"\*avals, \*\*params\).*must be called first",
    ):
        jp.Pipeline(model, schedule="1f1b", num_microbatches=2, mesh=jp.make_mesh(stages=2), residuals=policy)
    # a real one, and a factory called, pass
    for ok in (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("x"),
    ):
        jp.Pipeline(model, schedule="1f1b", num_microbatches=2, mesh=jp.make_mesh(stages=2), residuals=ok)


def test_every_schedule_error_is_a_config_error():
    assert issubclass(jp.schedules.ScheduleError, jp.ConfigError)
    with pytest.raises(jp.ConfigError, match="stack 4 stages"):
        model, _ = small_model("mlp", 2)
        jp.Pipeline(model, schedule="interleaved_1f1b", num_microbatches=2, mesh=jp.make_mesh(stages=2))


def test_the_gpts_even_form_and_a_cut_name_the_cut_that_moves(tmp_path):
    """A checkpoint of gpt(4) (one module per stage) does not move onto gpt(2, cut=[3, 1]): the message says
    that only models of blocks move, and names this model as blocks (cut=[1, 1, 1, 1])."""
    opt = optax.sgd(0.1)
    p1 = jp.Pipeline(
        jp.models.gpt(4, **TINY), "1f1b", num_microbatches=2, optimizer=opt, mesh=jp.make_mesh(stages=4)
    )
    ck = jp.Checkpointer(str(tmp_path), p1, async_save=False)
    ck.save(1, p1.init())
    ck.close()
    p2 = jp.Pipeline(
        jp.models.gpt(2, cut=[3, 1], **TINY),
        "1f1b",
        num_microbatches=2,
        optimizer=opt,
        mesh=jp.make_mesh(stages=2),
    )
    with pytest.raises(
        jp.ConfigError,
        match=r"Only models of blocks .* the checkpoint's model is one module per "
        r"stage .* cut=\[1, 1, 1, 1\]",
    ):
        jp.Checkpointer(str(tmp_path), p2).restore(p2.init())
