"""Issue #52 item 1: the training loop as a library entry point, ``jp.train`` / ``jp.Trainer`` -- a user's
script gets what ``experiments.train`` has (it runs through the same function): a stop (a real SIGTERM to this
process) saves and returns, the next call resumes bit-equal to a run that never stopped, the signal handlers
are given back, a NaN step is stopped by name or skipped, evaluation and the metrics file, and clear errors
for a bad option or a stream that cannot resume.  One small pipeline for the whole module: one compile."""

import itertools
import json
import os
import signal

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import assert_same, small_model

MODEL, BATCH = small_model("mlp", 2)
QUIET = dict(progress=False, tensorboard="false")


@pytest.fixture(scope="module")
def pipe():
    return jp.Pipeline(
        MODEL,
        schedule="1f1b",
        num_microbatches=2,
        optimizer=optax.sgd(0.05),
        mesh=jp.make_mesh(stages=2),
        skip_nonfinite=True,
    )


def stream(nan_at=None):
    """A function that starts the seeded stream (so a resumed run can skip what was used)."""

    def start():
        for s in itertools.count(1):
            b = BATCH(8, s)
            if s == nan_at:
                b["x"] = np.full_like(b["x"], 3e38)  # finite on the host (the input check passes); inf inside
            yield b

    return start


def losses(out_dir):
    return [json.loads(l)["loss"] for l in open(os.path.join(out_dir, "metrics.jsonl"))]


def test_a_sigterm_saves_and_returns_and_the_next_call_resumes_bit_equal(pipe, tmp_path):
    ref = jp.train(
        pipe,
        stream(),
        steps=5,
        out_dir=str(tmp_path / "ref"),
        eval_batches=[BATCH(8, 99)],
        eval_every=2,
        evaluate=lambda p, b: {"eval_rows": float(len(b["x"]))},
        **QUIET,
    )
    assert ref.step == 5 and ref.stopped is None and ref.summary["steps"] == 5
    lines = [json.loads(l) for l in open(tmp_path / "ref" / "metrics.jsonl")]
    assert [l["step"] for l in lines if "eval_loss" in l] == [2, 4, 5]
    assert all(l["eval_rows"] == 8.0 for l in lines if "eval_loss" in l)
    assert json.load(open(tmp_path / "ref" / "summary.json"))["final_loss"] == lines[-1]["loss"]

    before = signal.getsignal(signal.SIGTERM)

    def preempt(trainer, step):  # the scheduler's SIGTERM arrives during step 2
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    run, ck = str(tmp_path / "run"), str(tmp_path / "ck")
    first = jp.train(
        pipe,
        stream(),
        steps=5,
        out_dir=run,
        checkpoint_dir=ck,
        hooks=[preempt],
        exit_on_stop=False,
        eval_batches=[BATCH(8, 99)],
        eval_every=2,
        **QUIET,
    )
    assert first.stopped == "SIGTERM" and first.step == 2 and first.summary is None
    assert signal.getsignal(signal.SIGTERM) is before, "the loop kept its SIGTERM handler after returning"
    second = jp.train(
        pipe,
        stream(),
        steps=5,
        out_dir=run,
        checkpoint_dir=ck,
        eval_batches=[BATCH(8, 99)],
        eval_every=2,
        **QUIET,
    )
    assert second.summary["resumed_at"] == 2 and second.step == 5
    assert losses(run) == losses(tmp_path / "ref")  # bit for bit, the kept lines of steps 1-2 included
    jax.tree.map(assert_same, pipe.params(second.state), pipe.params(ref.state))
    # the finished checkpoint again: nothing to do, the final state returned
    third = jp.train(pipe, stream(), steps=5, out_dir=run, checkpoint_dir=ck, **QUIET)
    assert third.summary is None and third.step == 5
    jax.tree.map(assert_same, pipe.params(third.state), pipe.params(ref.state))


def test_a_nan_step_is_stopped_by_name_or_skipped(pipe, tmp_path):
    with pytest.raises(jp.training.NonFiniteLoss, match="non-finite loss nan .* at step 2") as e:
        jp.train(pipe, stream(nan_at=2), steps=4, out_dir=str(tmp_path / "stop"), **QUIET)
    assert e.value.step == 2
    assert len(losses(tmp_path / "stop")) == 2  # the refused step is logged, nothing after it
    done = jp.train(
        pipe, stream(nan_at=2), steps=4, out_dir=str(tmp_path / "skip"), on_nonfinite="skip", **QUIET
    )
    assert done.summary["skipped_updates"] == 1
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(pipe.params(done.state)))


