"""AvgPipe (Xu et al.): N parallel pipelines on the mesh's ``pipe`` axis with elastic averaging (§3.2) and
advance forward propagation (§4.2, Algorithm 1); each equal to its serial reference."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import rel_err, small_model, change, RULE_MARGIN
from jaxpipe import schedules
from jaxpipe.optim.reference import avgpipe_reference

OPTS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
}


def run(kind="mlp", N=2, D=4, M=4, data=1, opt="adam", steps=3, nan_bubbles=True, **avg):
    model, batch_fn = small_model(kind, D)
    pipe = jp.Pipeline(
        model,
        schedule="avgpipe",
        num_microbatches=M,
        optimizer=OPTS[opt](),
        mesh=jp.make_mesh(pipes=N, data=data, stages=D),
        options=avg or None,
        nan_bubbles=nan_bubbles,
    )
    state = pipe.init()
    batches = [batch_fn(N * data * M * 2, s=k) for k in range(steps)]
    losses = []
    for b in batches:
        state, m = pipe.step(state, b)
        losses.append(np.asarray(m["pipe_losses"]))
    return pipe, state, batches, np.array(losses), model


@pytest.mark.parametrize(
    "N,D,M,data,opt,advance",
    [(2, 4, 4, 1, "adam", 0), (2, 2, 3, 2, "sgd", 1), (4, 2, 2, 1, "momentum", 1), (8, 1, 2, 1, "adam", 0)],
)
def test_matches_serial_reference(N, D, M, data, opt, advance):
    pipe, state, batches, losses, model = run(N=N, D=D, M=M, data=data, opt=opt, advance=advance)
    # the elastic ratio from the paper, written here (AvgPipe §3.2: "alpha ... is set to 1/N"), not taken from
    # jaxpipe's default: a changed default must fail this test (issue #43)
    ref = avgpipe_reference(model, OPTS[opt](), N, M, batches, data_parallel=data, alpha=1.0 / N)
    assert np.allclose(losses, np.array(ref["losses"]), rtol=1e-5)
    assert rel_err(pipe.params(state), ref["params"]) < 1e-5
    assert rel_err(state.params, jax.tree.map(lambda *a: np.stack(a), *ref["replicas"])) < 1e-5


def test_gpt_matches_serial_reference():
    # SGD-momentum: the key part of the qkv bias has an exactly-zero true gradient (softmax is shift-
    # invariant), and Adam turns its 1e-9 rounding noise into +-lr steps whose signs differ between any two
    # summation orders; the MLP cases above cover Adam
    pipe, state, batches, losses, model = run(kind="gpt", N=2, D=4, M=4, opt="momentum", steps=2, advance=2)
    ref = avgpipe_reference(model, OPTS["momentum"](), 2, 4, batches, alpha=1.0 / 2)  # AvgPipe §3.2: 1/N
    assert np.allclose(losses, np.array(ref["losses"]), rtol=1e-5)
    assert rel_err(pipe.params(state), ref["params"]) < 1e-5


def test_reference_is_the_mean_of_the_replicas_and_alpha_matters():
    pipe, state, *_ = run(N=4, D=2, M=2, opt="adam", steps=3)
    mean = jax.tree.map(lambda a: np.mean(np.asarray(a), axis=0), state.params)
    assert rel_err(pipe.params(state), mean) < 1e-6
    pipe0, state0, *_ = run(N=4, D=2, M=2, opt="adam", steps=3, alpha=0.0)
    p0 = pipe.model.params  # alpha changes the update by >= 100x the equality tolerance
    assert rel_err(change(pipe0.params(state0), p0), change(pipe.params(state), p0)) > RULE_MARGIN
    # the replicas were trained on different batches: they differ, and alpha > 0 pulls them together
    spread = lambda st: max(float(np.max(np.std(np.asarray(a), axis=0))) for a in jax.tree.leaves(st.params))
    assert spread(state) > 0 and spread(state) < spread(state0)


def test_one_pipe_is_plain_training():
    """N = 1: elastic averaging is the identity; AvgPipe is 1F1B with the user's optimizer."""
    pipe, state, batches, losses, model = run(N=1, D=4, M=4, opt="adam")
    plain = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=4, optimizer=OPTS["adam"](), mesh=jp.make_mesh(stages=4)
    )
    ps = plain.init()
    for b in batches:
        ps, _ = plain.step(ps, b)
    assert rel_err(pipe.params(state), plain.params(ps)) < 1e-6


def test_advance_changes_speed_and_memory_never_numbers():
    outs = [run(N=2, D=4, M=4, advance=a)[1:4:2] for a in (0, 3)]
    (s0, l0), (s3, l3) = outs
    assert np.array_equal(l0, l3)
    for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s3.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_bubbles_do_not_leak():
    _, state, _, losses, _ = run(N=2, D=4, M=3, advance=1, nan_bubbles=True)
    assert np.all(np.isfinite(losses))
    assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree.leaves(state.params))


