"""The host runs ahead of the device (issue #51): a call reads the statuses of earlier calls that are done and
waits only for the oldest of ``IN_FLIGHT`` (2) unread ones, so step k + 1 is dispatched before step k ends.

The device is made "never done" (``is_ready`` -> False) and every status read is counted, so these tests say
which call reads which status without timing anything.  The rest of the suite reads each status at the next
call (conftest: ``IN_FLIGHT = 1``); here the default runs."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxpipe as jp
import jaxpipe.checks.on_device as sc
from helpers import assert_same, small_model


@pytest.fixture
def slow_device(monkeypatch):
    """The library default (2 in flight), a device whose steps are never done when the host asks, and the list
    of the statuses read (each read waits for its step: nothing here reads a status early)."""
    reads = []
    real = sc.read_status
    monkeypatch.setattr(sc, "IN_FLIGHT", 2)
    monkeypatch.setattr(sc, "is_ready", lambda status: False)
    monkeypatch.setattr(sc, "read_status", lambda status: reads.append(status) or real(status))
    return reads


def _pipe(schedule):
    D = 1 if schedule == "wpipe" else 2  # (WPipe puts two model stages on each device)
    model, batch_fn = small_model("mlp", 2)
    pipe = jp.Pipeline(
        model, schedule=schedule, num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=D)
    )
    good = jax.tree.map(jnp.asarray, batch_fn(8))
    return pipe, good, dict(good, x=good["x"].at[0, 0].set(jnp.nan))


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_four_steps_back_to_back_wait_for_nothing_until_the_third(slow_device, schedule):
    """Calls 1 and 2 wait for no step; call 3 waits for step 1's status, call 4 for step 2's (the host is two
    steps ahead, never more); ``check()`` reads the rest."""
    pipe, good, _ = _pipe(schedule)
    state = pipe.init()
    waited = []
    for _ in range(4):
        state, _ = pipe.step(state, good)
        waited.append(len(slow_device))
    assert waited == [0, 0, 1, 2]
    pipe.check()
    assert len(slow_device) == 4


def test_loss_and_grad_and_cyclic_data_parallel_run_ahead_too(slow_device):
    pipe, good, _ = _pipe("1f1b")
    state = pipe.init()
    waited = []
    for _ in range(3):
        pipe.loss_and_grad(state, good)
        waited.append(len(slow_device))
    assert waited == [0, 0, 1]
    model, batch_fn = small_model("mlp", 2)
    cdp = jp.CyclicDataParallel(model, optax.sgd(0.05), rule="v2", mesh=jp.make_mesh(data=2))
    cstate, batch = cdp.init(), jax.tree.map(jnp.asarray, batch_fn(4))
    pipe.check()
    before, waited = len(slow_device), []
    for _ in range(3):
        cstate, _ = cdp.step(cstate, batch)
        waited.append(len(slow_device) - before)
    assert waited == [0, 0, 1]


def test_a_refused_step_is_named_two_calls_later_and_changed_nothing(slow_device):
    """Step 2's batch holds a NaN; step 3 runs before anything read step 2's status; call 4 reads it and
    raises, naming step 2 and saying that step 3 ran on the state from before it -- which step 2 left as it
    was, so step 3's state is step 1's state stepped once on the good batch."""
    pipe, good, bad = _pipe("1f1b")
    s1, _ = pipe.step(pipe.init(), good)
    s1_copy = jax.tree.map(jnp.copy, s1)
    s2, _ = pipe.step(s1, bad)
    s3, _ = pipe.step(s2, good)
    with pytest.raises(
        jp.ConfigError,
        match=r"step\(\) #2: the batch holds NaN or Inf in \['x'\].*it changed "
        r"nothing.*Read 1 call\(s\) later.*ran on the state as it was",
    ):
        pipe.step(s3, good)
    jax.tree.map(assert_same, pipe.params(s3), pipe.params(pipe.step(s1_copy, good)[0]))


def test_states_derived_before_the_refusal_was_read_are_refused_by_save(slow_device, tmp_path):
    """WPipe keeps no state back: its refused step's effect is in the state it returned and in the state the
    next step made from it -- before the refusal was read.  Both are refused by save; a fresh state is not."""
    pipe, good, bad = _pipe("wpipe")
    s1, _ = pipe.step(pipe.init(), good)
    s2, _ = pipe.step(s1, bad)
    s3, _ = pipe.step(s2, good)
    with pytest.raises(jp.ConfigError, match=r"step\(\) #2: .*hold its effect too"):
        pipe.check()
    pending = pipe.context.pending
    assert "step() #2" in pending.refusal(s2) and "step() #2" in pending.refusal(s3)
    try:
        pipe.check()  # step 3 ran on NaN weights: its own loss may be refused as well
    except jp.ConfigError as e:
        assert "step() #3" in str(e)
    for s in (s2, s3):
        with pytest.raises(jp.ConfigError, match=r"refusing to checkpoint.*step\(\) #[23]"):
            pipe.check_saveable(s)
    pipe.check_saveable(pipe.init())