def test_bad_options_and_streams_say_what_would_work(pipe, tmp_path):
    with pytest.raises(jp.ConfigError, match="on_nonfinite='ignore': choose one of 'stop', 'skip'"):
        jp.Trainer(pipe, stream(), steps=3, on_nonfinite="ignore")
    with pytest.raises(jp.ConfigError, match="unknown stpes; the options are"):
        jp.Trainer(pipe, stream(), stpes=3)
    with pytest.raises(jp.ConfigError, match="checkpoint_keep=0: must be at least 1"):
        jp.Trainer(pipe, stream(), steps=3, checkpoint_keep=0)
    with pytest.raises(jp.ConfigError, match="function of no arguments that starts the stream"):
        jp.Trainer(pipe, iter([BATCH(8)]), steps=1, checkpoint_dir=str(tmp_path / "ck"))
    unguarded = jp.Pipeline(
        MODEL, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.05), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match="skip_nonfinite=True"):
        jp.Trainer(unguarded, stream(), steps=1, on_nonfinite="skip")


def test_a_step_is_refused_on_its_loss_and_grad_norm_not_only_on_a_skip_flag():
    """The loop's refusal condition by itself: the library test above runs ``skip_nonfinite=True``, whose
    ``skipped`` flag would hide a dropped finiteness check (a NaN loss then trained on, unreported)."""
    refused = jp.Trainer._refused
    assert refused({"loss": np.nan}, np.nan)  # no skip flag: the loss alone
    assert refused({"loss": 1.0, "grad_norm": np.inf}, 1.0)  # a finite loss, an Inf gradient
    assert refused({"loss": 1.0, "grad_norm": np.array([1.0, np.nan])}, 1.0)  # AvgPipe: one per pipeline
    assert refused({"loss": 1.0, "skipped": True}, 1.0)
    assert not refused({"loss": 1.0, "grad_norm": 2.0, "skipped": False}, 1.0)
    # a no-flush step that computed no loss yet (the pipeline filling): its NaN placeholder is no failure
    assert not refused({"loss": np.nan, "losses_computed": 0}, np.nan)
    assert refused({"loss": np.nan, "losses_computed": 2}, np.nan)


def test_without_skip_nonfinite_a_nan_step_stops_the_loop_by_name(tmp_path):
    """The same stop on a pipeline that does not skip (its step gates the update, and only the loop's own
    finiteness check sees the NaN before the next call)."""
    plain = jp.Pipeline(
        MODEL, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.05), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.training.NonFiniteLoss, match="non-finite loss nan .* at step 2"):
        jp.train(plain, stream(nan_at=2), steps=4, out_dir=str(tmp_path / "stop"), **QUIET)
    assert len(losses(tmp_path / "stop")) == 2


def failing_stream(fail_at, how):
    """The seeded stream, whose batch ``fail_at`` raises (the user's data code failing mid-run) or holds NaN
    (refused by the step's input check)."""

    def start():
        for s in itertools.count(1):
            b = BATCH(8, s)
            if s == fail_at and how == "raises":
                raise OSError(f"the data source failed at batch {s}")
            if s == fail_at:
                b["x"] = np.full_like(b["x"], np.nan)
            yield b

    return start


@pytest.mark.parametrize(
    "how,error,saved",
    [("raises", OSError, ["1", "2"]), ("nan", (jp.ConfigError, jp.training.NonFiniteLoss), ["1", "2"])],
)
def test_a_run_that_ends_on_an_error_keeps_its_checkpoints_and_frees_the_directory(
    pipe, tmp_path, how, error, saved
):
    """The user's batches raise at step 3, or hold NaN there: the checkpoint of step 2 in flight is finished
    (not left as a temporary folder), the checkpointer closed and the directory's lock released -- the same
    process trains on from step 2 at once, as a run that never failed."""
    ck, run = str(tmp_path / "ck"), str(tmp_path / "run")
    with pytest.raises(error):
        jp.train(
            pipe, failing_stream(3, how), steps=5, out_dir=run, checkpoint_dir=ck, checkpoint_every=1, **QUIET
        )
    left = sorted(os.listdir(ck))
    assert [x for x in left if x.isdigit()] == saved, left
    assert not [x for x in left if "tmp" in x] and ".jaxpipe.lock" not in left, left
    again = jp.train(pipe, stream(), steps=5, out_dir=run, checkpoint_dir=ck, checkpoint_every=1, **QUIET)
    assert again.summary["resumed_at"] == int(saved[-1]) and again.step == 5
    ref = jp.train(pipe, stream(), steps=5, out_dir=str(tmp_path / "ref"), **QUIET)
    jax.tree.map(assert_same, pipe.params(again.state), pipe.params(ref.state))


