"""Orbax checkpoints (issue #6 part 2): every method's whole state -- parameters, optimizer state, weight
versions and stashes, in-flight pipeline, elastic-averaging reference -- survives save/restore, and a run
resumed from a checkpoint ends bit-equal to the uninterrupted run.  Retention, torn writes, a checkpoint
from another model or onto another mesh."""

import shutil

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import small_model

# schedule -> (stage devices, extra Pipeline kwargs, pipes)
# one case per state type: PipelineState (plain, Chimera's replica layout, interleaved's device layout),
# AsyncState with each policy state (pipedream: the weight stash; 2bw: shadow + accumulator; pipeoptim: the
# last update; spectrain / cdp_v* share those), WPipeState, AvgPipeState; CyclicState below
CASES = {
    "1f1b": (2, {}, 1),
    "chimera": (2, {}, 1),
    "interleaved_1f1b": (2, {}, 1),
    "pipeoptim": (2, {}, 1),
    "pipedream": (2, {}, 1),
    "pipedream_2bw": (2, {}, 1),
    "wpipe": (2, {}, 1),
    "avgpipe": (2, {"options": {"advance": 1}}, 2),
}


def make(schedule, data=1):
    D, kw, pipes = CASES[schedule]
    stages = 2 * D if schedule in ("wpipe", "interleaved_1f1b") else D
    model, batch_fn = small_model("mlp", stages)
    opt = optax.adamw(1e-2)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        optimizer=opt,
        mesh=jp.make_mesh(stages=D, pipes=pipes, data=data),
        **kw,
    )
    return pipe, lambda k: batch_fn(8 * pipes * data, s=k)


def leaves(pipe, state):
    state, _ = pipe.drain(state)
    return [np.asarray(a) for a in jax.tree.leaves(pipe.params(state))]


@pytest.mark.parametrize("schedule", sorted(CASES))
def test_resume_is_bit_equal(schedule, tmp_path):
    pipe, batch = make(schedule)
    state = pipe.init()
    ckpt = jp.Checkpointer(tmp_path / "ck", pipe, keep=2, every=2)
    for k in range(5):
        state, _ = pipe.step(state, batch(k))
        ckpt.maybe_save(k + 1, state, extra={"data": {"position": k + 1}})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4]
    for k in range(5, 7):
        state, _ = pipe.step(state, batch(k))
    want = leaves(pipe, state)

    pipe2, _ = make(schedule)  # a fresh process would build everything anew
    template = pipe2.prepare(pipe2.init(), batch(0))
    state2, extra, step = jp.Checkpointer(tmp_path / "ck", pipe2).restore_latest(template)
    assert step == 4 and extra == {"data": {"position": 4}}
    for k in range(step, 7):
        state2, _ = pipe2.step(state2, batch(k))
    got = leaves(pipe2, state2)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    ckpt.close()


def test_cyclic_data_parallel_resume(tmp_path):
    model, batch_fn = small_model("mlp", 4)
    make_cdp = lambda: jp.CyclicDataParallel(
        model, optax.sgd(0.05, momentum=0.9), rule="v2", mesh=jp.make_mesh(data=4)
    )
    cdp = make_cdp()
    state = cdp.init()
    for k in range(3):
        state, _ = cdp.step(state, batch_fn(8, s=k))
    ck = jp.Checkpointer(tmp_path / "ck", None, async_save=False)
    ck.save(3, state)
    for k in range(3, 5):
        state, _ = cdp.step(state, batch_fn(8, s=k))
    want = jax.tree.leaves(cdp.drain(state)[0].params)
    cdp2 = make_cdp()
    state2, _, step = ck.restore(cdp2.prepare(cdp2.init(), batch_fn(8)))
    for k in range(step, 5):
        state2, _ = cdp2.step(state2, batch_fn(8, s=k))
    got = jax.tree.leaves(cdp2.drain(state2)[0].params)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_torn_write_is_never_latest(tmp_path):
    pipe, batch = make("1f1b")
    state = pipe.init()
    ck = jp.Checkpointer(tmp_path / "ck", pipe, every=1, keep=None)
    for k in range(2):
        state, _ = pipe.step(state, batch(k))
        ck.maybe_save(k + 1, state)
    ck.wait()
    # a crash mid-write leaves Orbax's temporary directory (renamed to "<step>" only once complete)
    src = tmp_path / "ck" / "2"
    shutil.copytree(src, tmp_path / "ck" / "3.orbax-checkpoint-tmp-1234567")
    for f in (tmp_path / "ck" / "3.orbax-checkpoint-tmp-1234567").rglob("*"):
        if f.is_file() and f.stat().st_size > 16:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # half-written files
    ck2 = jp.Checkpointer(tmp_path / "ck", pipe)
    assert ck2.latest_step() == 2
    _, _, step = ck2.restore_latest(pipe.prepare(pipe.init(), batch(0)))
    assert step == 2


def test_checkpoint_from_another_model(tmp_path):
    pipe, batch = make("1f1b")
    ck = jp.Checkpointer(tmp_path / "ck", pipe, async_save=False)
    ck.save(1, pipe.step(pipe.init(), batch(0))[0])
    model, _ = jp.models.residual_mlp(2, in_dim=12, num_classes=5, width=32), None
    other = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=4, optimizer=optax.adamw(1e-2), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match=r"from another model: it holds .* parameters in 2 stages"):
        jp.Checkpointer(tmp_path / "ck", other).restore(other.init())


