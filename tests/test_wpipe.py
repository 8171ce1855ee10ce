"""WPipe / 2GW (Yang et al., §3.2-3.3): the cross-spliced timeline (zero bubble, Table 1) and the no-flush
executor equal to the serial reference of eq. (1): G0 one delay (two versions), G1 data-parallel."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import rel_err, small_model, change, RULE_MARGIN
from jaxpipe import schedules
from jaxpipe.optim.reference import serial_reference
from jaxpipe.schedules import wpipe as wp

OPTS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
}


def run(D, M, opt="momentum", kind="mlp", data=1, steps=3, nan_bubbles=True, method="wpipe"):
    model, batch_fn = small_model(kind, 2 * D)
    pipe = jp.Pipeline(
        model,
        schedule=method,
        num_microbatches=M,
        optimizer=OPTS[opt](),
        mesh=jp.make_mesh(stages=D, data=data),
        nan_bubbles=nan_bubbles,
    )
    state = pipe.init()
    batches = [batch_fn(M * data * 2, s=k) for k in range(steps)]
    for b in batches:
        state, m = pipe.step(state, b)
    state, m = pipe.drain(state)
    return pipe, state, batches, model, m


@pytest.mark.parametrize(
    "D,M,opt",
    [
        (1, 1, "sgd"),
        (2, 2, "sgd"),
        (2, 2, "momentum"),
        (2, 2, "adamw"),
        (2, 3, "momentum"),
        (4, 3, "adamw"),
        (4, 4, "momentum"),
        (4, 6, "sgd"),
    ],
)
def test_matches_serial_reference(D, M, opt):
    pipe, state, batches, model, m = run(D, M, opt)
    ref = serial_reference(model, "wpipe", OPTS[opt](), M, batches)
    assert int(m["version_errors"]) == 0
    assert rel_err(pipe.params(state), ref["params"]) <= 1e-5
    assert rel_err(change(pipe.params(state), model.params), change(ref["params"], model.params)) <= 1e-5


def test_gpt_and_data_parallel():
    pipe, state, batches, model, m = run(2, 2, "momentum", kind="gpt", steps=2)
    ref = serial_reference(model, "wpipe", OPTS["momentum"](), 2, batches)
    assert rel_err(pipe.params(state), ref["params"]) <= 1e-5
    assert rel_err(change(pipe.params(state), model.params), change(ref["params"], model.params)) <= 1e-5
    pipe, state, batches, model, m = run(2, 2, "momentum", data=2)
    ref = serial_reference(model, "wpipe", OPTS["momentum"](), 2, batches, data_parallel=2)
    assert rel_err(pipe.params(state), ref["params"]) <= 1e-5
    assert rel_err(change(pipe.params(state), model.params), change(ref["params"], model.params)) <= 1e-5


def test_bubbles_do_not_leak():
    pipe, state, batches, model, m = run(4, 4, "momentum", nan_bubbles=True)
    assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree.leaves(pipe.params(state)))
    ref = serial_reference(model, "wpipe", OPTS["momentum"](), 4, batches)
    assert rel_err(pipe.params(state), ref["params"]) <= 1e-5
    assert rel_err(change(pipe.params(state), model.params), change(ref["params"], model.params)) <= 1e-5


def test_eq1_semantics_differ_from_2bw_and_dp():
    """G1 reads fresh weights (no delay), G0 the previous version: neither 2BW (delay everywhere) nor DP."""
    model, batch_fn = small_model("mlp", 4)
    batches = [batch_fn(4, s=k) for k in range(3)]
    opt = OPTS["momentum"]
    ref = {m: serial_reference(model, m, opt(), 2, batches)["params"] for m in ("wpipe", "pipedream_2bw")}
    ref["dp"] = serial_reference(model, "pipedream_2bw", opt(), 2, batches[:1])["params"]
    assert (
        rel_err(change(ref["wpipe"], model.params), change(ref["pipedream_2bw"], model.params)) > RULE_MARGIN
    )
    # with one batch every method reads version 0 everywhere: WPipe = 2BW = one plain step
    one = serial_reference(model, "wpipe", opt(), 2, batches[:1])["params"]
    assert rel_err(one, ref["dp"]) <= 1e-6


# ---------------------------------------------------------------------- the timeline (Table 1)
@pytest.mark.parametrize("D,M", [(1, 1), (2, 2), (2, 5), (4, 3), (4, 4), (4, 8), (8, 7), (8, 16)])
def test_steady_state_has_no_bubble(D, M):
    ss = wp.steady_state(D, M)
    assert ss.bubble == 0.0 and ss.period == 4 * M
    assert ss.weight_buffer_partitions == 2 * D  # G0's two versions: S_m in Table 1's accounting
    if M >= D:
        # G0 holds a batch's micro-batches plus the skew of its V; G1 what 1F1B holds
        assert ss.g0_inflight == [M + D - d for d in range(D)]
        assert ss.g1_inflight == [D - d for d in range(D)]


def test_timeline_semantics_by_replay():
    """Replay the timeline: G1's forwards of batch p+1 come after its backwards of batch p on every
    device; G0's forwards of batch p+1 after its backwards of batch p-1 and before those of batch p."""
    for D, M in [(2, 2), (4, 3), (4, 5), (8, 7)]:
        T = 4 * M
        seen = {}
        for t in range(8 * T):
            for d in range(D):
                op = wp.op_at(t, d, D, M)
                if op is not None and op[2] >= 0:
                    seen[(d,) + op] = t
        for d in range(D):
            for p in range(1, 5):
                f1 = min(seen[(d, "F", 1, p, j)] for j in range(M))
                assert f1 > max(seen[(d, "B", 1, p - 1, j)] for j in range(M))
                f0 = [seen[(d, "F", 0, p + 1, j)] for j in range(M)]
                assert min(f0) > max(seen[(d, "B", 0, p - 1, j)] for j in range(M))
                assert max(f0) < max(seen[(d, "B", 0, p, j)] for j in range(M))


