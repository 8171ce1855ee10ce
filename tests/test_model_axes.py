"""Model axes inside stages (tensor, FSDP): a stage's weights sharded over mesh axes the pipeline leaves to
XLA. Exact against jax.grad / the serial references with NaN bubbles on 8 emulated devices (stage x tensor x
data, stage x fsdp x tensor); the state's shards shrink by the model axes; clear errors for bad specs."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpipe as jp
from jaxpipe.optim.reference import avgpipe_reference, serial_reference
from helpers import reference, rel_err, small_model

# Megatron-style column / row split of the residual MLP's up / down projections
MLP_SPECS = (
    {
        "blocks": {
            0: {
                "up": {"kernel": P(None, "tensor"), "bias": P("tensor")},
                "down": {"kernel": P("tensor", None), "bias": None},
                "norm": None,
            }
        }
    },
    None,
    None,
)
FSDP_SPECS = (
    {
        "blocks": {
            0: {
                "up": {"kernel": P("fsdp", "tensor"), "bias": P("tensor")},
                "down": {"kernel": P("tensor", "fsdp"), "bias": None},
                "norm": None,
            }
        }
    },
    None,
    None,
)
TP = dict(stages=2, data=2, tensor=2)


def mlp(stages, specs=MLP_SPECS):
    model, batch_fn = small_model("mlp", stages)
    return dataclasses.replace(model, param_specs=specs), batch_fn


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "chimera", "zb_v"])
def test_sync_matches_jax_grad_tensor_data(schedule):
    model, batch_fn = mlp(4 if schedule in ("interleaved_1f1b", "zb_v") else 2)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        optimizer=optax.adam(1e-2),
        mesh=jp.make_mesh(**TP),
        nan_bubbles=True,
    )
    batch = batch_fn(16)
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_fsdp_and_tensor(kind):
    """stage x fsdp x tensor, the batch split over data and fsdp (FSDP: data parallelism, sharded weights);
    a step is the optimizer's update of jax.grad (parameter changes compared; SGD: Adam's first step divides
    by |g| and turns float rounding of near-zero gradients into sign flips) and keeps the shardings."""
    if kind == "mlp":
        model, batch_fn = mlp(2, FSDP_SPECS)
    else:
        model = jp.models.gpt(2, vocab=32, d_model=16, heads=2, seq_len=8, tensor="tensor", fsdp="fsdp")
        batch_fn = small_model("gpt", 2)[1]
    pipe = jp.Pipeline(
        model,
        schedule="1f1b",
        num_microbatches=2,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=2, fsdp=2, tensor=2),
        batch_axes=("data", "fsdp"),
        nan_bubbles=True,
    )
    batch = batch_fn(8)
    state = pipe.init()
    loss, grads = pipe.loss_and_grad(state, batch)
    ref_loss, ref_grads = reference(model, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5
    before = jax.tree.map(np.asarray, pipe.params(state))
    specs = jax.tree.map(lambda a: a.sharding.spec, state.params)
    state, _ = pipe.step(state, batch)
    u = jax.tree.map(lambda g: -0.1 * g, ref_grads)  # SGD: the change is linear in the gradient
    assert rel_err(jax.tree.map(lambda a, b: a - b, pipe.params(state), before), u) <= 1e-4
    assert jax.tree.map(lambda a: a.sharding.spec, state.params) == specs


def test_gpt_tensor_data():
    model = jp.models.gpt(2, vocab=32, d_model=16, heads=2, seq_len=8, tensor="tensor")
    batch = small_model("gpt", 2)[1](16)
    pipe = jp.Pipeline(model, schedule="1f1b", num_microbatches=4, mesh=jp.make_mesh(**TP), nan_bubbles=True)
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    assert rel_err(grads, reference(model, batch)[1]) <= 1e-5


@pytest.mark.parametrize(
    "method", ["pipedream", "pipedream_2bw", "pipeoptim", "spectrain", "cdp_v2", "wpipe"]
)
def test_no_flush_matches_serial_reference(method):
    """Parameter changes (not parameters) against the serial reference: the update itself is checked."""
    model, batch_fn = mlp(4 if method == "wpipe" else 2)
    opt = optax.sgd(0.05, momentum=0.9) if method == "spectrain" else optax.adam(1e-2)
    pipe = jp.Pipeline(
        model, schedule=method, num_microbatches=4, optimizer=opt, mesh=jp.make_mesh(**TP), nan_bubbles=True
    )
    state = pipe.init()
    batches = [batch_fn(16, s) for s in range(3)]
    for b in batches:
        state, m = pipe.step(state, b)
    state, _ = pipe.drain(state)
    ref = serial_reference(model, method, opt, 4, batches, data_parallel=2)
    delta = lambda p: jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), p, model.params)
    assert int(m["version_errors"]) == 0
    assert rel_err(delta(pipe.params(state)), delta(ref["params"])) <= 1e-4


def test_avgpipe_and_cyclic_dp():
    model, batch_fn = mlp(2)
    opt = optax.sgd(0.1)
    pipe = jp.Pipeline(
        model,
        schedule="avgpipe",
        num_microbatches=2,
        optimizer=opt,
        options={"advance": 0},
        mesh=jp.make_mesh(stages=2, pipes=2, tensor=2),
        nan_bubbles=True,
    )
    state = pipe.init()
    assert state.params[0]["blocks"][0]["up"]["kernel"].sharding.spec == P("pipe", "stage", None, "tensor")
    batches = [batch_fn(8, s) for s in range(2)]
    for b in batches:
        state, _ = pipe.step(state, b)
    assert rel_err(pipe.params(state), avgpipe_reference(model, opt, 2, 2, batches)["params"]) <= 1e-5
    cdp = jp.CyclicDataParallel(model, opt, rule="v2", mesh=jp.make_mesh(data=2, tensor=2))
    s = cdp.init()
    for b in batches:
        s, _ = cdp.step(s, b)
    s, _ = cdp.drain(s)
    ref = serial_reference(model, "cdp_v2", opt, 2, batches)
    assert rel_err(cdp.params(s), ref["params"]) <= 1e-5


def test_state_shards_shrink():
    """Per device, a sharded leaf's parameter and Adam moments hold 1 / (stages x tensor) of it."""
    model, _ = mlp(2)
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=2, optimizer=optax.adam(1e-2), mesh=jp.make_mesh(**TP)
    )
    state = pipe.init()
    for leaf in (
        state.params[0]["blocks"][0]["up"]["kernel"],
        state.opt_state[0].mu[0]["blocks"][0]["up"]["kernel"],
    ):
        shard = leaf.addressable_shards[0].data
        assert shard.size * 2 * 2 == leaf.size


