"""A step that never waits (issue #39, item 1; #42, item 5): the batch and the loss are checked inside the
step's program, nothing is read back inside the call, a failed step changes nothing, and the next call
raises the ConfigError that names the field."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import small_model


def _equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in zip(la, lb)
    )


def _host(state):
    return jax.tree.map(np.asarray, state)


def _mlp_pipe(schedule, **kw):
    model, batch_fn = small_model("mlp", 2)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=2,
        optimizer=optax.adam(1e-2),
        mesh=jp.make_mesh(stages=2),
        **kw,
    )
    return pipe, batch_fn


@pytest.mark.parametrize("schedule,bad_field", [("1f1b", "x"), ("pipedream_2bw", "x"), ("1f1b", "y")])
def test_a_bad_device_batch_changes_nothing_and_the_next_call_says_so(schedule, bad_field):
    """``x``: an Inf (the loss goes non-finite too); ``y``: a label of -1, which gives a finite loss (it reads
    the last class), so only the batch check can keep the update back."""
    pipe, batch_fn = _mlp_pipe(schedule)
    good = jax.tree.map(jnp.asarray, batch_fn(8))
    state, _ = pipe.step(pipe.init(), good)
    state, _ = pipe.step(state, good)  # a no-flush pipeline now has micro-batches in flight
    before = _host(state)
    bad = (
        dict(good, x=good["x"].at[1, 0].set(jnp.inf))
        if bad_field == "x"
        else dict(good, y=good["y"].at[3].set(-1))
    )
    with jax.transfer_guard_device_to_host("disallow"):  # nothing is read back inside the step
        state, metrics = pipe.step(state, bad)
    after = _host(state)
    assert _equal(before, after), "a step on a batch with Inf changed the state"
    assert int(metrics["step"]) == int(before.step)
    with pytest.raises(jp.ConfigError, match=r"\['x'\], which" if bad_field == "x" else "'y'") as e:
        pipe.step(state, good)
    assert "changed nothing" in str(e.value)
    # the error was raised before anything ran: the state is still usable, and training goes on exactly as
    # if the bad batch had never been given
    ref = pipe.init()
    ref, _ = pipe.step(ref, good)
    ref, _ = pipe.step(ref, good)
    ref, m_ref = pipe.step(ref, good)
    state, m = pipe.step(state, good)
    assert float(m["loss"]) == float(m_ref["loss"])
    assert _equal(_host(state), _host(ref))


def test_an_id_out_of_range_on_the_device_is_named_at_the_next_call():
    model, batch_fn = small_model("gpt", 2)
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    good = jax.tree.map(jnp.asarray, batch_fn(4))
    key = next(k for k in (model.integer_inputs or {}) if k in good)
    bound = model.integer_inputs[key]
    state = pipe.init()
    before = _host(state)
    # the table's size itself is out of range too (a check of ``> bound`` would let it through: issue #50)
    for bad in (bound + 7, bound, -1):
        state, _ = pipe.step(state, dict(good, **{key: good[key].at[0, 0].set(bad)}))
        assert _equal(before, _host(state))
        with pytest.raises(jp.ConfigError, match=f"holds {bad}, outside \\[0, {bound}\\)"):
            pipe.check()
        pipe.check()  # reported once


def _classifier(integer_inputs=None):
    """A classifier written as functions: label ids index the log-probabilities (a label >= 5 gives NaN)."""
    r = np.random.default_rng(0)
    W = jnp.asarray(r.normal(size=(2, 8, 8)) / 3, jnp.float32)

    def post_loss(p, h, b):
        logp = jax.nn.log_softmax(h @ p)
        return -jnp.mean(
            jnp.take_along_axis(logp, b["label"][:, None], axis=1, mode="fill", fill_value=jnp.nan)
        )

    model = jp.PipelineModel(
        stage_fn=lambda w, h: jnp.tanh(h @ w["w"]),
        stage_params={"w": W},
        pre=lambda p, b: b["x"] @ p,
        pre_params=jnp.eye(4, 8),
        post_loss=post_loss,
        post_params=jnp.ones((8, 5)) / 8,
        integer_inputs=integer_inputs,
    )
    batch = {
        "x": jnp.asarray(r.normal(size=(8, 4)), jnp.float32),
        "label": jnp.arange(8, dtype=jnp.int32) % 5,
    }
    return model, batch


def test_a_nonfinite_loss_applies_no_update_and_names_the_likely_cause():
    model, batch = _classifier()
    pipe = jp.Pipeline(
        model, schedule="gpipe", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    state = pipe.init()
    before = _host(state)
    state, m = pipe.step(state, dict(batch, label=batch["label"].at[3].set(99)))
    assert not np.isfinite(float(m["loss"]))
    assert _equal(before, _host(state)), "a step with a NaN loss was applied"
    with pytest.raises(jp.ConfigError, match=r"NaN or Inf.*Likely cause.*\['label'\]"):
        pipe.step(state, batch)
    state, m = pipe.step(state, batch)
    assert np.isfinite(float(m["loss"])) and int(m["step"]) == 1


def test_skip_nonfinite_skips_without_an_error():
    model, batch = _classifier()
    pipe = jp.Pipeline(
        model,
        schedule="gpipe",
        num_microbatches=2,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=2),
        skip_nonfinite=True,
    )
    state = pipe.init()
    p0 = _host(pipe.params(state))
    state, m = pipe.step(state, dict(batch, label=batch["label"].at[3].set(99)))
    assert bool(m["skipped"])
    state, m = pipe.step(state, batch)  # no error: skipping is what was asked for
    assert not bool(m["skipped"]) and not _equal(p0, _host(pipe.params(state)))


def test_an_integer_inputs_key_the_batch_lacks_is_refused():
    model, batch = _classifier(integer_inputs={"labels": 5})
    pipe = jp.Pipeline(
        model, schedule="gpipe", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match=r"integer_inputs= names \['labels'\], which the batch lacks"):
        pipe.step(pipe.init(), batch)


def test_a_declared_id_field_is_checked_on_the_device():
    model, batch = _classifier(integer_inputs={"label": 5})
    pipe = jp.Pipeline(
        model, schedule="gpipe", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    state, _ = pipe.step(pipe.init(), dict(batch, label=batch["label"].at[0].set(-1)))
    with pytest.raises(jp.ConfigError, match=r"batch\['label'\] holds -1.*negative ids read the last rows"):
        pipe.step(state, batch)


def test_a_failed_step_is_never_checkpointed(tmp_path):
    pipe, batch_fn = _mlp_pipe("1f1b")
    good = jax.tree.map(jnp.asarray, batch_fn(8))
    state, _ = pipe.step(pipe.init(), dict(good, x=good["x"].at[0, 0].set(jnp.nan)))
    ck = jp.Checkpointer(str(tmp_path / "ck"), pipe)
    try:
        with pytest.raises(jp.ConfigError, match="NaN or Inf"):
            ck.save(1, state)
        assert ck.all_steps() == []
    finally:
        ck.close()


def test_loss_and_grad_checks_its_batch_on_the_device():
    pipe, batch_fn = _mlp_pipe("1f1b")
    good = jax.tree.map(jnp.asarray, batch_fn(8))
    state = pipe.init()
    with jax.transfer_guard_device_to_host("disallow"):
        pipe.loss_and_grad(state, dict(good, x=good["x"].at[0, 0].set(jnp.nan)))
    with pytest.raises(jp.ConfigError, match=r"loss_and_grad\(\) #1: .*\['x'\]"):
        pipe.loss_and_grad(state, good)


def test_steps_back_to_back_read_nothing_but_the_previous_status(monkeypatch):
    """Twenty steps: the host reads exactly one small status per step (the previous one's, explicitly) and
    nothing else -- no per-leaf isfinite read, no integer-range read -- and checks the batch's structure once
    per shape."""
    model, batch = _classifier(integer_inputs={"label": 5})
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    state = pipe.init()
    state, _ = pipe.step(state, batch)  # compile
    reads, checked = [], []
    real, check_batch = jax.device_get, pipe._check_batch
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(np.shape(x)) or real(x))
    monkeypatch.setattr(pipe, "_check_batch", lambda b: checked.append(b) or check_batch(b))
    with jax.transfer_guard_device_to_host("disallow"):
        for _ in range(20):
            state, m = pipe.step(state, batch)
    assert len(reads) == 20 and all(len(s) == 1 and s[0] <= 8 for s in reads), reads
    # the batch's structure, shapes and dtypes were checked at the first step: not again (its values are)
    assert checked == []
    odd = jax.tree.map(lambda a: a[:3], batch)  # another shape: checked, and refused
    with pytest.raises(jp.ConfigError, match="batch size 3 does not split"):
        pipe.step(state, odd)
    assert len(checked) == 1


def test_cyclic_dp_checks_on_the_device_too():
    """Cyclic DP reports a bad device batch at the next call (its state is not kept: a conditional around its
    ring's in-place landings would copy the stacked stages every step), and that state is never saved."""
    model, batch_fn = small_model("mlp", 2)
    cdp = jp.CyclicDataParallel(model, optax.sgd(0.05), rule="v2", mesh=jp.make_mesh(data=2))
    good = jax.tree.map(jnp.asarray, batch_fn(4))
    state, _ = cdp.step(cdp.init(), good)
    with jax.transfer_guard_device_to_host("disallow"):
        state, _ = cdp.step(state, dict(good, x=good["x"].at[0, 0].set(jnp.nan)))
    with pytest.raises(jp.ConfigError, match=r"CyclicDataParallel\(\.\.\., check_inputs=False\)"):
        cdp.step(state, good)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_a_consumed_state_is_refused_before_anything_runs(schedule, tmp_path):
    """step/drain donate their input; using it again is a ConfigError, not "Buffer has been deleted" and
    a segmentation fault (a donated array sharded over two devices)."""
    pipe, batch_fn = _mlp_pipe(schedule)
    batch = batch_fn(8)
    state = pipe.init()
    state2, _ = pipe.step(state, batch)
    for call in (
        lambda: pipe.step(state, batch),
        lambda: pipe.loss_and_grad(state, batch),
        lambda: pipe.drain(state),
        lambda: pipe.params(state),
    ):
        with pytest.raises(jp.ConfigError, match="consumed.*donate"):
            call()
    ck = jp.Checkpointer(str(tmp_path / "ck"), pipe)
    try:
        with pytest.raises(jp.ConfigError, match="consumed"):
            ck.save(1, state)
    finally:
        ck.close()
    if schedule == "pipedream":
        drained, _ = pipe.drain(state2)
        with pytest.raises(jp.ConfigError, match=r"drain\(\) got a state that an earlier"):
            pipe.drain(state2)
        pipe.params(drained)
        state2 = drained
    state3, m = pipe.step(state2, batch)  # the returned state goes on
    assert np.isfinite(float(m["loss"]))


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 9), (256, 1024), (2048, 1024)])
def test_the_one_pass_finite_check_sees_every_nan_and_inf(shape):
    """``sum(v - v)`` is NaN exactly where ``v`` holds a NaN or Inf, anywhere in an array of any size (a
    reduction XLA CPU splits and runs in parallel; ``max(abs(v))`` there missed NaN, measured), and 0 for
    finite values as large as float32 holds; bf16 and f16 too."""
    from jaxpipe.checks.on_device import _any_nonfinite

    f = jax.jit(_any_nonfinite)
    n = int(np.prod(shape))
    rng = np.random.default_rng(0)
    for bad in (np.nan, np.inf, -np.inf):
        for pos in {0, n // 2, n - 1, 12345 % n}:
            a = rng.normal(size=shape).astype(np.float32)
            a.reshape(-1)[pos] = bad
            assert int(f(jnp.asarray(a))) == 1, (bad, pos)
    assert int(f(jnp.asarray(np.full(shape, 3e38, np.float32)))) == 0
    for dt in (jnp.bfloat16, jnp.float16):
        a = np.ones(shape, np.float32)
        assert int(f(jnp.asarray(a, dt))) == 0
        a.reshape(-1)[n - 1] = np.nan
        assert int(f(jnp.asarray(a, dt))) == 1


def _wpipe_with_a_refusable_batch(tmp_path):
    """WPipe (its state is not kept back: two chunks a device), a good batch, one whose label -1 the check
    refuses (a finite effect: only the check can tell) and a synchronous Checkpointer."""
    model, batch_fn = small_model("mlp", 4)
    pipe = jp.Pipeline(
        model, schedule="wpipe", num_microbatches=2, optimizer=optax.sgd(0.05), mesh=jp.make_mesh(stages=2)
    )
    good = jax.tree.map(jnp.asarray, batch_fn(8))
    bad = dict(good, y=good["y"].at[3].set(-1))
    return pipe, good, bad, jp.Checkpointer(str(tmp_path / "ck"), pipe, async_save=False)


def test_a_refused_state_is_never_written_however_often_it_is_saved(tmp_path):
    """WPipe's state is not kept back (two chunks a device): after a refused step, that state and every state
    derived from it are refused by every save -- the second identical save too (issue #48: it was accepted
    and wrote the refused step's effect) -- until a restore gives a clean one."""
    pipe, good, bad, ck = _wpipe_with_a_refusable_batch(tmp_path)
    try:
        state, _ = pipe.step(pipe.init(), good)
        ck.save(1, state)
        state, _ = pipe.step(state, bad)
        with pytest.raises(jp.ConfigError, match="'y'.*not kept back.*last good checkpoint is step 1"):
            ck.save(3, state)
        for save in (lambda: ck.save(3, state), lambda: ck.maybe_save(3, state, force=True)):
            with pytest.raises(jp.ConfigError, match="refusing to checkpoint.*refused step.*'y'"):
                save()
        derived, _ = pipe.step(state, good)
        derived, _ = pipe.drain(derived)
        with pytest.raises(jp.ConfigError, match="refused step"):
            ck.save(4, derived)
        assert ck.all_steps() == [1]
        restored, _, _ = ck.restore(pipe.prepare(pipe.init(), good))
        clean, _ = pipe.step(restored, good)
        ck.save(5, clean)
        assert ck.all_steps() == [1, 5]
    finally:
        ck.close()


def test_a_refused_last_step_is_reported_when_the_script_ends(tmp_path):
    """Nothing reads the last step's checks in a script that ends after it: the exit says so on stderr, and a
    Checkpointer's close() raises it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys; sys.path.insert(0, "tests")
        import conftest  # the tests' XLA flags
        import jax, jax.numpy as jnp, optax, jaxpipe as jp
        from helpers import small_model
        model, batch_fn = small_model("mlp", 2)
        pipe = jp.Pipeline(model, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1),
                           mesh=jp.make_mesh(stages=2))
        good = jax.tree.map(jnp.asarray, batch_fn(8))
        state, _ = pipe.step(pipe.init(), good)
        ck = jp.Checkpointer(sys.argv[1], pipe)
        state, m = pipe.step(state, dict(good, x=good["x"].at[0, 0].set(jnp.nan)))
        try:
            ck.close()
        except jp.ConfigError as e:
            print("close raised:", str(e)[:60])
        state, m = pipe.step(state, dict(good, x=good["x"].at[0, 0].set(jnp.nan)))
        print("loss", float(m["loss"]))
    """)
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ck")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "close raised: step() #2: the batch holds NaN or Inf in ['x']" in p.stdout, p.stdout
    assert (
        "jaxpipe: a step of this run was refused and nothing read it before exit: step() #3: the batch "
        "holds NaN or Inf in ['x']"
    ) in p.stderr, p.stderr[-3000:]


