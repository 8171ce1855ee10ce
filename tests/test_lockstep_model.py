"""The lockstep step model (jaxpipe.tune.lockstep): what a lane plan costs on D devices and on one core."""

import pytest

import jaxpipe as jp
from jaxpipe.tune import LayerCosts, Link, calibrate_step, calibrate_tick, predict_devices, predict_one_core
from jaxpipe.tune.lockstep import fastest, layout_bytes, running_plan

UNIT = LayerCosts(f=1.0, b=2.0, b_input=1.0, w=1.0)
FREE = Link(0.0, 0.0)


def build(name, D=4, M=8):
    keys = jp.schedules.method(name).builder_keys
    return jp.schedules.build(name, D, M, **({"virtual": 2} if "virtual" in keys else {}))


def per_stage(s, layers=None):
    return (layers or s.num_model_stages) / s.num_model_stages


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "chimera", "zb_h1", "zb_v"])
def test_device_compute_is_the_plans_lockstep_makespan(name):
    s = build(name)
    lps = 4 / s.num_model_stages  # a 4-layer model: chunks of two-chunk schedules at half cost
    p = predict_devices(s, UNIT, lps, 0.0, FREE, 1.0, 1.0)
    plan = running_plan(s)  # the plan Pipeline runs (placement="auto")
    split = s.has_w()
    assert p["compute"] == pytest.approx(
        plan.lockstep_makespan(f=lps, b=(1.0 if split else 2.0) * lps, w=lps if split else 0.0)
    )
    assert p["busy"] <= p["compute"]


def test_fewer_bubbles_are_predicted_faster_as_the_simulator_says():
    # the figures at D = 4, M = 8, b = 2f, chunks at half cost: 1F1B 33, interleaved 28.5, Chimera 30
    got = {
        n: predict_devices(build(n), UNIT, 4 / build(n).num_model_stages, 0.0, FREE, 1.0, 1.0)["compute"]
        for n in ("1f1b", "interleaved_1f1b", "chimera")
    }
    assert got == {"1f1b": 33.0, "interleaved_1f1b": 28.5, "chimera": 30.0}
    order = fastest(got)
    assert [n for n, _, _ in order] == ["interleaved_1f1b", "chimera", "1f1b"]
    assert order[-1][2] == pytest.approx(33 / 28.5)


@pytest.mark.parametrize("name", ["gpipe", "interleaved_1f1b", "zb_h1", "chimera"])
def test_one_core_work_is_every_op_of_every_micro_batch(name):
    s = build(name, 4, 8)
    lps = 8 / s.num_model_stages
    p = predict_one_core(s, UNIT, lps, 0.0, FREE, 1.0, 1.0)
    per_mb = (UNIT.f + UNIT.b_input + UNIT.w) if s.has_w() else (UNIT.f + UNIT.b)
    assert p["work"] == pytest.approx(8 * 8 * per_mb)  # M micro-batches through 8 layers
    assert p["fixed"] == 0.0 and p["messages"] == 0.0


def test_fixed_cost_counts_the_compiled_lanes_of_every_phase():
    s = build("zb_h1")
    lane_ticks = sum((t1 - t0) * len(lanes) for t0, t1, lanes in running_plan(s).phases)
    p = predict_devices(s, UNIT, 1.0, 0.5, FREE, 1.0, 1.0)
    assert p["lane_ticks"] == lane_ticks and p["fixed"] == pytest.approx(0.5 * lane_ticks)
    core = predict_one_core(s, UNIT, 1.0, 0.5, FREE, 1.0, 1.0)
    assert core["fixed"] == pytest.approx(0.5 * lane_ticks * s.D)


def test_calibrate_tick_inverts_the_one_core_prediction():
    s = build("interleaved_1f1b")
    copy = Link(1e-5, 1e-9)
    measured = predict_one_core(s, UNIT, 0.5, 0.003, copy, 4096.0, 1e6)["step"]
    assert calibrate_tick(s, UNIT, 0.5, copy, 4096.0, 1e6, measured) == pytest.approx(0.003)
    assert calibrate_tick(s, UNIT, 0.5, copy, 4096.0, 1e6, 0.0) == 0.0  # clipped, never negative


def test_calibrate_step_recovers_a_steps_own_cost_and_the_ops_scale():
    """Runs of one schedule at two micro-batch counts, made from known costs (ops x 0.8, 30 ms a step, a
    link): the default calibration keeps the ops as given and puts the rest in the step's own cost; the fitted
    one recovers both, and its predictions of a third run then equal that run."""
    link = Link(1e-3, 1e-10)
    args = lambda M: (build("1f1b", 2, M), UNIT, 1.0, 0.0, link, 4096.0, 1e6)
    parts = [predict_devices(*args(M)) for M in (4, 8)]
    truth = [predict_devices(*args(M), scale=0.8, fixed=0.03)["step"] for M in (4, 8)]
    k, c = calibrate_step(parts, truth, fit_scale=True)
    assert k == pytest.approx(0.8) and c == pytest.approx(0.03)
    assert predict_devices(*args(16), scale=k, fixed=c)["step"] == pytest.approx(
        predict_devices(*args(16), scale=0.8, fixed=0.03)["step"]
    )
    k1, c1 = calibrate_step(parts, truth)
    assert k1 == 1.0 and c1 == pytest.approx(sum(t - p["step"] for t, p in zip(truth, parts)) / 2)
    assert calibrate_step(parts[:1], truth[:1], fit_scale=True) == (
        1.0,
        pytest.approx(truth[0] - parts[0]["step"]),
    )


