"""Determinism (issue #6 part 4): the same seed and configuration give bit-identical losses and parameters
on repeated CPU runs, for a synchronous, an asynchronous, a bidirectional, a grouped and a parallel-
pipeline method."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import small_model

CASES = {
    "1f1b": (4, {}),
    "pipeoptim": (4, {}),
    "chimera": (4, {}),
    "wpipe": (2, {}),
    "avgpipe": (2, {"options": {"advance": 1}}),
}


def train(schedule, seed=0):
    D, kw = CASES[schedule]
    stages = 2 * D if schedule == "wpipe" else D
    model, batch_fn = small_model("mlp", stages, seed=seed)
    pipes = 2 if schedule == "avgpipe" else 1
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        optimizer=optax.adamw(1e-2),
        mesh=jp.make_mesh(stages=D, pipes=pipes),
        **kw,
    )
    state, losses = pipe.init(), []
    for k in range(3):
        state, m = pipe.step(state, batch_fn(8 * pipes, s=seed * 100 + k))
        losses.append(np.asarray(m["loss"]))
    state, _ = pipe.drain(state)
    return losses, [np.asarray(a) for a in jax.tree.leaves(pipe.params(state))]


@pytest.mark.parametrize("schedule", sorted(CASES))
def test_repeated_runs_are_bit_identical(schedule):
    (l1, p1), (l2, p2) = train(schedule), train(schedule)
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(l1, l2))
    assert all(np.array_equal(a, b) for a, b in zip(p1, p2))
    if schedule != "1f1b":  # CI time: the seed's effect is checked once
        return
    _, p3 = train(schedule, seed=1)  # and the seed matters
    assert any(not np.array_equal(a, b) for a, b in zip(p1, p3))