def test_the_grad_norm_metric_is_the_norm_of_the_steps_mean_gradient():
    """``metrics["grad_norm"]`` is the norm of the gradient the update used (the mean over micro-batches), not
    of the micro-batch sums (issue #50: a norm M times too large survived every test)."""
    model, batch = _classifier()
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=4, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    state = pipe.init()
    _, grads = pipe.loss_and_grad(state, batch)
    _, m = pipe.step(state, batch)
    norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)))
    assert float(m["grad_norm"]) == pytest.approx(float(norm), rel=1e-5)


def test_a_no_flush_steps_nonfinite_loss_is_not_kept_back_and_its_states_are_refused(tmp_path):
    """PipeDream-2BW updates inside its pipeline: a step whose loss is NaN (finite inputs, an undeclared
    label past the table) has landed its effect before the check can tell, whatever the input checks say.
    The next call says so, and that state and the one derived from it are refused by save -- judged on the
    loss flag, not on the input flag alone."""
    model, batch = _classifier()
    pipe = jp.Pipeline(
        model,
        schedule="pipedream_2bw",
        num_microbatches=2,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=2),
    )
    state, m = pipe.step(pipe.init(), dict(batch, label=batch["label"].at[3].set(99)))
    with pytest.raises(
        jp.ConfigError,
        match=r"loss or the gradient norm is NaN or Inf; that step ran \(this "
        r"method's state is not kept back",
    ):
        pipe.check()
    ck = jp.Checkpointer(str(tmp_path / "ck"), pipe, async_save=False)
    try:
        with pytest.raises(jp.ConfigError, match="refusing to checkpoint this state.*refused step"):
            ck.save(1, state)
        derived, _ = pipe.step(state, batch)
        with pytest.raises(jp.ConfigError, match="refusing to checkpoint this state.*refused step"):
            ck.save(2, derived)
        assert ck.all_steps() == []
    finally:
        ck.close()