def test_a_measured_link_table_is_interpolated_and_extended():
    link = Link(1.0, 0.0, table=((0.0, 1e-3), (4e6, 3e-3), (16e6, 13e-3)))
    assert link(2e6) == pytest.approx(2e-3) and link(16e6) == pytest.approx(13e-3)
    assert link(20e6) == pytest.approx(13e-3 + 4e6 * (10e-3 / 12e6))  # the last segment's slope
    assert Link(1e-3, 1e-9)(1e6) == pytest.approx(2e-3)  # no table: the line


def test_messages_and_layout():
    link = Link(1.0, 0.0)  # one second per message, whatever its size
    one, chim = build("1f1b"), build("chimera")
    # 1F1B: the F lane sends on one channel, the B lane on one, each where its phase compiles it
    ch = sum((t1 - t0) * len(lanes) for t0, t1, lanes in one.plan("lanes").phases)
    assert predict_devices(one, UNIT, 1.0, 0.0, link, 1.0, 1.0)["messages"] == ch
    # Chimera: both directions, every tick of the plan; its lanes share both channels (one message a device
    # and tick on each), so a tick's exchange is two ppermutes; the replica fetched and its gradient sent home
    plan = running_plan(chim)
    assert plan.shared == (1, 2)
    assert predict_devices(chim, UNIT, 1.0, 0.0, link, 1.0, 1.0)["messages"] == 2 * plan.num_ticks
    assert layout_bytes(chim, 100.0) == 200.0 and layout_bytes(one, 100.0) == 0.0
    assert layout_bytes(build("interleaved_1f1b"), 100.0) == 0.0
    assert predict_devices(chim, UNIT, 1.0, 0.0, link, 1.0, 1.0)["layout"] == 2.0


def test_layer_costs_measured_on_one_device():
    import jax
    import jax.numpy as jnp
    from jaxpipe.tune.microbench import layer_costs

    w = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 64)) / 8
    x = jnp.ones((16, 64))
    stage = lambda w, h: jax.lax.scan(lambda h_, wi: (jnp.tanh(h_ @ wi), None), h, w)[0]
    c = layer_costs(stage, w, x, 2, reps=2)
    assert c.f > 0 and c.b > 0 and c.b_input > 0 and c.w >= 0
    assert c.w == pytest.approx(max(c.b - c.b_input, 0.0))
    assert c.scaled(2.0).f == pytest.approx(2 * c.f)


@pytest.mark.parametrize(
    "D,M,want",
    [
        (
            4,
            8,
            {
                "1f1b": 33.0,
                "zb_h1": 29.0,
                "zb_v": 25.5,
                "dualpipe_v": 25.5,
                "interleaved_1f1b": 28.5,
                "gpipe": 33.0,
            },
        ),
        (8, 16, {"1f1b": 69.0, "zb_h1": 57.0, "zb_v": 51.5, "dualpipe_v": 51.5}),
    ],
)
def test_zero_bubble_schedules_are_predicted_at_their_bubble(D, M, want):
    """Issue #49: a tick ends in one exchange, so it costs its slowest device's own actions; the zero-bubble
    and V schedules then run their own one-action-per-tick order at the papers' bubble (units of one stage's
    forward; chunks of two-chunk schedules at half cost), and Pipeline's "auto" placement picks it."""
    from jaxpipe.schedules.lanes import fastest_placement, unit_costs

    for name, units in want.items():
        s = build(name, D, M)
        got = predict_devices(s, UNIT, D / s.num_model_stages, 0.0, FREE, 1.0, 1.0)["compute"]
        assert got == pytest.approx(units), name
        f, b, w = unit_costs(s)
        if name in ("zb_h1", "zb_v", "dualpipe_v"):
            assert fastest_placement(s) == "ordered"
            # the executor's plan costs what the simulator's one-op-per-tick lockstep costs
            assert s.plan("ordered").lockstep_makespan(f, b, w) == pytest.approx(
                s.simulate(f, b + w, w=w).lockstep_makespan
            )
            # at 1F1B's memory: D micro-batches of stage activations on stage 0 (chunks: 2D half stages)
            # (DualPipeV holds one half-stage more: its V runs a second micro-batch's forward on the way back)
            assert (
                s.plan("ordered").stash_capacity == {"zb_h1": D, "zb_v": 2 * D, "dualpipe_v": 2 * D + 1}[name]
            )
        if name in ("1f1b", "interleaved_1f1b"):
            assert fastest_placement(s) == "lanes"


