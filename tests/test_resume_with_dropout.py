"""A resumed run of a model whose numbers depend on the step (dropout keys) equals one that never stopped
(issue #43, item 3): every other checkpoint test resumes a model without keys, where a restored step counter
that is wrong changes nothing."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from test_drain_sequences import _noisy_model
from helpers import assert_same


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_resume_restores_the_step_and_the_keys(schedule, tmp_path):
    D, M = 2, 2
    model, batch_fn = _noisy_model(D)
    batches = [batch_fn(2 * M, s=k) for k in range(4)]
    make = lambda: jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=optax.adam(1e-2),
        mesh=jp.make_mesh(stages=D),
        seed=5,
    )
    pipe = make()
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    whole = jax.tree.map(np.asarray, pipe.params(pipe.drain(state)[0]))

    first = make()
    state = first.init()
    for b in batches[:2]:
        state, _ = first.step(state, b)
    ck = jp.Checkpointer(str(tmp_path / "ck"), first, async_save=False)
    ck.save(2, state)
    ck.close()

    second = make()
    template = second.prepare(second.init(), batches[0])
    restored, _, step = jp.Checkpointer(str(tmp_path / "ck"), second).restore(template)
    assert step == 2 and int(restored.step) == 2
    for b in batches[2:]:
        restored, _ = second.step(restored, b)
    resumed = jax.tree.map(np.asarray, second.params(second.drain(restored)[0]))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)):
        assert_same(a, b)
    # the keys matter: the same run restored with its key index reset (a synchronous step's counter; a
    # no-flush pipeline's global micro-batch index, shifted) ends elsewhere
    third = make()
    restored, _, _ = jp.Checkpointer(str(tmp_path / "ck"), third).restore(
        third.prepare(third.init(), batches[0])
    )
    if hasattr(restored, "counters"):
        t, base, fed = restored.counters
        restored = restored._replace(counters=(t, base + 7, fed))
    else:
        restored = restored._replace(step=restored.step * 0)
    for b in batches[2:]:
        restored, _ = third.step(restored, b)
    wrong = jax.tree.map(np.asarray, third.params(third.drain(restored)[0]))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(wrong), jax.tree.leaves(whole)))