def test_a_refused_resume_frees_the_directory_for_the_right_model(pipe, tmp_path):
    """A resume refused for another model leaves the lock to nobody: the right model then resumes in the same
    process (it was refused as "in use by process <this one>")."""
    ck = str(tmp_path / "ck")
    jp.train(pipe, stream(), steps=2, out_dir=str(tmp_path / "a"), checkpoint_dir=ck, **QUIET)
    wider = jp.models.residual_mlp(2, in_dim=12, num_classes=5, width=24)
    other = jp.Pipeline(
        wider, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.05), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match="another model"):
        jp.train(other, stream(), steps=3, out_dir=str(tmp_path / "b"), checkpoint_dir=ck, **QUIET)
    assert ".jaxpipe.lock" not in os.listdir(ck)
    done = jp.train(pipe, stream(), steps=3, out_dir=str(tmp_path / "a"), checkpoint_dir=ck, **QUIET)
    assert done.summary["resumed_at"] == 2


def test_a_batches_function_that_returns_one_shared_iterator_is_refused_with_the_fix(pipe, tmp_path):
    """``lambda: it`` cannot start the stream over: resumed, a run skipped from wherever ``it`` was and lost a
    batch at each restart (final params 0.054 off, while it printed the right data position).  Refused before
    step 1 of a checkpointed run; a run without checkpoints never restarts and trains on it."""
    it = stream()()
    with pytest.raises(jp.ConfigError, match=r"returns the same iterator each time.*generator function"):
        jp.train(
            pipe,
            lambda: it,
            steps=2,
            out_dir=str(tmp_path / "a"),
            checkpoint_dir=str(tmp_path / "ck"),
            **QUIET,
        )
    assert not os.path.exists(tmp_path / "ck" / ".jaxpipe.lock")
    done = jp.train(pipe, lambda: it, steps=2, out_dir=str(tmp_path / "b"), **QUIET)
    assert done.step == 2


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(steps=2.5), r"steps=2.5: give a whole number"),
        (dict(steps="3"), r"steps='3': give a whole number"),
        (dict(steps=None), r"steps=None: give a whole number"),
        (dict(eval_every=-1), r"eval_every=-1: must be at least 0"),
        (dict(checkpoint_every=1.5), r"checkpoint_every=1.5: give a whole number"),
        (dict(stop_grace_s=float("nan")), r"stop_grace_s=nan: give seconds >= 0"),
        (dict(eval_batches=3), r"eval_batches=int: give a list"),
        (dict(hooks=[print, 3]), r"hooks\[1\]=3: give a function"),
        (dict(evaluate="acc"), r"evaluate='acc': give a function"),
        (dict(units_per_step="x"), r"units_per_step='x': give a positive number"),
        (dict(learning_rate=1e-3), r"learning_rate=0.001: give the optax schedule"),
        (dict(checkpoint_keep="3"), r"checkpoint_keep='3': give a whole number"),
        (dict(overlap_steps="no"), r"overlap_steps='no': give True or False"),
    ],
    ids=[
        "steps_float",
        "steps_str",
        "steps_none",
        "eval_every_negative",
        "checkpoint_every_float",
        "grace_nan",
        "eval_batches_int",
        "hook_not_callable",
        "evaluate_str",
        "units_per_step_str",
        "learning_rate_float",
        "keep_str",
        "overlap_str",
    ],
)
def test_the_loops_options_are_checked_by_name(pipe, kw, match):
    with pytest.raises(jp.ConfigError, match=match):
        jp.Trainer(pipe, stream(), **{"steps": 3, **kw})