# ---------------------------------------------------------------------- schedule (Algorithm 1's knob)
def test_advance_degenerates_to_1f1b_and_afab():
    for D, M in [(4, 8), (4, 3), (2, 5)]:
        assert schedules.build("avgpipe", D, M, advance=0).actions == schedules.build("1f1b", D, M).actions
        afab = schedules.build("avgpipe", D, M, advance=M - 1).actions
        assert [[(a.kind, a.mb) for a in r] for r in afab] == [
            [(a.kind, a.mb) for a in r] for r in schedules.build("gpipe", D, M).actions
        ]


def test_advance_trades_memory_for_overlap():
    """Fig. 7: with communication costs, forwards in advance shorten the step; each costs one more
    micro-batch's activations upstream (device d holds min(D - d + advance, M))."""
    D, M = 4, 8
    spans = []
    for a in range(M):
        s = schedules.build("avgpipe", D, M, advance=a)
        assert s.simulate().peak_inflight == [min(D - d + a, M) for d in range(D)]
        spans.append(max(s.place(1.0, 2.0, 1.0, comm=0.5)["finish"].values()))
    assert all(x >= y for x, y in zip(spans, spans[1:])) and spans[-1] < spans[0]


def test_auto_advance_follows_algorithm_1():
    pipe, state, *_ = run(N=2, D=2, M=4, steps=8)
    r = pipe._runner
    assert r.settled and r.log
    assert all("verdict" in e and e["seconds"] > 0 for e in r.log)
    # Algorithm 1: advances tried in order from 0, each kept only while it is faster by the tolerance; the
    # choice is the last faster one (what a "not faster" verdict falls back to) or the last tried
    assert [e["advance"] for e in r.log] == list(range(len(r.log)))
    faster = [e for e in r.log if e["verdict"].startswith("faster")]
    assert all(b["seconds"] <= a["seconds"] * (1 - r.tolerance) for a, b in zip(faster, faster[1:]))
    if r.log[-1]["verdict"].startswith("not faster"):
        assert r.advance == r.log[-2]["advance"] and r.log[-1]["seconds"] > r.log[-2]["seconds"] * (
            1 - r.tolerance
        )
    else:
        assert r.advance == r.log[-1]["advance"]
    # a memory limit no program meets keeps 1F1B
    pipe, state, *_ = run(N=2, D=2, M=4, steps=3, memory_limit=1)
    assert (
        pipe._runner.settled
        and pipe._runner.advance == 0
        and "memory_limit" in pipe._runner.log[-1]["verdict"]
    )


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": "half"}, "alpha"),
        ({"advance": -1}, "advance"),
        ({"advance": "fast"}, "advance"),
        ({"memory_limit": 0}, "memory_limit"),
        ({"beta": 1}, "unknown"),
    ],
)
def test_bad_options(opts, match):
    model, _ = small_model("mlp", 2)
    with pytest.raises(jp.ConfigError, match=match):
        jp.Pipeline(
            model,
            schedule="avgpipe",
            num_microbatches=2,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(pipes=2, stages=2),
            options=opts,
        )


def test_misuse_errors():
    model, batch_fn = small_model("mlp", 2)
    with pytest.raises(jp.ConfigError, match="unknown option.*alpha"):
        jp.Pipeline(
            model, schedule="1f1b", num_microbatches=2, mesh=jp.make_mesh(stages=2), options={"alpha": 0.5}
        )
    with pytest.raises(jp.ConfigError, match="optimizer"):
        jp.Pipeline(model, schedule="avgpipe", num_microbatches=2, mesh=jp.make_mesh(pipes=2, stages=2))
    pipe = jp.Pipeline(
        model,
        schedule="avgpipe",
        num_microbatches=2,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(pipes=2, stages=2),
    )
    with pytest.raises(jp.ConfigError, match="pipe_losses"):
        pipe.loss_and_grad(pipe.init(), batch_fn(8))


# ---------------------------------------------------------------------- §5.2 tuner (pure Python)
def test_tuner_equations_by_hand():
    from jaxpipe.tune.avgpipe_model import AvgPipeProfile, choose, predict

    p = AvgPipeProfile(
        m=4,
        n=1,
        t_gpu=[8.0, 8.0],
        phi=[0.5, 0.5],
        t_comm=[1.0, 1.0],
        f_mod=[100.0, 100.0],
        f_dat=[40.0, 20.0],
    )
    same = predict(p, 4, 1)
    # (2) r = 1, no overuse; (4) 1/4 + 3/4 max(1 - 8, 0); (6)/(7) (1 + 8)/4 for the neighbour
    assert same.parts["t_gpu"] == [8.0, 8.0] and same.parts["t_com"] == [0.25, 0.25]
    assert same.parts["t_up"] == [0.0, 2.25] and same.parts["t_down"] == [2.25, 0.0]
    assert same.per_batch == 8.0 + 0.25 + 2.25 and same.memory == 140.0
    # twice the pipelines at the same M: utilisation 1.0, per-batch compute halves (eq. 2), the shared
    # link carries twice the bytes (eq. 4's n*/n), memory doubles (eq. 8, co-located)
    two = predict(p, 4, 2)
    assert two.parts["t_gpu"] == [4.0, 4.0] and two.memory == 280.0
    assert two.parts["t_com"][0] == 2.0 / 4
    # eight pipelines overuse the device (phi* = 4): 1/8 (8 + 8 * 3) = 4 per batch -- no faster than N = 2
    assert predict(p, 4, 8).parts["t_gpu"] == [4.0, 4.0]
    # twice the micro-batches at N = 1: intensity halves, compute per batch doubles; activations halve
    m8 = predict(p, 8, 1)
    assert m8.parts["t_gpu"] == [16.0, 16.0] and m8.memory == 100.0 + 20.0
    best, preds = choose(p, [(4, 1), (4, 2), (4, 8)], memory_limit=300.0, batch_per_pipe=1)
    assert best.n == 2 and len(preds) == 3
    best, _ = choose(p, [(4, 1), (4, 2)], memory_limit=150.0)
    assert best.n == 1