def test_ir_view_validates_and_draws():
    s = schedules.build("wpipe", 4, 4)
    assert s.num_model_stages == 8 and s.M == 4
    s.validate()
    text = wp.build_wpipe(4, 4, batches=3).validate().render_text()
    rows = [l for l in text.splitlines() if l.startswith("dev")]
    assert len(rows) == 4 and all("F" in r and "B" in r for r in rows)


def test_errors():
    model, _ = small_model("mlp", 8)
    with pytest.raises(jp.ConfigError, match="num_microbatches"):
        jp.Pipeline(
            model, schedule="wpipe", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=4)
        )
    with pytest.raises(jp.ConfigError, match="8 in all"):
        jp.Pipeline(
            small_model("mlp", 4)[0],
            schedule="wpipe",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=4),
        )
    with pytest.raises(jp.ConfigError, match="optimizer"):
        jp.Pipeline(model, schedule="wpipe", num_microbatches=4, mesh=jp.make_mesh(stages=4))


def test_recomputation_keeps_the_numbers_and_stashes_less():
    """WPipe-R: jax.checkpoint on each partition; same parameters, a smaller stash (only inputs)."""
    model, batch_fn = small_model("mlp", 4)
    batches = [batch_fn(4, s=k) for k in range(2)]
    stash, params = [], []
    for rc in (False, True):
        pipe = jp.Pipeline(
            model,
            schedule="wpipe",
            num_microbatches=2,
            optimizer=OPTS["momentum"](),
            mesh=jp.make_mesh(stages=2),
            options={"recompute": rc},
        )
        state = pipe.init()
        for b in batches:
            state, _ = pipe.step(state, b)
        stash.append(sum(a.nbytes for a in state.carry.stash))
        state, _ = pipe.drain(state)
        params.append(pipe.params(state))
    assert stash[1] < stash[0]
    assert rel_err(params[1], params[0]) <= 1e-6
    ref = serial_reference(model, "wpipe", OPTS["momentum"](), 2, batches)
    assert rel_err(params[1], ref["params"]) <= 1e-5
    with pytest.raises(jp.ConfigError, match="recompute"):
        jp.Pipeline(
            model,
            schedule="wpipe",
            num_microbatches=2,
            optimizer=OPTS["sgd"](),
            mesh=jp.make_mesh(stages=2),
            options={"recomp": True},
        )