def test_paths_that_cannot_be_directories_are_refused_before_step_one(pipe, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for name in ("out_dir", "checkpoint_dir"):
        with pytest.raises(jp.ConfigError, match=rf"{name}={a_file}: a file is there, not a directory"):
            jp.Trainer(pipe, stream(), steps=3, **{name: str(a_file)})
        with pytest.raises(jp.ConfigError, match=rf"{name}={a_file / 'sub'}: {a_file} is a file"):
            jp.Trainer(pipe, stream(), steps=3, **{name: str(a_file / "sub")})


def test_no_eval_batches_and_batches_that_run_out(pipe, tmp_path):
    """``eval_batches=None`` is none; a stream shorter than the run ends with an error that says so (it was a
    bare StopIteration with an empty message)."""
    done = jp.train(pipe, stream(), steps=2, out_dir=str(tmp_path / "a"), eval_batches=None, **QUIET)
    assert done.step == 2
    with pytest.raises(jp.ConfigError, match=r"the batches ran out before step 3 of steps=5 \(after 2 batch"):
        jp.train(pipe, [BATCH(8, 1), BATCH(8, 2)], steps=5, out_dir=str(tmp_path / "b"), **QUIET)


def test_in_flight_of_another_type_is_named(pipe, monkeypatch):
    import jaxpipe.checks.on_device as sc

    monkeypatch.setattr(sc, "IN_FLIGHT", "2")
    with pytest.raises(jp.ConfigError, match=r"IN_FLIGHT='2': give a whole number >= 1"):
        pipe.step(pipe.init(), BATCH(8))


def test_the_non_finite_stop_keeps_the_librarys_likely_cause(tmp_path):
    """A label past the table of a model that does not declare its integer ids: the loop's stop names the
    field as the pipeline's own check does (it said only "Lower the learning rate")."""
    from test_step_checks import _classifier

    model, batch = _classifier()
    pipe = jp.Pipeline(
        model, schedule="gpipe", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    bad = dict(batch, label=batch["label"].at[3].set(99))
    with pytest.raises(
        jp.training.NonFiniteLoss,
        match=r"at step 1, .*Likely cause: batch field\(s\) \['label'\] "
        r"hold integer ids the model does not declare.*Lower the",
    ):
        jp.train(pipe, [bad, batch], steps=2, out_dir=str(tmp_path), **QUIET)


def test_saved_params_are_named_by_their_tree_paths_and_load_with_plain_numpy(pipe, tmp_path):
    """``jp.save_params`` (what ``--save_params`` writes): every array of ``pipe.params(state)`` under its
    tree path in the model's own layout -- ``np.load`` gives them back, no jaxpipe needed (it wrote arr_0 ...
    arr_11 in the executor's stacked layout)."""
    state = pipe.init()
    params = pipe.params(state)
    path = jp.save_params(str(tmp_path / "p"), params)
    assert path == str(tmp_path / "p.npz")
    loaded = np.load(path)
    flat = jax.tree_util.tree_flatten_with_path(dict(zip(("stages", "pre", "post"), params)))[0]
    assert len(loaded.files) == len(flat) and all(
        f.split("/")[0] in ("stages", "pre", "post") for f in loaded.files
    )
    assert not any(f.startswith("arr_") for f in loaded.files)
    by_name = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path_): v for path_, v in flat}
    for name, value in by_name.items():
        assert np.array_equal(loaded[name], np.asarray(value)), name
    with pytest.raises(jp.ConfigError, match=r"save_params=.*missing/q.npz: the directory .* does not exist"):
        jp.save_params(str(tmp_path / "missing" / "q.npz"), params)


def records(out_dir):
    return [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]


def test_overlapped_steps_log_train_and_evaluate_as_steps_read_one_by_one(pipe, tmp_path):
    """``overlap_steps`` (the default) reads a step's loss once the next is dispatched: the same records
    (less the times), the same evaluations and the same final weights, bit for bit, as reading each step
    before the next; every step's time is its own (not two steps' from dispatch to read)."""
    runs = {}
    for overlap in (True, False):
        out = str(tmp_path / str(overlap))
        runs[overlap] = jp.train(
            pipe,
            stream(),
            steps=7,
            out_dir=out,
            eval_batches=[BATCH(8, 99)],
            eval_every=3,
            overlap_steps=overlap,
            **QUIET,
        )
        runs[overlap].records = records(out)
    strip = lambda recs: [{k: v for k, v in r.items() if k != "time_s"} for r in recs]
    assert strip(runs[True].records) == strip(runs[False].records)
    assert [r["step"] for r in runs[True].records] == list(range(1, 8))
    assert [r["step"] for r in runs[True].records if "eval_loss" in r] == [3, 6, 7]
    jax.tree.map(assert_same, pipe.params(runs[True].state), pipe.params(runs[False].state))
    times = [r["time_s"] for r in runs[True].records]
    assert all(t > 0 for t in times)
    assert sum(times) <= runs[True].summary["wall_s"]  # each step's own span: none counted twice