def test_in_flight_state_kept_under_another_residual_policy_is_refused_by_name(tmp_path):
    """A no-flush checkpoint's stash holds the residuals its run kept; a run that keeps others (another
    residuals= policy, or a jaxpipe that stashes fewer) is told so, not told to change its batch size."""
    model, batch_fn = small_model("mlp", 2)
    make_pipe = lambda **kw: jp.Pipeline(
        model,
        schedule="pipedream",
        num_microbatches=4,
        optimizer=optax.sgd(0.05),
        mesh=jp.make_mesh(stages=2),
        **kw,
    )
    pipe = make_pipe()
    ck = jp.Checkpointer(tmp_path / "ck", pipe, async_save=False)
    ck.save(1, pipe.step(pipe.init(), batch_fn(8))[0])
    other = make_pipe(residuals="inputs")
    with pytest.raises(
        jp.ConfigError, match=r"keeps \d+ residual arrays .* this run \d+: .*residuals= policy"
    ):
        jp.Checkpointer(tmp_path / "ck", other).restore(other.prepare(other.init(), batch_fn(8)))


def test_a_synchronous_checkpoint_resumes_under_another_synchronous_schedule_and_m(tmp_path):
    """Between steps a synchronous schedule holds only the weights and the optimizer's state: a run may
    change its schedule or micro-batch count (memory, or the schedule the advisor chose) and carry on from
    the weights it had.  An asynchronous one's in-flight pipeline, or another chunk order, is refused."""
    model, batch_fn = small_model("mlp", 2)
    make_pipe = lambda schedule, M: jp.Pipeline(
        model, schedule=schedule, num_microbatches=M, optimizer=optax.adamw(1e-2), mesh=jp.make_mesh(stages=2)
    )
    pipe = make_pipe("1f1b", 4)
    state = pipe.step(pipe.init(), batch_fn(8))[0]
    jp.Checkpointer(tmp_path / "ck", pipe, async_save=False).save(1, state)
    want = [np.asarray(a) for a in jax.tree.leaves(pipe.params(state))]
    other = make_pipe("zb_h1", 8)
    reader = jp.Checkpointer(tmp_path / "ck", other)
    restored, _, step = reader.restore(other.init())
    assert reader.written_under_other == ("1f1b", 4)  # what the trainer's resume line says
    got = [np.asarray(a) for a in jax.tree.leaves(other.params(restored))]
    assert step == 1 and all(np.array_equal(a, b) for a, b in zip(want, got))
    # and it trains on as the run that wrote it would have (the same gradient, summed over 8 micro-batches)
    then = [np.asarray(a) for a in jax.tree.leaves(pipe.params(pipe.step(state, batch_fn(8, s=1))[0]))]
    now = [np.asarray(a) for a in jax.tree.leaves(other.params(other.step(restored, batch_fn(8, s=1))[0]))]
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(then, now))
    pipedream = make_pipe("pipedream", 4)
    with pytest.raises(
        jp.ConfigError, match=r"'1f1b' with 4 micro-batches; this run uses 'pipedream'.*synchronous"
    ):
        jp.Checkpointer(tmp_path / "ck", pipedream).restore(pipedream.prepare(pipedream.init(), batch_fn(8)))
    # two chunks a device in another order (interleaved: stages d, d + D; ZB-V: d, 2D - 1 - d)
    four, batch4 = small_model("mlp", 4)
    chunked = lambda schedule: jp.Pipeline(
        four, schedule=schedule, num_microbatches=4, optimizer=optax.adamw(1e-2), mesh=jp.make_mesh(stages=2)
    )
    zb_v = chunked("zb_v")
    jp.Checkpointer(tmp_path / "v", zb_v, async_save=False).save(1, zb_v.init())
    jp.Checkpointer(tmp_path / "v", chunked("dualpipe_v")).restore(chunked("dualpipe_v").init())
    interleaved = chunked("interleaved_1f1b")
    with pytest.raises(jp.ConfigError, match=r"lay the stages out alike"):
        jp.Checkpointer(tmp_path / "v", interleaved).restore(interleaved.init())


def test_restore_onto_other_mesh(tmp_path):
    # synchronous: parameters do not depend on the data axis -> data 2 -> 1 restores and continues equal
    pipe, batch = make("1f1b", data=2)
    state = pipe.step(pipe.init(), batch(0))[0]
    ck = jp.Checkpointer(tmp_path / "a", pipe, async_save=False)
    ck.save(1, state)
    want = [np.asarray(a) for a in jax.tree.leaves(pipe.params(pipe.step(state, batch(1))[0]))]
    pipe1, _ = make("1f1b", data=1)
    state1, _, _ = jp.Checkpointer(tmp_path / "a", pipe1).restore(pipe1.init())
    got = [np.asarray(a) for a in jax.tree.leaves(pipe1.params(pipe1.step(state1, batch(1))[0]))]
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(want, got))
    # asynchronous: the in-flight pipeline is laid out per device -> a clear error naming both meshes
    pipe, batch = make("pipeoptim", data=2)
    ck = jp.Checkpointer(tmp_path / "b", pipe, async_save=False)
    ck.save(1, pipe.step(pipe.init(), batch(0))[0])
    pipe1, b1 = make("pipeoptim", data=1)
    with pytest.raises(jp.ConfigError, match=r"cannot be restored onto this mesh.*'data': 2.*'data': 1"):
        jp.Checkpointer(tmp_path / "b", pipe1).restore(pipe1.prepare(pipe1.init(), b1(0)))


def test_nonfinite_state_is_never_saved(tmp_path):
    pipe, batch = make("1f1b")
    state = pipe.init()
    ck = jp.Checkpointer(tmp_path / "ck", pipe, async_save=False)
    ck.save(1, state)
    bad = state._replace(params=jax.tree.map(lambda a: a * np.nan, state.params))
    with pytest.raises(
        jp.ConfigError, match=r"refusing to checkpoint step 2: .*NaN.*last good checkpoint is step 1"
    ):
        ck.save(2, bad)
    assert ck.all_steps() == [1]