def _up(spec):
    return ({"blocks": {0: {"up": {"kernel": spec, "bias": None}, "down": None, "norm": None}}}, None, None)


@pytest.mark.parametrize(
    "specs,mesh,match",
    [
        (_up(P(None, "model")), TP, "names axis 'model'"),
        (_up(P(None, "stage")), TP, "pipeline axis 'stage'"),
        (_up(P(None, None, "tensor")), TP, "3 entries for an array of shape"),
        (
            (MLP_SPECS[0], None, {"norm": None, "out": {"kernel": P(None, "tensor"), "bias": None}}),
            TP,
            "not divisible",
        ),
        (({"blocks": [P()]}, None, None), TP, "structure differs"),
        (None, TP, "shards nothing"),
        ("oops", TP, "triple"),
    ],
)
def test_bad_specs_are_refused(specs, mesh, match):
    model, _ = small_model("mlp", 2)
    with pytest.raises(jp.ConfigError, match=match):
        jp.Pipeline(
            dataclasses.replace(model, param_specs=specs), num_microbatches=2, mesh=jp.make_mesh(**mesh)
        )


def test_bad_batch_axes():
    model, _ = mlp(2)
    with pytest.raises(jp.ConfigError, match="batch_axes"):
        jp.Pipeline(model, num_microbatches=2, mesh=jp.make_mesh(**TP), batch_axes=("stage",))


def test_checkpoint_restores_onto_another_layout(tmp_path):
    """Saved with tensor = 2, restored with fsdp = 2 (same stage count): every array equal, laid out by the
    new model's specs; the restored run steps on."""

    def make(**mesh):
        names = {k: k for k in ("tensor", "fsdp") if mesh.get(k, 1) > 1}
        model = jp.models.gpt(2, vocab=32, d_model=16, heads=2, seq_len=8, **names)
        extra = {"batch_axes": ("data", "fsdp")} if "fsdp" in names else {}
        return jp.Pipeline(
            model,
            schedule="1f1b",
            num_microbatches=2,
            optimizer=optax.adam(1e-2),
            mesh=jp.make_mesh(**mesh),
            **extra,
        )

    batch_fn = small_model("gpt", 2)[1]
    a = make(stages=2, tensor=2)
    state = a.init()
    for i in range(2):
        state, _ = a.step(state, batch_fn(8, i))
    ck = jp.Checkpointer(str(tmp_path), a, writer=True)
    ck.save(2, state, {"data": {}})
    ck.close()
    b = make(stages=2, fsdp=2)
    restored, _, step = jp.Checkpointer(str(tmp_path), b).restore_latest(b.init(), report=lambda *_: None)
    assert step == 2
    assert rel_err(b.params(restored), a.params(state)) == 0.0
    assert (
        rel_err(jax.tree.map(np.asarray, restored.opt_state), jax.tree.map(np.asarray, state.opt_state))
        == 0.0
    )
    assert restored.params[0]["blocks"][0]["up"]["kernel"].sharding.spec == P("stage", "fsdp", None)
    _, m_a = a.step(state, batch_fn(8, 5))
    _, m_b = b.step(restored, batch_fn(8, 5))
    assert abs(float(m_a["loss"]) - float(m_b["loss"])) <= 1e-5 * abs(float(m_a["loss"]))


