"""The one no-flush executor (``runtime/executor.py``) runs every pipeline-form no-flush method from the
IR's stream: each equals its serial reference with NaN-filled bubbles and data parallelism at once, reads no
weight version its policy no longer holds, and drains to the last micro-batch."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import rel_err, small_model, change
from jaxpipe.optim.reference import serial_reference

METHODS = ["pipedream", "pipedream_2bw", "spectrain", "pipeoptim", "cdp_v1", "cdp_v2", "wpipe"]


@pytest.mark.parametrize("method", METHODS)
def test_nan_bubbles_and_data_parallel_equal_the_serial_reference(method):
    D, M, data, steps = 2, 2, 2, 3
    model, batch_fn = small_model("mlp", 2 * D if method == "wpipe" else D)
    opt = optax.sgd(0.05, momentum=0.9)
    pipe = jp.Pipeline(
        model,
        schedule=method,
        num_microbatches=M,
        optimizer=opt,
        mesh=jp.make_mesh(stages=D, data=data),
        nan_bubbles=True,
    )
    batches = [batch_fn(2 * M * data, s=k) for k in range(steps)]
    state = pipe.init()
    for b in batches:
        state, m = pipe.step(state, b)
    state, m = pipe.drain(state)
    assert int(m["microbatches_finished"]) == int(m["microbatches_fed"]) == steps * M
    assert int(m["version_errors"]) == 0
    got = pipe.params(state)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(got))
    ref = serial_reference(model, method, opt, M, batches, data_parallel=data)
    assert rel_err(got, ref["params"]) <= 1e-5
    # the update itself, leaf by leaf relative to each leaf's change (issue #33 item 2): an equality of the
    # parameters at 1e-5 is ~1e-3 on their least-moved leaves' updates
    assert rel_err(change(got, model.params), change(ref["params"], model.params)) <= 1e-5


def test_stream_buffers_fit_the_old_formulas():
    """The capacities read off the replay are what the 1F1B family's closed forms gave: D (alternating) or
    2D - 1 (lanes) stash slots, and a ring no larger than M + latency."""
    from jaxpipe.schedules.periodic import no_flush_1f1b, no_flush_lanes

    for D, M in [(1, 3), (2, 4), (4, 8), (8, 16)]:
        for make, slots in ((no_flush_1f1b, D), (no_flush_lanes, 2 * D - 1)):
            p = make("x", D)
            buf = p.buffers(M)
            assert buf["stash"] == [slots] == [p.max_inflight()]
            assert M <= buf["ring"] <= M + p.tick("B", 0, 0) // p.period + 1
            done = buf["done"] + [
                buf["done_steady"] + M * q for q in range(len(buf["done"]), len(buf["done"]) + 3)
            ]
            assert all(a <= b for a, b in zip(done, done[1:])) and done[-1] - done[-2] == M


def test_drain_runs_as_many_calls_as_the_stream_needs():
    """M = 1 at D = 4: a micro-batch's last backward runs calls after the one that fed it (the replay's
    ``latency``); drain runs them and the run ends equal to the serial reference."""
    from jaxpipe.schedules.periodic import no_flush_1f1b

    assert no_flush_1f1b("pipedream", 4).buffers(1)["latency"] == 3
    model, batch_fn = small_model("mlp", 4)
    opt = optax.sgd(0.05, momentum=0.9)
    pipe = jp.Pipeline(
        model, schedule="pipedream", num_microbatches=1, optimizer=opt, mesh=jp.make_mesh(stages=4)
    )
    batches = [batch_fn(2, s=k) for k in range(2)]
    state = pipe.init()
    for b in batches:
        state, m = pipe.step(state, b)
    assert int(m["microbatches_finished"]) < 2
    state, m = pipe.drain(state)
    assert int(m["microbatches_finished"]) == int(m["microbatches_fed"]) == 2
    assert (
        rel_err(pipe.params(state), serial_reference(model, "pipedream", opt, 1, batches)["params"]) <= 1e-5
    )


@pytest.mark.parametrize("method", ["pipedream_2bw", "cdp_v2"])
def test_version_errors_counts_a_wrong_read(method):
    """Issue #33 item 3: the ``version_errors`` metric is not vacuous.  An honest run reads only versions the
    policy holds (0 errors); the same state with its version counter shifted by 3 -- the policy then holds
    w(n+3), w(n+2) while the micro-batches need w(b-1) or w(b) -- counts every read as wrong."""
    model, batch_fn = small_model("mlp", 4)
    pipe = jp.Pipeline(
        model, schedule=method, num_microbatches=4, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=4)
    )
    state, m = pipe.step(pipe.init(), batch_fn(16, s=0))
    assert int(m["version_errors"]) == 0
    copy = jax.tree.map(lambda a: a.copy() if hasattr(a, "copy") else a, state)  # step() donates its state
    _, m_honest = pipe.step(state, batch_fn(16, s=1))
    assert int(m_honest["version_errors"]) == 0
    ps = copy.policy_state
    shifted = copy._replace(policy_state=ps._replace(n_updates=ps.n_updates + 3))
    _, m = pipe.step(shifted, batch_fn(16, s=1))
    assert int(m["version_errors"]) >= 4 * 4 // 2, int(m["version_errors"])  # many reads, on every stage


def test_leak_probe_registers_routing():
    """Issue #33 item 3, registers routing (a periodic no-flush stream): device 2's forwards moved one tick
    late read the register after the one their input came in -- a NaN blank in NaN mode -- and the run goes
    NaN; the honest stream stays finite.  (Plan-slot routing: tests/test_exactness.py's leak probe.)"""
    import dataclasses

    model, batch_fn = small_model("mlp", 4)

    def run(shift):
        pipe = jp.Pipeline(
            model,
            schedule="pipedream",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=4),
            nan_bubbles=True,
        )
        per = pipe.schedule.periodic
        if shift:
            f = list(per.offsets["F"])
            f[2] += shift
            pipe.schedule.periodic = dataclasses.replace(per, offsets={**per.offsets, "F": tuple(f)})
        state = pipe.init()
        try:
            for k in range(2):
                state, m = pipe.step(state, batch_fn(16, s=k))
            pipe.check()
        except (
            jp.ConfigError
        ) as e:  # a non-finite loss is reported at the next call (jaxpipe.checks.on_device)
            assert "loss or the gradient norm is NaN or Inf" in str(e)
            return float("nan")
        return float(m["loss"])

    assert np.isfinite(run(0)) and not np.isfinite(run(1))


