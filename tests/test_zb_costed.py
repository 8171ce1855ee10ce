"""Issue #49: ZB-H1 placed for measured op costs (``jaxpipe.schedules.zb_costed``).  Where W costs more than F
(the two-process testbed: f, b, w = 10, 10, 16 ms) the unit-time order is predicted slower than 1F1B at
D = 2, M = 8; the cost-aware ticks reach the lockstep optimum (found exhaustively: 160 at M = 4, 304 at M = 8,
against 1F1B's 180 and 324) at 1F1B's memory, and the pipeline running them is exact."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.schedules import build
from jaxpipe.schedules.lanes import fastest_placement
from helpers import reference, rel_err, small_model

TESTBED = (10.0, 10.0, 16.0)


@pytest.mark.parametrize("M,best", [(4, 160.0), (8, 304.0)])
def test_the_costed_ticks_reach_the_lockstep_optimum_at_1f1b_memory(M, best):
    s = build("zb_h1", 2, M, costs=TESTBED)
    plan = s.plan("ordered")
    assert plan.lockstep_makespan(*TESTBED) == best
    unit = build("zb_h1", 2, M).plan("ordered").lockstep_makespan(*TESTBED)
    lanes_1f1b = build("1f1b", 2, M).plan("lanes").lockstep_makespan(10.0, 26.0, 0.0)
    assert best < min(unit, lanes_1f1b)
    assert plan.stash_capacity == 2 and max(plan.peak_inflight()) <= 2  # D: 1F1B's memory
    assert fastest_placement(s, TESTBED) == "ordered"
    # at unit costs the search finds the paper's bubble, (D - 1)(f + b - w) over the busy work
    assert build("zb_h1", 2, M, costs=(1, 1, 1)).plan("ordered").lockstep_makespan(1, 1, 1) == 3 * M + 1


def test_four_stages_at_unit_costs_reach_the_papers_bubble():
    s = build("zb_h1", 4, 8, costs=(1, 1, 1))
    assert s.plan("ordered").lockstep_makespan(1, 1, 1) == 27.0  # 24 + (D - 1)(f + b - w); unit order 29
    assert build("zb_h1", 4, 8).plan("ordered").lockstep_makespan(1, 1, 1) == 29.0


@pytest.mark.parametrize("M,best,unit", [(4, 304.0, 340.0), (8, 592.0, 676.0)])
def test_zb_v_on_costed_ticks_keeps_its_memory_and_beats_its_unit_order(M, best, unit):
    """ZB-V at chunk costs (10, 10, 16): 0.84x / 0.91x 1F1B's lockstep step (whole stages: 360 / 648)."""
    s = build("zb_v", 2, M, costs=TESTBED)
    plan = s.plan("ordered")
    assert plan.lockstep_makespan(*TESTBED) == best
    assert build("zb_v", 2, M).plan("ordered").lockstep_makespan(*TESTBED) == unit
    assert plan.stash_capacity == 4  # 2D chunk activations: D whole stages, as the unit-time ZB-V
    assert [a.chunk for a in s.actions[0] if a.stage == 3][:1] == [1]  # stage 2D - 1 is device 0's chunk 1


@pytest.mark.parametrize(
    "kind,D,M,schedule", [("mlp", 2, 4, "zb_h1"), ("gpt", 4, 6, "zb_h1"), ("gpt", 2, 4, "zb_v")]
)
def test_a_pipeline_on_the_costed_ticks_equals_jax_grad(kind, D, M, schedule):
    model, batch_fn = small_model(kind, D * (2 if schedule == "zb_v" else 1))
    batch = batch_fn(2 * M)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=D),
        op_costs=TESTBED,
        nan_bubbles=True,
    )
    assert pipe.placement == "ordered" and pipe.options["costs"] == TESTBED
    assert pipe.schedule.fixed_ticks, "the pipeline did not run the costed ticks"
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5 and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_bad_costs_say_what_they_take():
    model, _ = small_model("mlp", 2)
    mk = lambda **k: jp.Pipeline(
        model, schedule="zb_h1", num_microbatches=4, mesh=jp.make_mesh(stages=2), **k
    )
    with pytest.raises(jp.ConfigError, match=r"costs=.*give \(f, b, w\)"):
        mk(options={"costs": (1, 2)})
    with pytest.raises(jp.ConfigError, match="give it or max_deferred_w, not both"):
        mk(options={"costs": (1, 1, 1), "max_deferred_w": 1})


def test_an_exchange_cost_is_paid_per_tick_run():
    """The search prices ticks as the executor fuses them; with a tick's exchange as a fourth cost the
    placement ranking pays it per tick too (1F1B's lanes run half as many ticks)."""
    from jaxpipe.schedules.zb_costed import search

    cost, path = search(2, 4, TESTBED, exchange=3.0)
    plan = build("zb_h1", 2, 4, costs=TESTBED + (3.0,)).plan("ordered")
    assert cost == plan.lockstep_makespan(*TESTBED) + 3.0 * plan.num_ticks
    s = build("zb_h1", 2, 8)
    assert fastest_placement(s, TESTBED) == "lanes"
    assert fastest_placement(build("zb_h1", 2, 4), TESTBED) == "ordered"
    assert (
        fastest_placement(build("zb_h1", 2, 4), TESTBED + (30.0,)) == "lanes"
    )  # a dear exchange: fewer ticks