def test_an_overlapped_run_that_fails_keeps_the_record_of_the_step_before(pipe, tmp_path):
    """The batches fail at step 3 while step 2's loss is still unread: step 2 is logged before the error
    goes to the caller, as when each step is read before the next starts."""

    def failing():
        for s in itertools.count(1):
            if s == 3:
                raise OSError("the data source failed at batch 3")
            yield BATCH(8, s)

    with pytest.raises(OSError, match="failed at batch 3"):
        jp.train(pipe, failing, steps=5, out_dir=str(tmp_path), eval_every=0, **QUIET)
    assert [r["step"] for r in records(tmp_path)] == [1, 2]


@pytest.mark.parametrize("overlap,stopped_at", [(True, 3), (False, 2)])
def test_a_hooks_stop_takes_effect_after_the_step_in_flight_and_resumes_exactly(
    pipe, tmp_path, overlap, stopped_at
):
    """A hook asks to stop after step 2: read one by one the run stops there; overlapped, step 3 is already
    running and the run stops after it -- either way with a checkpoint of the step it stopped at, from which
    the run resumes equal to one that never stopped."""

    def stop_after_two(trainer, step):
        if step == 2:
            trainer.request_stop("a hook")

    ck, common = str(tmp_path / "ck"), dict(steps=5, eval_every=0, **QUIET)
    first = jp.train(
        pipe,
        stream(),
        out_dir=str(tmp_path / "run"),
        checkpoint_dir=ck,
        hooks=[stop_after_two],
        exit_on_stop=False,
        overlap_steps=overlap,
        **common,
    )
    assert first.stopped == "a hook" and first.step == stopped_at
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, stopped_at + 1))
    second = jp.train(pipe, stream(), out_dir=str(tmp_path / "run"), checkpoint_dir=ck, **common)
    assert second.summary["resumed_at"] == stopped_at
    ref = jp.train(pipe, stream(), out_dir=str(tmp_path / "ref"), **common)
    jax.tree.map(assert_same, pipe.params(second.state), pipe.params(ref.state))


def test_a_nan_found_while_the_next_step_runs_says_which_weights_it_replays(pipe, tmp_path):
    with pytest.raises(jp.training.NonFiniteLoss, match="at step 2, .*the weights after step 3, which had"):
        jp.train(pipe, stream(nan_at=2), steps=4, out_dir=str(tmp_path / "a"), eval_every=0, **QUIET)
    with pytest.raises(jp.training.NonFiniteLoss, match="at step 2, .*the weights this step used"):
        jp.train(
            pipe,
            stream(nan_at=2),
            steps=4,
            out_dir=str(tmp_path / "b"),
            eval_every=0,
            overlap_steps=False,
            **QUIET,
        )
    assert len(records(tmp_path / "a")) == len(records(tmp_path / "b")) == 2


def test_an_asynchronous_pipeline_trains_the_same_overlapped_and_drains_at_the_end(tmp_path):
    """A no-flush schedule carries micro-batches between steps: read overlapped or one by one, the run logs
    the same losses and ends drained with the same weights, bit for bit."""
    pipe = jp.Pipeline(
        MODEL,
        schedule="pipedream_2bw",
        num_microbatches=2,
        optimizer=optax.sgd(0.05),
        mesh=jp.make_mesh(stages=2),
    )
    runs = {
        overlap: jp.train(
            pipe,
            stream(),
            steps=5,
            out_dir=str(tmp_path / str(overlap)),
            eval_every=0,
            overlap_steps=overlap,
            **QUIET,
        )
        for overlap in (True, False)
    }
    assert losses(tmp_path / "True") == losses(tmp_path / "False") and len(losses(tmp_path / "True")) == 5
    jax.tree.map(assert_same, pipe.params(runs[True].state), pipe.params(runs[False].state))