def test_a_refusal_follows_the_states_values_into_copies_and_their_descendants(tmp_path):
    """WPipe's refused state is refused by save however it is carried: a copy (``jnp.copy`` of every leaf), a
    ``device_put`` onto the same devices, a state a step derived from the copy -- until a restore gives a
    clean one.  (The refusal was tied to the identity of the state's first array: the copy was written.)"""
    pipe, good, bad, ck = _wpipe_with_a_refusable_batch(tmp_path)
    try:
        state, _ = pipe.step(pipe.init(), good)
        ck.save(1, state)
        state, _ = pipe.step(state, bad)
        copy = jax.tree.map(jnp.copy, state)
        moved = jax.tree.map(lambda a: jax.device_put(a, a.sharding), copy)
        with pytest.raises(jp.ConfigError, match="'y'"):
            pipe.check()
        for s in (copy, moved, state):
            with pytest.raises(jp.ConfigError, match="refusing to checkpoint.*refused step.*'y'"):
                ck.save(2, s)
        derived, _ = pipe.step(copy, good)
        with pytest.raises(jp.ConfigError, match="refusing to checkpoint.*refused step"):
            ck.save(3, derived)
        assert ck.all_steps() == [1]
        restored, _, _ = ck.restore(pipe.prepare(pipe.init(), good))
        clean, _ = pipe.step(restored, good)
        clean, _ = pipe.step(clean, good)
        ck.save(4, clean)
        assert ck.all_steps() == [1, 4]
    finally:
        ck.close()


def test_a_call_inside_a_jax_transformation_says_to_call_it_from_python():
    """``jax.jit(pipe.step)`` traced the state: JAX's own error was a ConcretizationTypeError from deep
    inside the checks; the pipeline says what happened and what to call instead."""
    pipe, batch_fn = _mlp_pipe("1f1b")
    batch, state = batch_fn(8), pipe.init()
    with pytest.raises(jp.ConfigError, match=r"step\(\) got a traced state.*outside any transformation"):
        jax.jit(pipe.step)(state, batch)
    with pytest.raises(jp.ConfigError, match=r"got a traced batch.*jax\.jit"):
        jax.jit(lambda b: pipe.loss_and_grad(state, b))(batch)
    _, metrics = pipe.step(state, batch)  # nothing was consumed
    assert np.isfinite(float(metrics["loss"]))