def _nnx_pieces():
    from flax import nnx

    part = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(8, 16, kernel_init=part("embed", "mlp"), rngs=rngs)
            self.down = nnx.Linear(16, 8, kernel_init=part("mlp", "embed"), rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.tanh(self.up(x)))

    with nnx.use_eager_sharding(False):
        rngs = nnx.Rngs(0)
        return [Block(rngs) for _ in range(4)], nnx.Linear(6, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)


def _xent(logits, b):
    return -jax.numpy.mean(jax.numpy.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1))


def _toy_batch(n):
    r = np.random.default_rng(0)
    return {"x": r.normal(size=(n, 6)).astype(np.float32), "y": r.integers(0, 3, n).astype(np.int32)}


def test_nnx_partitioning_metadata_becomes_param_specs():
    blocks, embed, head = _nnx_pieces()
    model, _ = jp.models.from_nnx(
        blocks, embed, head, _xent, num_stages=2, rules=[("embed", None), ("mlp", "tensor")]
    )
    assert model.param_specs[0]["up"]["kernel"] == P(None, None, "tensor")  # (block, embed, mlp)
    assert model.param_specs[0]["down"]["kernel"] == P(None, "tensor", None)
    pipe = jp.Pipeline(model, num_microbatches=2, mesh=jp.make_mesh(**TP), nan_bubbles=True)
    batch = _toy_batch(8)
    state = pipe.init()
    assert state.params[0]["up"]["kernel"].sharding.spec == P("stage", None, None, "tensor")
    _, grads = pipe.loss_and_grad(state, batch)
    assert rel_err(grads, reference(model, batch)[1]) <= 1e-5


def test_linen_logical_partitioning_becomes_param_specs():
    import flax.linen as nn

    init = lambda *names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jax.nn.tanh(nn.Dense(16, kernel_init=init("embed", "mlp"), name="up")(x))
            return x + nn.Dense(8, kernel_init=init("mlp", "embed"), name="down")(h)

    x8, x6 = jax.numpy.ones((1, 8)), jax.numpy.ones((1, 6))
    block_params = [Block().init(jax.random.key(i), x8)["params"] for i in range(4)]
    embed, head = nn.Dense(8), nn.Dense(3)
    model, _ = jp.models.from_linen(
        Block(),
        block_params,
        (embed, embed.init(jax.random.key(9), x6)["params"]),
        (head, head.init(jax.random.key(8), x8)["params"]),
        _xent,
        num_stages=2,
        rules=[("mlp", "tensor")],
    )
    assert model.param_specs[0]["up"]["kernel"] == P(None, None, "tensor")
    pipe = jp.Pipeline(model, num_microbatches=2, mesh=jp.make_mesh(**TP), nan_bubbles=True)
    batch = _toy_batch(8)
    _, grads = pipe.loss_and_grad(pipe.init(), batch)
    assert rel_err(grads, reference(model, batch)[1]) <= 1e-5


def test_resharding_inside_a_lane_is_refused_not_a_hang():
    """A column split of the GPT's fused q/k/v kernel cuts across heads: XLA reshards with collective-permutes
    inside the lanes' conditionals, which deadlock on XLA CPU; the first call says so instead of hanging."""
    from jaxpipe.models.gpt import megatron_specs

    model = jp.models.gpt(2, vocab=32, d_model=16, heads=2, seq_len=8, tensor="tensor")
    stage, pre, post = megatron_specs(model.stage_params, model.pre_params, model.post_params, "tensor")
    stage["blocks"][0]["attn"]["qkv"]["kernel"] = P(None, "tensor")
    model = dataclasses.replace(model, param_specs=(stage, pre, post))
    pipe = jp.Pipeline(model, schedule="gpipe", num_microbatches=2, mesh=jp.make_mesh(stages=2, tensor=2))
    with pytest.raises(jp.ConfigError, match="collective-permute"):
        pipe.loss_and_grad(pipe.init(), small_model("gpt", 2)[1](8))


def test_a_bad_device_batch_changes_nothing_on_a_model_axes_mesh():
    """On XLA CPU a conditional holding collectives is refused over model axes, so the update is gated by a
    select there (``step_checks.gate(by_select=True)``); a refused batch must still change nothing and say so
    (issue #50: a select keeping the new values survived every test)."""
    model, batch_fn = mlp(2)
    pipe = jp.Pipeline(
        model,
        schedule="1f1b",
        num_microbatches=2,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=2, tensor=2),
    )
    good = jax.tree.map(jax.numpy.asarray, batch_fn(8))
    state, _ = pipe.step(pipe.init(), good)
    before = jax.tree.map(np.asarray, state)
    state, _ = pipe.step(state, dict(good, y=good["y"].at[3].set(-1)))  # a finite loss: only the check
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, state)))
    )
    with pytest.raises(jp.ConfigError, match="'y'.*changed nothing"):
        pipe.check()