def test_tuner_on_separate_devices():
    from jaxpipe.tune.avgpipe_model import AvgPipeProfile, calibrate_tick_overhead, predict

    p = AvgPipeProfile(
        m=4,
        n=1,
        t_gpu=[8.0, 8.0],
        phi=[0.5, 0.5],
        t_comm=[0.0, 0.0],
        f_mod=[100.0, 100.0],
        f_dat=[40.0, 20.0],
        shared_compute=False,
        shared_memory=False,
    )
    # pipelines on their own devices: a step of N pipelines takes one batch's time; memory stays per replica
    assert predict(p, 4, 4).step == predict(p, 4, 1).step and predict(p, 4, 4).memory == 140.0
    c = calibrate_tick_overhead(p, measured_step=predict(p, 4, 1).step + 10 * 0.5)  # 10 ticks at M=4, K=2
    assert abs(c - 0.5) < 1e-12


# ---------------------------------------------------------------------- the paper's setting: shared devices
def run_shared(kind="mlp", N=2, D=2, M=2, opt="adam", steps=3, nan_bubbles=False, advance=0):
    model, batch_fn = small_model(kind, D)
    pipe = jp.Pipeline(
        model,
        schedule="avgpipe",
        num_microbatches=M,
        optimizer=OPTS[opt](),
        mesh=jp.make_mesh(stages=D),
        nan_bubbles=nan_bubbles,
        options={"shared": N, "advance": advance},
    )
    state = pipe.init()
    batches = [batch_fn(N * M * 2, s=k) for k in range(steps)]
    losses = []
    for b in batches:
        state, m = pipe.step(state, b)
        losses.append(float(m["loss"]))
    return pipe, state, batches, np.array(losses), model


@pytest.mark.parametrize(
    "kind,N,D,M,opt,advance",
    [("mlp", 2, 2, 2, "adam", 0), ("mlp", 3, 4, 4, "momentum", 1), ("gpt", 2, 2, 2, "sgd", 0)],
)
def test_shared_devices_match_serial_reference(kind, N, D, M, opt, advance):
    """AvgPipe §3.2 in the paper's setting: N pipelines on the SAME D devices (each device holds its stage of
    every replica), equal to the serial reference (and so to the pipe-axis form on N x D devices): every
    replica, the reference model and the mean loss; NaN-filled bubbles change nothing."""
    for nan in (False, True):
        pipe, state, batches, losses, model = run_shared(kind, N, D, M, opt, nan_bubbles=nan, advance=advance)
        ref = avgpipe_reference(model, OPTS[opt](), N, M, batches)
        assert np.allclose(losses, np.mean(np.array(ref["losses"]), axis=1), rtol=1e-5)
        assert rel_err(pipe.params(state), ref["params"]) < 1e-5
        assert rel_err(state.params, jax.tree.map(lambda *a: np.stack(a), *ref["replicas"])) < 1e-5
        # every replica of a stage lives on that stage's device
        w = jax.tree.leaves(state.params[0])[0]
        assert w.shape[:2] == (N, D) and w.sharding.spec[:2] == (None, "stage")


def test_shared_devices_bad_configuration():
    model, batch_fn = small_model("mlp", 2)
    with pytest.raises(jp.ConfigError, match="pipes=2"):
        jp.Pipeline(
            model,
            schedule="avgpipe",
            num_microbatches=2,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(pipes=2, stages=2),
            options={"shared": 2},
        ).init()
    with pytest.raises(jp.ConfigError, match=r"options\['shared'\]=0 \(int\); it must be an integer >= 1"):
        jp.Pipeline(
            model,
            schedule="avgpipe",
            num_microbatches=2,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=2),
            options={"shared": 0},
        ).init()
    gpt = jp.models.gpt(2, vocab=32, d_model=16, heads=2, seq_len=8, dropout=0.1)
    with pytest.raises(jp.ConfigError, match="stage context"):
        jp.Pipeline(
            gpt,
            schedule="avgpipe",
            num_microbatches=2,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=2),
            options={"shared": 2},
        ).init()
