"""Cyclic Data Parallelism, multi-device DP form (Fournier & Oyallon §3.2, §4): N workers on 'data', two time
steps apart, ring reductions by ppermute; equal to the serial references of eqs. CDP-v1 / CDP-v2; Table 1's
activation memory in the simulator and in XLA's memory analysis."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import rel_err, small_model, change, RULE_MARGIN
from experiments.one_device import single_device_dp_grad, single_device_grad
from jaxpipe.optim.reference import serial_reference
from jaxpipe.schedules import cyclic as cyc

OPTS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
}


def run(rule, N, opt="momentum", kind="mlp", steps=3, rows=2, **kw):
    """``(cdp, final state, batches, model, version errors)`` of ``steps`` steps and a drain.  One run per
    configuration in a process: several tests read the same run (each compile of a ring program is ~5 s
    here), so a test that steps on from the state steps a copy (``step`` donates it)."""
    kw = {"nan_bubbles": True, **kw}  # NaN mode unless a test says otherwise
    return _run(rule, N, opt, kind, steps, rows, tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=None)
def _run(rule, N, opt, kind, steps, rows, kw):
    model, batch_fn = small_model(kind, N)
    cdp = jp.CyclicDataParallel(model, OPTS[opt](), rule=rule, mesh=jp.make_mesh(data=N), **dict(kw))
    state = cdp.init()
    batches = [batch_fn(N * rows, s=k) for k in range(steps)]
    losses = []
    for b in batches:
        state, m = cdp.step(state, b)
        losses.append(float(m["loss"]))
    state, m = cdp.drain(state)
    return cdp, state, batches, model, int(m["version_errors"])


@pytest.mark.parametrize(
    "rule,N,opt",
    [("v1", 2, "sgd"), ("v1", 4, "momentum"), ("v2", 2, "adamw"), ("v2", 4, "momentum"), ("v2", 4, "adamw")],
)
def test_matches_serial_reference(rule, N, opt):
    cdp, state, batches, model, errors = run(rule, N, opt)
    ref = serial_reference(model, f"cdp_{rule}", OPTS[opt](), N, batches)
    assert errors == 0
    assert rel_err(cdp.params(state), ref["params"]) <= 1e-5
    assert rel_err(change(cdp.params(state), model.params), change(ref["params"], model.params)) <= 1e-5
    # every worker applied the same updates to its replica: bit-identical
    reps = [jax.tree.map(lambda a: np.asarray(a[i]), state.params) for i in range(N)]
    for r in reps[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(reps[0])))


@pytest.mark.parametrize("N,rule", [(3, "v1"), (4, "v2")])
def test_balanced_broadcast_equals_direct(N, rule):
    """The updated stage scattered in N - 1 chunks and all-gathered among the receivers (no worker sends
    more than one stage per update) lands exactly what the direct sends land: bit-identical parameters."""
    a = run(rule, N, "adamw")
    b = run(rule, N, "adamw", broadcast="balanced")
    assert a[4] == 0 and b[4] == 0
    for x, y in zip(jax.tree.leaves(a[1].params), jax.tree.leaves(b[1].params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_balanced_broadcast_sends_at_most_one_copy_per_worker():
    """balanced_broadcast delivers worker N-1's pytree to every other worker, and in the compiled program no
    worker sends more elements than the pytree holds (rounded up to N-1 chunks); the direct sends would
    make worker N-1 send N-1 copies."""
    import re
    from jax.sharding import PartitionSpec as P
    from jaxpipe.cyclic import balanced_broadcast

    N, n = 4, 17
    mesh = jp.make_mesh(data=N)
    x = {
        "a": jnp.arange(N * 10, dtype=jnp.float32).reshape(N, 10),
        "b": -jnp.arange(N * 7, dtype=jnp.float32).reshape(N, 7),
    }
    f = jax.jit(
        jax.shard_map(
            lambda t: jax.tree.map(
                lambda a: a[None],
                balanced_broadcast(jax.tree.map(lambda a: a[0], t), N, jax.lax.axis_index("data"), "data"),
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
            check_vma=False,
        )
    )
    out = f(x)
    for w in range(N - 1):
        for k in x:
            assert np.array_equal(np.asarray(out[k][w]), np.asarray(x[k][N - 1]))
    sent = {}
    for line in f.lower(x).compile().as_text().splitlines():
        if "collective-permute(" not in line and "collective-permute-start(" not in line:
            continue
        elems = int(
            np.prod(
                [int(d) for d in re.search(r"\[([0-9,]*)\]", line.split("=")[1]).group(1).split(",") if d]
            )
        )
        for src, _ in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1]):
            sent[int(src)] = sent.get(int(src), 0) + elems
    chunk = -(-n // (N - 1))
    assert sent and max(sent.values()) <= chunk * (N - 1), sent


@pytest.mark.parametrize("rule", ["v1", "v2"])
def test_nan_bubbles_do_not_leak(rule):
    """Every in-flight buffer starts NaN (idle backward lanes resend the ring's message buffer, NaN at first):
    the result still equals the serial reference, every replica stays finite and the losses are finite."""
    opt = {"v1": "momentum", "v2": "adamw"}[rule]  # (configurations other tests run: compiled once)
    cdp, state, batches, model, errors = run(rule, 4, opt, nan_bubbles=True)
    assert cdp.nan_bubbles and errors == 0
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(state.params))
    ref = serial_reference(model, f"cdp_{rule}", OPTS[opt](), 4, batches)
    assert rel_err(cdp.params(state), ref["params"]) <= 1e-5
    carry = jax.tree.leaves(state.carry)
    assert any(np.isnan(np.asarray(a)).any() for a in carry if jnp.issubdtype(a.dtype, jnp.floating))


def test_gpt_matches_serial_reference():
    cdp, state, batches, model, errors = run("v2", 4, "momentum", kind="gpt", steps=2)
    ref = serial_reference(model, "cdp_v2", OPTS["momentum"](), 4, batches)
    assert errors == 0 and rel_err(cdp.params(state), ref["params"]) <= 1e-5


def test_v1_and_v2_differ_and_restart_after_drain():
    a = run("v1", 4)
    b = run("v2", 4)
    p0 = a[3].params  # the updates of the two rules differ by >= 100x the equality tolerance
    assert rel_err(change(a[0].params(a[1]), p0), change(b[0].params(b[1]), p0)) > RULE_MARGIN
    cdp, state = b[0], jax.tree.map(jnp.copy, b[1])  # (a copy: the shared run's state stays whole)
    state, m = cdp.step(state, b[2][0])  # the cycle restarts after a drain
    assert np.isfinite(float(m["loss"]))


def test_reduction_is_point_to_point():
    """The step has collective-permutes and no all-reduce of gradients: the only all-reduce is the final
    psum of the (loss sum, loss count) scalars."""
    cdp = run("v1", 4)[0]  # (a configuration other tests run: its program compiled once)
    _, batch_fn = small_model("mlp", 4)
    state = cdp.init()
    batch = jax.device_put(
        batch_fn(8), jax.sharding.NamedSharding(cdp.mesh, jax.sharding.PartitionSpec("data"))
    )
    state = state._replace(carry=cdp._empty_carry(batch)[0])
    hlo = cdp._program(batch).lower(state, batch, jnp.asarray(True)).compile().as_text()
    assert "collective-permute" in hlo
    sizes = []
    for line in hlo.splitlines():
        if " all-reduce(" in line or "all-reduce-start(" in line:
            sizes.append(line.split("=")[1].split("all-reduce")[0])
    assert all("[" not in s.replace("[]", "") for s in sizes), sizes  # scalars only


# ---------------------------------------------------------------------- Table 1, activation memory
@pytest.mark.parametrize("N", [2, 3, 4, 8])
def test_simulated_activation_profile(N):
    prof = cyc.activation_profile(N)
    assert set(prof) == {N * (N + 1) // 2}  # constant in time: (N + 1)/2 B Psi_A
    dp = cyc.activation_profile(N, cyclic=False)
    assert max(dp) == N * N and min(dp) < max(dp)  # DP peaks at N B Psi_A every 2N steps
    assert cyc.check_pool(N) == cyc.pool_size(N) == cyc.table1_units(N)["single_cyclic"]


@pytest.mark.parametrize("N", [2, 4])
def test_single_device_cyclic_memory_in_xla(N):
    from jaxpipe.bench import make_tanh_mlp

    model = make_tanh_mlp(N, 1, 32)
    K, B = 2, 256
    r = np.random.default_rng(0)
    mbs = {
        "x": jnp.asarray(r.normal(size=(K, N, B, 32)), jnp.float32),
        "y": jnp.asarray(r.normal(size=(K, N, B, 32)), jnp.float32),
    }
    fns = {
        "cyclic": jax.jit(single_device_grad(model, N)),
        "sync": jax.jit(single_device_grad(model, N, False)),
        "dp": jax.jit(single_device_dp_grad(model, N)),
    }
    out = {k: f(model.params, mbs) for k, f in fns.items()}
    for k in ("cyclic", "sync"):
        assert abs(float(out[k][0]) - float(out["dp"][0])) <= 1e-5 * abs(float(out["dp"][0]))
        assert rel_err(out[k][1], out["dp"][1]) <= 1e-5
    temp = {k: fns[k].lower(model.params, mbs).compile().memory_analysis().temp_size_in_bytes for k in fns}
    from jaxpipe.runtime.residuals import residual_mask

    w0 = jax.tree.map(lambda a: a[0], model.stage_params)
    _, res = residual_mask(model.stage_fn, w0, jnp.zeros((B, 32), jnp.float32))
    slot = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in res)
    saved = (N * N - N * (N + 1) // 2) * slot  # the pool: N^2 slots in DP order, N(N+1)/2 cyclic
    assert abs((temp["sync"] - temp["cyclic"]) - saved) <= 0.1 * saved, (temp, saved)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"rule": "v3"}, "rule"),
        ({"mesh": "stage"}, "data"),
        ({"stages": 3}, "stages"),
        ({"optimizer": None}, "optimizer"),
    ],
)
def test_bad_configuration(kw, match):
    model, _ = small_model("mlp", kw.pop("stages", 2))
    mesh = jp.make_mesh(stages=2) if kw.pop("mesh", None) == "stage" else jp.make_mesh(data=2)
    opt = kw.pop("optimizer", optax.sgd(0.1))
    with pytest.raises(jp.ConfigError, match=match):
        jp.CyclicDataParallel(model, opt, mesh=mesh, **kw)


def test_bad_batch():
    model, batch_fn = small_model("mlp", 2)
    cdp = jp.CyclicDataParallel(model, optax.sgd(0.1), mesh=jp.make_mesh(data=2))
    with pytest.raises(jp.ConfigError, match="divisible"):
        cdp.step(cdp.init(), batch_fn(3))


@pytest.mark.parametrize("N", [1, 2, 3, 4, 8])
def test_stream_is_the_pictured_timeline(N):
    """What the no-flush executor runs (schedules.cyclic.stream: every stage a chunk of the worker, worker i
    2i ticks late) replays the timeline the pictures draw (op_of) tick for tick for every worker, and the
    ticks where the ring may complete a sum are where worker N-1 runs a backward."""
    from jaxpipe.runtime.landing import ring_phases

    p = cyc.stream(N)
    for i in range(N):
        ran = {t + p.replica_delay * i: (kind, c, g) for t, d, kind, c, g in p.events(1, calls=4)}
        for t in range(8 * N):
            kind, j, k = cyc.op_of(N, i, t)
            assert ran.get(t) == ((kind, j, k) if kind else None)
    updates = [s for s in range(2 * N) if cyc.op_of(N, N - 1, 4 * N + s)[0] == "B"]
    assert [s for s, (_, upd) in enumerate(ring_phases(p, 1, N)) if upd] == updates


def test_no_weight_sized_copy_in_the_step():
    """The ring reduction lands a stage by dynamic-update-slice into the worker's stacked stages: the compiled
    step copies no stage-weight-sized array (a version swap of per-chunk buffers inside conditionals made XLA
    copy the weights in every tick -- BUILD_NOTES, "The executor")."""
    import re
    from jaxpipe.bench import make_tanh_mlp

    model = make_tanh_mlp(4, 2, 48)
    cdp = jp.CyclicDataParallel(model, optax.adamw(1e-3), rule="v2", mesh=jp.make_mesh(data=4))
    batch = {"x": jnp.zeros((8, 48), jnp.float32), "y": jnp.zeros((8, 48), jnp.float32)}
    b = jax.device_put(batch, jax.sharding.NamedSharding(cdp.mesh, jax.sharding.PartitionSpec("data")))
    state = cdp.prepare(cdp.init(), batch)
    hlo = cdp._program(b).lower(state, b, jnp.asarray(True)).compile().as_text()
    weight = {tuple(a.shape[1:]) for a in jax.tree.leaves(model.stage_params)}  # one stage's leaves
    copies, comp = [], None
    for line in hlo.splitlines():  # copies inside the ticks' computations (not the call's entry)
        if line.endswith("{") and " -> " in line:
            comp = line.split(" ")[0]
        m = re.search(r"= \w+\[([0-9,]*)\]\{[^}]*\} copy\(", line)
        if m and comp != "ENTRY":
            copies.append(tuple(int(d) for d in m.group(1).split(",") if d))
    assert copies, "expected some copies (scalars, activations) in the ticks"
    assert not [c for c in copies if c in weight or c[1:] in weight], [
        c for c in copies if c in weight or c[1:] in weight
    ]