@pytest.mark.ci_once  # CI's first leg only (tests/conftest.py): 2 minutes on 2 cores
def test_leak_probe_ring_routing():
    """Ring routing (Cyclic DP's DP form): worker 0 running stage 2's forward before stage 1's is caught --
    reads of versions the stages do not hold are counted, and the parameters leave the serial reference."""
    model, batch_fn = small_model("mlp", 4)
    batches = [batch_fn(8, s=k) for k in range(3)]

    def run(swap):
        cdp = jp.CyclicDataParallel(
            model, optax.sgd(0.1), rule="v2", mesh=jp.make_mesh(data=4), nan_bubbles=True
        )
        if swap:
            import dataclasses

            per = cdp._runner.periodic
            uo = {k: [list(r) for r in v] for k, v in per.unit_offsets.items()}
            uo["F"][1][0], uo["F"][2][0] = uo["F"][2][0], uo["F"][1][0]
            cdp._runner.periodic = dataclasses.replace(
                per, unit_offsets={k: tuple(tuple(r) for r in v) for k, v in uo.items()}
            )
        state = cdp.init()
        for b in batches:
            state, _ = cdp.step(state, b)
        state, m = cdp.drain(state)
        return cdp.params(state), int(m["version_errors"])

    ref = serial_reference(model, "cdp_v2", optax.sgd(0.1), 4, batches)["params"]
    honest, e0 = run(False)
    wrong, e1 = run(True)
    assert e0 == 0 and rel_err(honest, ref) <= 1e-5
    assert e1 > 0 or rel_err(wrong, ref) > 1e-3, (e1, rel_err(wrong, ref))


def test_leak_probe_weight_stash(monkeypatch):
    """Issue #33 item 3, the weight stash: NaN mode starts PipeDream's stash as NaN (every slot a backward
    reads is written by its micro-batch's forward first).  A backward reading the slot one behind its own
    -- the stash of another micro-batch, or one never written -- turns the run NaN; the honest policy stays
    finite.  (Without NaN mode the wrong read would return a real, stale version: a wrong number that looks
    fine.)"""
    from jax import lax
    from jaxpipe.optim import policies

    model, batch_fn = small_model("mlp", 4)
    honest = policies.POLICIES["pipedream"]

    def one_behind(opt, D, M, ex=None):
        p = honest(opt, D, M, ex)
        wrong = lambda lp, stash, i, s: jax.tree.map(
            lambda b: lax.dynamic_index_in_dim(b, (i + D - 1) % D, 0, False), stash
        )
        return p._replace(backward_weights=wrong)

    def run(nan):
        pipe = jp.Pipeline(
            model,
            schedule="pipedream",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=4),
            nan_bubbles=nan,
        )
        state = pipe.init()
        try:
            for k in range(2):
                state, m = pipe.step(state, batch_fn(16, s=k))
            state, _ = pipe.drain(state)
            params = pipe.params(state)
        except (
            jp.ConfigError
        ) as e:  # a non-finite loss is reported at the next call (jaxpipe.checks.on_device)
            assert "loss or the gradient norm is NaN or Inf" in str(e)
            return False
        return all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(params))

    assert run(True)
    monkeypatch.setitem(policies.POLICIES, "pipedream", one_behind)
    assert not run(True)
    assert run(False)  # the same wrong read without NaN mode: finite, silently wrong