def test_measured_costs_choose_the_placement():
    """Issue #49 item 2: where W costs more than F (the two-process testbed: f, b, w = 10, 10, 16 ms), ZB-H1's
    ordered plan at D = 2, M = 8 is predicted 1.05x 1F1B's lanes, its own lanes plan 1.00x: ``Pipeline(
    op_costs=...)`` ranks the plans at those costs (lanes for that order; at M = 4, 0.96x, and unit costs,
    ordered) -- and runs ZB-H1 on ticks searched for the costs, which beat both."""
    import jaxpipe as jp
    from jaxpipe.schedules.lanes import fastest_placement

    s8, s4 = build("zb_h1", 2, 8), build("zb_h1", 2, 4)
    assert s8.plan("ordered").lockstep_makespan(10, 10, 16) > s8.plan("lanes").lockstep_makespan(10, 10, 16)
    assert fastest_placement(s8, (10, 10, 16)) == "lanes" and fastest_placement(s8) == "ordered"
    assert fastest_placement(s4, (10, 10, 16)) == "ordered"
    assert fastest_placement(build("1f1b", 2, 8), (10, 10, 16)) == "lanes"  # unsplit: b + w in one backward
    model = jp.models.residual_mlp(2, in_dim=4, num_classes=2, width=4)
    mk = lambda **k: jp.Pipeline(
        model, schedule="zb_h1", num_microbatches=8, mesh=jp.make_mesh(stages=2), **k
    )
    # the pipeline given the costs runs ZB-H1's ticks searched for them (jaxpipe.schedules.zb_costed), ordered
    costed = mk(op_costs=(0.010, 0.010, 0.016))
    assert costed.placement == "ordered" and costed.schedule.fixed_ticks and mk().placement == "ordered"
    assert costed.schedule.plan("ordered").lockstep_makespan(10, 10, 16) < s8.plan("lanes").lockstep_makespan(
        10, 10, 16
    )
    with pytest.raises(jp.ConfigError, match=r"op_costs=\(1, 2\): give \(f, b, w\)"):
        mk(op_costs=(1, 2))
    with pytest.raises(jp.ConfigError, match="f and b must be positive"):
        mk(op_costs=(0, 1, 1))


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_a_heavy_head_is_paid_on_the_last_stage_of_every_micro_batch(name):
    """Issue #53: a head of several blocks' cost (EdgeCosts) lands on the last model stage's F and B; the
    embedding's on the first.  Every op's extra is counted once per micro-batch, and the last device's own
    work bounds the step from below."""
    from jaxpipe.tune.lockstep import EdgeCosts

    s = build(name, D=2, M=4)
    head = EdgeCosts(f_pre=0.25, b_pre=0.5, f_post=3.0, b_post=6.0)
    plain = predict_devices(s, UNIT, 1.0, 0.0, FREE, 1.0, 1.0)
    heavy = predict_devices(s, UNIT, 1.0, 0.0, FREE, 1.0, 1.0, edges=head)
    M, D = 4, 2
    assert heavy["busy"] * D - plain["busy"] * D == pytest.approx(M * (0.25 + 0.5 + 3.0 + 6.0))
    assert heavy["compute"] >= M * (1.0 + 2.0 + 3.0 + 6.0)
    one = build(name, D=1, M=4)  # one stage runs everything, without a bubble
    assert predict_devices(one, UNIT, 1.0, 0.0, FREE, 1.0, 1.0, edges=head)["compute"] == pytest.approx(
        M * (3.0 + 0.25 + 0.5 + 3.0 + 6.0)
    )


def test_a_placement_tie_goes_to_the_plan_with_fewer_stash_slots():
    """Chimera at D = 4, M = 8: both plans take 30 units, the ordered one holds 4 stash slots, lanes 5 -- the
    tie is broken by memory, not by the placement's name."""
    from jaxpipe.schedules.lanes import fastest_placement, unit_costs

    s = build("chimera", 4, 8)
    ordered, lanes = s.plan("ordered"), s.plan("lanes")
    assert ordered.lockstep_makespan(*unit_costs(s)) == lanes.lockstep_makespan(*unit_costs(s))
    assert (ordered.stash_capacity, lanes.stash_capacity) == (4, 5)
    assert fastest_placement(s) == "ordered"


def test_a_ticks_rendezvous_is_paid_once_per_tick_of_the_plan():
    """ZB-V's ordered plan runs more ticks than 1F1B's lanes: a rendezvous priced per tick charges it more."""
    zb_v, one_f_one_b = build("zb_v", D=2, M=8), build("1f1b", D=2, M=8)
    for s, placement in ((zb_v, "ordered"), (one_f_one_b, "lanes")):
        free = predict_devices(s, UNIT, 1.0, 0.0, FREE, 1.0, 1.0, placement=placement)
        paid = predict_devices(s, UNIT, 1.0, 0.0, FREE, 1.0, 1.0, placement=placement, rendezvous=0.5)
        ticks = s.plan(placement).num_ticks
        assert paid["rendezvous"] == pytest.approx(0.5 * ticks) and free["rendezvous"] == 0.0
        assert paid["step"] == pytest.approx(free["step"] + 0.5 * ticks)
    assert zb_v.plan("ordered").num_ticks > 2 * one_f_one_b.plan("lanes").num_ticks
