"""V-shaped schedules (ZB-V, DualPipeV): added as data only (a builder and a registry entry), run by the one
executor.  Exact against jax.grad with NaN in every bubble; a step equals the optimizer's update on jax.grad;
the simulator's bubble and peak in-flight activations next to the published figures."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe import schedules
from jaxpipe.schedules.v_shape import dualpipe_v_order, v_stage
from helpers import reference, rel_err, small_model

# (kind, schedule, D, M, data)
CASES = [
    ("mlp", "zb_v", 2, 4, 1),
    ("mlp", "zb_v", 4, 8, 1),
    ("mlp", "zb_v", 4, 8, 2),
    ("mlp", "zb_v", 2, 3, 2),
    ("mlp", "dualpipe_v", 2, 4, 1),
    ("mlp", "dualpipe_v", 4, 8, 1),
    ("mlp", "dualpipe_v", 4, 10, 2),
    ("gpt", "zb_v", 4, 8, 1),
    ("gpt", "dualpipe_v", 2, 4, 2),
]


def _pipe(kind, schedule, D, M, data, **kw):
    model, batch_fn = small_model(kind, 2 * D)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=optax.adam(1e-2),
        mesh=jp.make_mesh(stages=D, data=data),
        **kw,
    )
    return model, pipe, batch_fn(2 * M * data)


@pytest.mark.parametrize("kind,schedule,D,M,data", CASES)
def test_matches_jax_grad_with_nan_bubbles(kind, schedule, D, M, data):
    model, pipe, batch = _pipe(kind, schedule, D, M, data, nan_bubbles=True)
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, batch)
    assert np.isfinite(float(loss))
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("schedule", ["zb_v", "dualpipe_v"])
def test_w_recomputed_matches_jax_grad(schedule):
    model, batch_fn = small_model("mlp", 4)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        options={"w_from": "recompute"},
        mesh=jp.make_mesh(stages=2),
        nan_bubbles=True,
    )
    batch = batch_fn(8)
    _, grads = pipe.loss_and_grad(pipe.init(), batch)
    assert rel_err(grads, reference(model, batch)[1]) <= 1e-5


@pytest.mark.parametrize("schedule", ["zb_v", "dualpipe_v"])
def test_step_is_the_optimizer_update_of_jax_grad(schedule):
    """Two steps: the parameter *changes* equal those of adam on jax.grad (not only the parameters)."""
    model, pipe, batch = _pipe("mlp", schedule, 2, 4, 1)
    state = pipe.init()
    opt = optax.adam(1e-2)
    p, o = model.params, opt.init(model.params)
    for _ in range(2):
        state, _ = pipe.step(state, batch)
        g = jax.grad(model.loss)(p, batch)
        u, o = opt.update(g, o, p)
        p = optax.apply_updates(p, u)
    delta = jax.tree.map(lambda a, b: a - b, pipe.params(state), model.params)
    ref_delta = jax.tree.map(lambda a, b: a - b, p, model.params)
    assert rel_err(delta, ref_delta) <= 1e-4


def test_v_placement():
    """Device d holds stage d (chunk 0) and 2D - 1 - d (chunk 1); the turn and the loss stay on a device."""
    s = schedules.build("zb_v", num_stages=4, num_microbatches=8)
    assert s.num_model_stages == 8
    soc = s.stage_of_chunk()
    assert (
        soc.tolist()
        == [[v_stage(d, 0, 4), v_stage(d, 1, 4)] for d in range(4)]
        == [[0, 7], [1, 6], [2, 5], [3, 4]]
    )


@pytest.mark.parametrize("schedule", ["zb_v", "dualpipe_v"])
@pytest.mark.parametrize("D,M", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_bubble_and_memory(schedule, D, M):
    """f = b = w per chunk: the event-driven makespan is the work (6M chunk ops) plus D - 1 ticks of fill (the
    last device starts D - 1 ticks late; the published (D-1)(F+B-2W) = 0 counts steady state only) -- against
    1F1B's 3(D - 1) whole-stage units; peak in-flight activations within ZB-V's 2D chunk sets (= 1F1B's D
    whole stages), DualPipeV's PP + 1 = 2D + 1."""
    s = schedules.build(schedule, num_stages=D, num_microbatches=M)
    r = s.simulate(f=1.0, b=2.0, w=1.0)
    assert r.makespan == 6 * M + D - 1
    one = schedules.build("1f1b", num_stages=D, num_microbatches=M).simulate(f=2.0, b=4.0)  # whole stages
    assert r.makespan < one.makespan
    cap = 2 * D if schedule == "zb_v" else 2 * D + 1
    assert max(r.peak_inflight) <= cap
    assert max(r.peak_inflight) >= 2 * D  # both chunks of the V fill
    assert r.lane_stash_capacity >= max(r.lane_peak_inflight)


def test_dualpipe_v_order_is_its_eight_steps():
    """Rank 0 of D = 2, M = 4 (dualpipev.py step() by hand): 2F0, then F0 F1, then B1 W F1, pairs F0 B1 F1 B0
    with whole backwards, ..., the last W's deferred."""
    acts = [str(a) for a in dualpipe_v_order(0, 2, 4)]
    # chunk 1 (stage 3) prints its stage; whole backwards put W right after B
    assert acts[:5] == ["F0", "F1", "F2", "F0s3", "B0s3"]
    assert sum(a.startswith("W") for a in acts) == 2 * 4 and sum(a.startswith("F") for a in acts) == 2 * 4
    for d in range(4):
        order = dualpipe_v_order(d, 4, 8)
        assert len(order) == 3 * 2 * 8


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(schedule="dualpipe_v", num_microbatches=3), "at least 2 x devices"),
        (dict(schedule="zb_v", num_microbatches=4, options={"w_from": "nope"}), "w_from"),
    ],
)
def test_clear_errors(bad, match):
    model, _ = small_model("mlp", 4)
    with pytest.raises(Exception, match=match):
        jp.Pipeline(model, mesh=jp.make_mesh(stages=2), **bad)


def test_model_with_wrong_stage_count_is_refused():
    model, _ = small_model("mlp", 2)
    with pytest.raises(Exception, match="stage"):
        jp.Pipeline(model, schedule="zb_v", num_microbatches=4, mesh=jp.make_mesh(stages=2))