def test_table1_comparison_names_each_difference():
    """The simulator's side-by-side with WPipe Table 1: the paper's figures and this timeline's, measured."""
    ss = wp.steady_state(4, 8)
    rows = {what: (paper, here) for what, paper, here in ss.table1()}
    assert rows["condition"][0] == "M >= N (N = D stages)" and rows["condition"][1].startswith("M >= D - 1")
    assert ss.g1_inflight == [4, 3, 2, 1] and "[8, 7, 6, 5]" in rows["G1 in flight on stage d"][0]
    assert ss.g0_inflight == [12, 11, 10, 9]
    assert (ss.activations_units, ss.table1_units) == (52.0, 58.0)
    assert (
        wp.steady_state(8, 8).activations_units > wp.steady_state(8, 8).table1_units
    )  # larger below M = D + 2


@pytest.mark.parametrize("D,M", [(1, 1), (2, 1), (4, 3), (4, 8)])
def test_stream_is_the_pictured_timeline(D, M):
    """What the executor runs (the no-flush 1F1B over WPipe's V units, two chunks per device: wp.stream)
    replays the timeline the pictures draw (op_at) tick for tick: every op with its chunk (group), batch and
    micro-batch, nothing where op_at has nothing yet."""
    p = wp.stream(D, M)
    calls = 4
    ran = {(t, d, kind): (c, g // M, g % M) for t, d, kind, c, g in p.events(M, calls=calls)}
    assert len(ran) == len(set(ran))
    for t in range(calls * 4 * M):
        for d in range(D):
            op = wp.op_at(t, d, D, M)
            if op is None or op[2] < 0:
                assert not any((t, d, k) in ran for k in ("F", "B"))
            else:
                assert ran[(t, d, op[0])] == (op[1], op[2], op[3])
    buf = p.buffers(M)
    assert buf["stash"][1] <= M and buf["stash"][0] <= 2 * M  # G1 1F1B-like, G0 a batch plus the V's skew


def test_apc_roundtrip_is_float16_exact_to_its_mantissa():
    """WPipe's automatic precision compression (appendix A.3): float16 payload with a power-of-2 scaler per
    leaf; values within 2^14 of the leaf's largest come back within 2^-11 relative; integer leaves and
    non-finite values pass as they are."""
    import jax.numpy as jnp
    from jaxpipe.runtime.apc import apc_pack, apc_unpack

    r = np.random.default_rng(0)
    for scale in (1e-6, 1.0, 1e6):
        x = {
            "a": jnp.asarray(r.standard_t(3, size=(32, 16)).astype(np.float32) * scale),
            "i": jnp.arange(4, dtype=jnp.int32),
        }
        packed = apc_pack(x)
        assert packed[0]["a"].dtype == jnp.float16 and packed[0]["i"].dtype == jnp.int32
        y = apc_unpack(packed, x)
        a, b = np.asarray(x["a"]), np.asarray(y["a"])
        normal = np.abs(a) > np.abs(a).max() * 2.0**-14
        assert b.dtype == np.float32 and np.all(np.abs(b - a)[normal] <= 2.0**-11 * np.abs(a)[normal])
        assert np.array_equal(np.asarray(y["i"]), np.arange(4))
    z = apc_unpack(apc_pack(jnp.asarray([1.0, jnp.inf, jnp.nan])), jnp.zeros(3))
    assert not np.isfinite(np.asarray(z)).all()


def test_apc_compresses_messages_and_stays_close():
    """options={"apc": True}: the step's messages travel as float16 (compiled collective-permutes), and the
    trained parameters stay within float16's precision of the exact run -- but are not equal to it."""
    import re
    import jax.numpy as jnp

    model, batch_fn = small_model("mlp", 8)
    out = {}
    for apc in (False, True):
        pipe = jp.Pipeline(
            model,
            schedule="wpipe",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=4),
            options={"apc": apc},
        )
        st = pipe.init()
        for k in range(3):
            st, m = pipe.step(st, batch_fn(8, s=k))
        fn = next(iter(pipe._runner._fns.values()))
        hlo = fn.lower(st, batch_fn(8, s=0), jnp.asarray(True)).compile().as_text()
        out[apc] = (
            pipe.params(pipe.drain(st)[0]),
            re.findall(r"= (\w+)\[[0-9,]+\][^=]*collective-permute\(", hlo),
        )
    assert "f16" in out[True][1] and "f16" not in out[False][1]
    change = lambda p: jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), p, model.params)
    err = rel_err(change(out[True][0]), change(out[False][0]))
    assert 1e-6 < err < 1e-2, err
