"""A pipeline's op costs measured on the running backend at its first step (jaxpipe.tune.running_costs):
the plans chosen again for them, still exact, kept per model and backend, and a warning where the schedule
is predicted slower than 1F1B's."""

import warnings

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.schedules import build
from jaxpipe.tune import running_costs
from helpers import reference, rel_err, small_model


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Pipelines built with the default op_costs measure (conftest: unit costs), into a fresh cache."""
    monkeypatch.setenv(running_costs.ENV, "measure")
    monkeypatch.setenv("JAXPIPE_CACHE_DIR", str(tmp_path))
    running_costs.forget_measured()  # nothing this process measured for another test
    yield tmp_path
    running_costs.forget_measured()


def _zb_h1(**kw):
    model, batch_fn = small_model("mlp", 2)
    pipe = jp.Pipeline(
        model,
        schedule="zb_h1",
        num_microbatches=4,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=2),
        nan_bubbles=True,
        **kw,
    )
    return pipe, model, batch_fn(8)


def test_a_micro_batch_like_the_batch_has_its_shapes_and_valid_ids():
    mb = running_costs.microbatch_like({"x": np.zeros((8, 3, 2), np.float32), "y": np.ones(8, np.int32)}, 4)
    assert mb["x"].shape == (2, 3, 2) and mb["x"].dtype == np.float32 and np.all(mb["x"] == 1)
    assert mb["y"].shape == (2,) and mb["y"].dtype == np.int32 and np.all(mb["y"] == 0)


def test_the_first_step_measures_the_costs_chooses_the_ticks_for_them_and_stays_exact(measuring):
    pipe, model, batch = _zb_h1()
    assert pipe.op_costs is None and pipe.options["costs"] is None  # nothing measured before a batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a predicted-slower warning may come: another test checks it
        loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    f, b, w, tick = pipe.op_costs
    assert f > 0 and b > 0 and w >= 0 and tick >= 0
    assert pipe.options["costs"] == pipe.op_costs and pipe.schedule.fixed_ticks  # ticks for these costs
    assert pipe.placement in ("lanes", "ordered", "ordered2") and pipe.lane_plan.placement == pipe.placement
    ref_loss, ref_grads = reference(model, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5
    # measured once per model and backend: a second pipeline of the same model reads the cache
    again, _, _ = _zb_h1()
    calls = []
    original = running_costs.measure
    running_costs.measure = lambda *a: calls.append(a) or original(*a)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again.loss_and_grad(again.init(), batch)
    finally:
        running_costs.measure = original
    assert calls == [] and again.op_costs == pipe.op_costs
    assert list(measuring.glob("*.json")), "nothing was written to the measurements cache"


def test_unit_costs_measure_nothing(measuring, monkeypatch):
    monkeypatch.setattr(running_costs, "measured", lambda *a, **k: pytest.fail("measured with 'unit'"))
    pipe, _, batch = _zb_h1(op_costs="unit")
    pipe.loss_and_grad(pipe.init(), batch)
    assert pipe.op_costs is None and pipe.options["costs"] is None


def test_a_probe_that_fails_says_so_and_keeps_the_unit_cost_plan(measuring, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("axis 'tensor' is not bound")

    monkeypatch.setattr(running_costs, "measured", broken)
    pipe, _, batch = _zb_h1()
    placement = pipe.placement
    with pytest.warns(UserWarning, match=r"could not measure op costs.*axis 'tensor'.*op_costs='unit'"):
        pipe.loss_and_grad(pipe.init(), batch)
    assert pipe.op_costs is None and pipe.placement == placement


def test_a_slow_first_step_says_it_measured_and_where_the_costs_are_kept(measuring, monkeypatch, capsys):
    """A first step that spent long measuring (a 35 ms stage forward: about 30 s) says so once, where the
    costs are kept and how to skip it; a pipeline given its op costs measures nothing and says nothing."""
    from jaxpipe import pipeline

    monkeypatch.setattr(pipeline, "SLOW_FIRST_STEP_S", -1.0)  # every measurement counts as slow
    monkeypatch.setattr(running_costs, "measured", lambda *a, **k: running_costs.RunningCosts(1, 2, 1, 0))
    pipe, _, batch = _zb_h1()
    state = pipe.init()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.loss_and_grad(state, batch)
        pipe.loss_and_grad(state, batch)
    said = capsys.readouterr().err
    assert said.count("jaxpipe: the first step took") == 1
    assert "zb_h1 plan" in said and str(measuring) in said and "op_costs=(f, b, w)" in said
    given, _, _ = _zb_h1(op_costs=(1, 2, 1))
    given.loss_and_grad(given.init(), batch)
    assert "first step took" not in capsys.readouterr().err


def test_plans_are_too_close_to_rank_within_the_models_error_but_not_when_equal():
    """The lockstep model is off by up to 15% on the testbed: plans predicted within 10% are timed; plans it
    prices the same (GPipe's two) keep the tie-break, and plans far apart are ranked."""
    assert running_costs.plans_too_close(build("dualpipe_v", 2, 8), (3.06, 2.48, 2.89, 0.265))
    assert running_costs.plans_too_close(build("zb_h1", 2, 8), (1.0, 1.0, 1.0, 0.0))
    assert not running_costs.plans_too_close(build("zb_h1", 2, 8), (1.0, 1.0, 1.0, 5.0))  # 1.62x apart
    assert not running_costs.plans_too_close(build("chimera", 2, 8), (1.0, 2.0, 0.0, 0.0))  # a tie
    # GPipe's ordered plan holds M = 8 micro-batches, its lanes plan 3: not traded for a timing's noise
    assert not running_costs.plans_too_close(build("gpipe", 2, 8), (1.0, 2.0, 0.0, 0.3))
    assert running_costs.plans_too_close(build("gpipe", 2, 4), (1.0, 2.0, 0.0, 0.3))  # 4 slots against 3


def test_plans_predicted_too_close_to_rank_are_timed_and_the_faster_runs_exactly(measuring, monkeypatch):
    """The faster plan as timed runs (and stays exact), whichever the model ranked first; the times are kept
    in the measurements cache, so a second pipeline of the same model times nothing."""
    monkeypatch.setattr(running_costs, "plans_too_close", lambda s, costs: True)
    timed = []
    for times, faster in (([2.0, 1.0], "lanes"), ([1.0, 2.0], "ordered")):  # (ordered's, lanes')
        running_costs.forget_measured()
        monkeypatch.setenv("JAXPIPE_CACHE_DIR", str(measuring / faster))
        monkeypatch.setattr(jp.Pipeline, "_time_plans", lambda self, st, b, t=times: timed.append(t) or t)
        pipe, model, batch = _zb_h1()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a predicted-slower warning may come)
            loss, grads = pipe.loss_and_grad(pipe.init(), batch)
        assert pipe.placement == faster == pipe.lane_plan.placement
        ref_loss, ref_grads = reference(model, batch)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        assert rel_err(grads, ref_grads) <= 1e-5
    assert timed == [[2.0, 1.0], [1.0, 2.0]]
    running_costs.forget_measured()  # from the cache file alone
    monkeypatch.setattr(jp.Pipeline, "_time_plans", lambda *a: pytest.fail("timed again"))
    again, _, batch = _zb_h1()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again.loss_and_grad(again.init(), batch)
    assert again.placement == "ordered"


def test_plans_that_cannot_be_timed_keep_the_models_choice_and_say_why(measuring, monkeypatch):
    def broken(self, state, batch):
        raise MemoryError("no room for a second program")

    monkeypatch.setattr(running_costs, "plans_too_close", lambda s, costs: True)
    monkeypatch.setattr(jp.Pipeline, "_time_plans", broken)
    pipe, _, batch = _zb_h1()
    with pytest.warns(UserWarning, match=r"could not time the zb_h1 schedule's two plans.*no room.*stays"):
        pipe.loss_and_grad(pipe.init(), batch)
    assert pipe.placement == jp.schedules.lanes.fastest_placement(pipe.schedule, pipe.op_costs)


def test_two_plans_are_timed_by_running_each_program(measuring):
    pipe, _, batch = _zb_h1()
    times = pipe._time_plans(pipe.init(), batch, calls=1)
    assert len(times) == 2 and all(0 < t < 60 for t in times)


def test_close_plans_are_timed_for_as_many_rounds_as_fit_the_budget(monkeypatch):
    """The least of three calls ranked two plans 4-7% apart the wrong way in two runs of four on the testbed:
    the timing runs as many rounds as fit its budget, at least three, at most fifteen."""
    least, most = running_costs.PLAN_TIMING_ROUNDS
    assert (least, most) == (3, 15)
    budget = running_costs.PLAN_TIMING_BUDGET_S
    assert running_costs.plan_timing_rounds(0.35, budget_s=5.0) == 14  # the testbed's 170-ms programs
    assert running_costs.plan_timing_rounds(1e-4) == most
    assert running_costs.plan_timing_rounds(budget / 2) == least  # slow programs: still three
    assert running_costs.plan_timing_rounds(100.0) == least
    # the count the pipeline's timing runs: from its plans' first calls
    rounds = []
    monkeypatch.setattr(running_costs, "plan_timing_rounds", lambda s: rounds.append(s) or 2)
    pipe, _, batch = _zb_h1()
    calls = []
    real = pipe._runner_for

    def counting(placement):
        context, runner = real(placement)
        lower = runner.lower

        class Counted:
            def __init__(self, compiled):
                self.compiled = compiled

            def __call__(self, *args):
                calls.append(placement)
                return self.compiled(*args)

        runner.lower = lambda *a: type("L", (), {"compile": lambda _: Counted(lower(*a).compile())})()
        return context, runner

    monkeypatch.setattr(pipe, "_runner_for", counting)
    pipe._time_plans(pipe.init(), batch)
    assert len(rounds) == 1 and 0 < rounds[0] < 60  # the two first calls' seconds
    assert calls == ["ordered", "lanes"] + ["ordered", "lanes"] * 2  # the first calls, then 2 rounds


def test_chimeras_replicas_moved_over_the_link_count_in_its_prediction_against_1f1b(measuring):
    """Chimera's stage replicas and their gradients cross the link every step (the planner prices them;
    on the testbed they made Chimera 1.05-1.08x 1F1B where the op costs alone predicted 0.81-0.89x): the
    pipeline's own prediction adds them, measured, and warns where they make the schedule lose."""
    model, _ = small_model("mlp", 2)
    chimera, one_f_one_b = build("chimera", 2, 4), build("1f1b", 2, 4)
    layout = running_costs.layout_seconds(model, chimera)
    assert layout > 0 and running_costs.layout_seconds(model, one_f_one_b) == 0.0
    costs = (1.0, 2.0, 0.0, 0.0)
    mine, theirs, _ = running_costs.predicted_against_1f1b(chimera, "lanes", costs, layout=5.0)
    assert mine == running_costs.predicted_against_1f1b(chimera, "lanes", costs)[0] + 5.0
    assert running_costs.against_1f1b(chimera, "lanes", costs) is None
    assert "predicted" in running_costs.against_1f1b(chimera, "lanes", costs, layout=mine)


def test_a_replica_larger_than_the_probe_allocates_is_priced_on_the_line_through_two_sizes(monkeypatch):
    """The replica probe allocates at most ``largest`` bytes an array (three live at once: a stage of
    gigabytes must not run a device out of memory at the first step); a larger stage is priced on the line
    through that size and a quarter of it, and a smaller one at its own size."""
    from jaxpipe.tune import microbench

    built = []

    def per_iteration(loops, lengths, calls):  # a link of 0.1 ms + 1 ns a byte, the loops built not run
        built.extend(loops)
        return {size: 1e-4 + 1e-9 * size for size in loops}

    monkeypatch.setattr(microbench, "per_iteration", per_iteration)
    swap = [(1, 0), (0, 1)]
    big = microbench.replica_exchange_seconds(2, swap, 64 << 20, largest=1 << 20)
    assert max(built) == 1 << 20 and big == pytest.approx(1e-4 + 1e-9 * (64 << 20))
    built.clear()
    assert microbench.replica_exchange_seconds(2, swap, 1 << 16) == pytest.approx(1e-4 + 1e-9 * (1 << 16))
    assert built == [1 << 16]


def test_a_bad_op_costs_word_says_what_it_takes(monkeypatch):
    model, _ = small_model("mlp", 2)
    with pytest.raises(jp.ConfigError, match=r"op_costs='fast': give 'measure'.*'unit'.*\(f, b, w"):
        jp.Pipeline(model, num_microbatches=2, mesh=jp.make_mesh(stages=2), op_costs="fast")
    monkeypatch.setenv(running_costs.ENV, "sometimes")
    with pytest.raises(jp.ConfigError, match=r"\$JAXPIPE_OP_COSTS='sometimes': give 'measure'"):
        jp.Pipeline(model, num_microbatches=2, mesh=jp.make_mesh(stages=2))


def test_a_schedule_predicted_slower_than_1f1b_is_named_with_both_predictions():
    s = build("zb_v", 2, 8)
    # a tick's exchange as costly as a forward: ZB-V's ordered 49 ticks lose to 1F1B's 10
    why = running_costs.against_1f1b(s, "ordered", (1e-3, 1e-3, 1e-3, 1e-3))
    assert why is not None
    assert "'zb_v' is predicted" in why and "x 1F1B's step" in why and "ms against" in why
    assert f"{s.plan('ordered').num_ticks} ticks" in why and "schedule='1f1b'" in why
    mine = running_costs.predicted_step(s, "ordered", (1e-3, 1e-3, 1e-3, 1e-3))
    assert f"{mine * 1e3:.3g} ms against" in why
    # no exchange cost: ZB-V's smaller bubble wins, nothing to say
    assert running_costs.against_1f1b(s, "ordered", (1e-3, 1e-3, 1e-3, 0.0)) is None
    assert running_costs.against_1f1b(build("1f1b", 2, 8), "lanes", (1.0, 1.0, 1.0, 9.0)) is None


def test_hand_given_costs_that_make_the_schedule_lose_warn_when_it_is_built():
    model, _ = small_model("mlp", 4)
    with pytest.warns(UserWarning, match=r"'interleaved_1f1b' is predicted .*x 1F1B's step"):
        jp.Pipeline(
            model,
            schedule="interleaved_1f1b",
            num_microbatches=4,
            mesh=jp.make_mesh(stages=2),
            op_costs=(1.0, 2.0, 0.0, 5.0),
        )


def test_costs_past_the_tick_search_rank_the_plans_and_keep_the_unit_time_order():
    """ZB-V at D = 4 (the cost-aware tick search serves D <= 3): op costs, given or measured at the first
    step, still rank the plans, and the ticks stay the unit-time order -- the first step used to stop with an
    error that told the user to leave out a ``costs=`` they never gave.  At D = 2 the ticks are searched."""
    model, _ = small_model("mlp", 8)
    kw = dict(schedule="zb_v", num_microbatches=8, optimizer=optax.sgd(0.1), op_costs=(1.0, 1.0, 1.2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a predicted-slower warning may come)
        big = jp.Pipeline(model, mesh=jp.make_mesh(stages=4), **kw)
        small = jp.Pipeline(small_model("mlp", 4)[0], mesh=jp.make_mesh(stages=2), **kw)
    assert big.options["costs"] is None and big.schedule.num_ticks == build("zb_v", 4, 8).num_ticks
    assert small.options["costs"] == (1.0, 1.0, 1.2)
    # the user's own costs= past the search: the error says what to do
    with pytest.raises(jp.ConfigError, match=r"serves D <= 3.*leave costs out"):
        jp.Pipeline(model, mesh=jp.make_mesh(stages=4), options={"costs": (1.0, 1.0, 1.0)}, **kw)


def test_the_costs_of_one_backend_measure_positive_and_a_tick_on_one_device_is_free():
    model, batch_fn = small_model("mlp", 2)
    mb = running_costs.microbatch_like(batch_fn(4), 2)
    one = running_costs.measure(model, mb, 1, True)
    assert one.tick == 0.0 and one.forward > 0 and one.backward > 0 and one.weight > 0
    assert all(np.isfinite(one)) and jax.device_count() >= 2


def _fake_op_costs(probes, weight_alone=0.009, input_part=0.004):
    """``microbench.op_costs`` as a table: F 3 ms, the whole backward 10 ms, the input part and W alone as
    given; each call's ``kinds`` appended to ``probes``."""

    def fake(stage_fn, w, x, devices, busy, split=False, kinds=(), best=False, **_):
        probes.append(tuple(kinds))
        if kinds == ["W"]:
            return {"W": [weight_alone]}
        if split:
            return {"B": [input_part]}
        return {"F": [0.003]} if kinds == ["F"] else {"F": [0.003], "B": [0.010]}

    return fake


@pytest.mark.parametrize("reads_frontier", [True, False])
def test_a_split_backwards_weight_part_is_timed_as_the_w_lane_runs_it(monkeypatch, reads_frontier):
    """W from the output gradients its B kept: its products timed alone (the whole backward is not timed);
    a stage whose W recomputes the backward: what the whole backward costs beyond its input part."""
    from jaxpipe.tune import microbench

    probes = []
    monkeypatch.setattr(microbench, "op_costs", _fake_op_costs(probes))
    monkeypatch.setattr(running_costs, "_reads_frontier", lambda *a: reads_frontier)
    model, batch_fn = small_model("mlp", 2)
    mb = running_costs.microbatch_like(batch_fn(4), 2)
    split = running_costs.measure(model, mb, 1, True)
    assert split.forward == 0.003 and split.backward == 0.004
    assert split.weight == pytest.approx(0.009 if reads_frontier else 0.006)
    assert probes == [("F",) if reads_frontier else (), ("B",), ("W",)]
    whole = running_costs.measure(model, mb, 1, False)
    assert whole.backward == 0.010 and whole.weight == 0.0


def test_a_weight_part_the_timings_noise_hides_is_timed_alone_not_priced_free(monkeypatch):
    """A stage whose W recomputes, of microseconds: the input part timed dearer than the whole backward.  W
    is then timed alone (an upper bound), no dearer than the whole backward -- a free W would mislead the
    zero-bubble planner."""
    from jaxpipe.tune import microbench

    monkeypatch.setattr(running_costs, "_reads_frontier", lambda *a: False)
    model, batch_fn = small_model("mlp", 2)
    mb = running_costs.microbatch_like(batch_fn(4), 2)
    monkeypatch.setattr(microbench, "op_costs", _fake_op_costs([], weight_alone=0.004, input_part=0.011))
    assert running_costs.measure(model, mb, 1, True).weight == 0.004
    # back-propagating again: more than the whole backward
    monkeypatch.setattr(microbench, "op_costs", _fake_op_costs([], weight_alone=0.015, input_part=0.011))
    assert running_costs.measure(model, mb, 1, True).weight == 0.010


def test_every_process_runs_the_same_probes_whatever_its_own_timings_say(monkeypatch):
    """The probes hold collectives: a process whose timings hid W timed it alone, one whose did not skipped
    that probe, and a two-process job deadlocked (one process in the probe, the other in the broadcast of
    the costs).  W alone is timed either way."""
    from jaxpipe.tune import microbench

    monkeypatch.setattr(running_costs, "_reads_frontier", lambda *a: False)
    model, batch_fn = small_model("mlp", 2)
    mb = running_costs.microbatch_like(batch_fn(4), 2)
    for input_part in (0.004, 0.011):  # W visible (the difference), and hidden by the noise
        probes = []
        monkeypatch.setattr(microbench, "op_costs", _fake_op_costs(probes, input_part=input_part))
        running_costs.measure(model, mb, 1, True)
        assert probes == [(), ("B",), ("W",)]


def test_a_ticks_price_is_measured_on_uneven_and_even_ticks_the_dearer_kept(monkeypatch):
    """A plan's ticks are uneven -- a device that finished early waits in the exchange and must wake for it
    -- and ticks of equal work priced the exchange at half what the testbed's ordered plans paid; but the
    uneven loop's busier device shares the memory bus with an idler one, which priced a tick at zero at
    64-row micro-batches.  The probe runs both, against every device running the stage twice without the
    exchange, and keeps the dearer.  Counted with a stage that adds one: 3 ticks on 2 devices of 8
    elements."""
    from jaxpipe.tune import microbench

    done, per_tick = {}, {}

    def run_each(loops, lengths, calls):
        for key, make in loops.items():
            done[key] = np.asarray(make(3)())
        return dict(per_tick)

    monkeypatch.setattr(microbench, "per_iteration", run_each)
    stage_fn = lambda w, h: h + w
    price = lambda: running_costs._tick_cost(stage_fn, np.float32(1), np.zeros((2, 4), np.float32), 2)
    per_tick.update(alone=5e-3, even=5.2e-3, uneven=5.5e-3)
    assert price() == pytest.approx(0.5e-3)
    assert done["alone"].tolist() == [48.0, 48.0]  # 3 ticks x 2 x 8 on each device
    assert done["even"].sum() == 2 * 48.0  # the same work, exchanged
    assert done["uneven"].sum() == 3 * (2 + 1) * 8  # a tick: twice on one device, once on the other
    per_tick.update(alone=5e-3, even=5.2e-3, uneven=4.9e-3)  # the busier device ran faster beside an idle one
    assert price() == pytest.approx(0.2e-3)


def test_one_tick_price_serves_every_pipeline_that_sends_the_same_message(monkeypatch):
    """A tick's price is measured once per (backend, devices, message) in a process, also where no cache
    file is kept (a multi-process job): the pipelines of one run are placed for one price, not each for its
    own probe's.  A stage's F, B and W stay per model; another message size is priced again."""
    calls = []
    monkeypatch.setattr(
        running_costs, "_tick_cost", lambda *a, **k: calls.append(a[2].shape) or 1e-3 * len(calls)
    )
    monkeypatch.setattr(running_costs, "_ops", lambda *a: (1.0, 2.0, 0.0))
    running_costs.forget_measured()
    try:
        two, batch_fn = small_model("mlp", 2)
        four, _ = small_model("mlp", 4)  # a two-chunk schedule's model: other stages, the same activation
        mb = running_costs.microbatch_like(batch_fn(8), 4)
        first = running_costs.measured(two, mb, 2, False, cache=None)
        assert running_costs.measured(four, mb, 2, True, cache=None).tick == first.tick == 1e-3
        assert len(calls) == 1
        other = running_costs.measured(
            two, running_costs.microbatch_like(batch_fn(8), 2), 2, False, cache=None
        )
        assert other.tick == 2e-3 and len(calls) == 2 and calls[0] != calls[1]
    finally:
        running_costs.forget_measured()


def test_a_ticks_price_is_the_median_of_repeated_measurements(monkeypatch):
    """One measurement of a tick's exchange is a small difference of two loops' times, and one of them in a
    run can come out near zero (0.0118 ms on the testbed, where the others gave 0.14-0.35): the price is the
    median of several, so one stray measurement does not place a plan."""
    from jaxpipe.tune import microbench

    exchange = iter([0.30e-3, 0.0, 0.25e-3, 0.31e-3, 0.28e-3])  # seconds a tick, one stray
    monkeypatch.setattr(
        microbench,
        "per_iteration",
        lambda loops, lengths, calls: dict(uneven=5e-3 + next(exchange), even=5e-3, alone=5e-3),
    )
    model, batch_fn = small_model("mlp", 2)
    stage_fn, w, x = running_costs._stage_op(model, running_costs.microbatch_like(batch_fn(4), 2))
    assert running_costs._tick_cost(stage_fn, w, x, 2) == pytest.approx(0.28e-3)
    assert next(exchange, None) is None  # all five measured


@pytest.mark.parametrize("first_s, repeats", [(3.0, 5), (8.0, 2), (15.6, 1), (200.0, 1)])
def test_the_tick_probe_repeats_as_often_as_its_first_repeats_time_allows(monkeypatch, first_s, repeats):
    """A repeat of the probe costs about 400 stage forwards: five at a 2048-wide stage took 73-77 s of a
    first step.  It repeats as often as 20 s allow at the first repeat's time, at least once, at most five
    times -- from ``Pipeline``'s first step and from the configuration search alike."""
    from jaxpipe.tune import microbench

    clock, calls = [0.0], []

    def per_iteration(loops, lengths, calls_):
        clock[0] += first_s if not calls else 1.0  # the first repeat compiles
        calls.append(clock[0])
        return dict(uneven=5.3e-3, even=5.1e-3, alone=5e-3)

    monkeypatch.setattr(microbench, "per_iteration", per_iteration)
    monkeypatch.setattr(running_costs.time, "perf_counter", lambda: clock[0])
    model, batch_fn = small_model("mlp", 2)
    mb = running_costs.microbatch_like(batch_fn(4), 2)
    assert running_costs.tick_price(model, mb, 2) == pytest.approx(0.3e-3)
    assert len(calls) == repeats


def test_chimera_times_its_ops_over_its_stage_and_replica_and_warns_against_1f1b_at_one_stage(
    measuring, monkeypatch
):
    """A Chimera device holds its stage and a replica, each with a gradient sum (on one core of the CPU
    testbed its backward cost 15-23% more over two copies of the weights than over one): its op costs are
    timed over two copies, kept apart from one stage's, priced by how often its plan switches stages, and
    its warning prices 1F1B at one stage's."""
    assert [running_costs.held_copies(build(n, 2, 4)) for n in ("chimera", "1f1b", "zb_v", "dualpipe_v")] == [
        2,
        1,
        1,
        1,
    ]
    assert running_costs.held_copies(build("interleaved_1f1b", 2, 4, virtual=2)) == 1
    timed = []

    def ops(stage_fn, w, x, devices, split, copies=1, at_frontier=False):
        timed.append(copies)
        return (1e-3, 2e-3 * copies, 0.0)

    monkeypatch.setattr(running_costs, "_ops", ops)
    monkeypatch.setattr(running_costs, "_tick_cost", lambda *a, **k: 0.0)
    monkeypatch.setattr(running_costs, "layout_seconds", lambda *a, **k: 0.0)
    model, batch_fn = small_model("mlp", 2)
    pipe = jp.Pipeline(
        model, schedule="chimera", num_microbatches=4, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(pipe.init(), batch_fn(8))
    rate = running_costs.copy_switch_rate(pipe.schedule)
    assert rate == 4 / 7  # 0F0 1F1 1B1 0B0 0F2 1F3 1B3 0B2: 4 of 7 pairs switch stage
    assert sorted(timed) == [1, 2] and np.allclose(pipe.op_costs[:3], (1e-3, 2e-3 + rate * 2e-3, 0.0))
    one_stage = (1e-3, 2e-3, 0.0, 0.0)
    mine, theirs, _ = running_costs.predicted_against_1f1b(
        pipe.schedule, pipe.placement, pipe.op_costs, 0.0, one_stage
    )
    assert theirs < running_costs.predicted_against_1f1b(pipe.schedule, pipe.placement, pipe.op_costs)[1]
    said = [str(w.message) for w in caught if "1F1B's step" in str(w.message)]
    assert said and f"({mine * 1e3:.3g} ms against {theirs * 1e3:.3g} ms" in said[0], said
    # kept apart: a pipeline of one stage a device finds its costs, not Chimera's
    assert running_costs.measured(model, running_costs.microbatch_like(batch_fn(8), 4), 2, False) == (
        1e-3,
        2e-3,
        0.0,
        0.0,
    )
    assert sorted(timed) == [1, 2]


def test_ops_timed_over_two_copies_of_the_weights_run_and_measure_positive():
    from jaxpipe.tune import microbench

    model, batch_fn = small_model("mlp", 2)
    stage_fn, w, x = running_costs._stage_op(model, running_costs.microbatch_like(batch_fn(4), 2))
    ops = microbench.op_costs(stage_fn, w, x, 1, [1], reps=4, split=True, copies=2)
    assert all(ops[k][0] > 0 for k in ("F", "B", "W")), ops


def test_copy_switch_rate_counts_the_busiest_devices_stage_changes():
    assert running_costs.copy_switch_rate(build("1f1b", 4, 8)) == 0.0
    assert running_costs.copy_switch_rate(build("chimera", 2, 8)) == 8 / 15
    one = running_costs.RunningCosts(1.0, 2.0, 0.5, 0.1)
    over = running_costs.RunningCosts(2.0, 4.0, 1.5, 0.3)
    assert running_costs.held_stage_costs(one, over, 0.25) == (1.25, 2.5, 0.75, 0.1)


def test_the_probes_backward_adds_the_weight_gradient_in_place_as_the_executor_does():
    """A summing schedule's B on a stage that scans its layers: the input part, then each layer's weight
    gradient scatter-added into the sums (no zero-filled stacked gradient and pass adding it); the same
    numbers as the fused pullback."""
    import jax.numpy as jnp
    from jaxpipe.bench import layers_fn
    from jaxpipe.tune.microbench import _Backward

    stage_fn = layers_fn("scan")
    w = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (4, 16))
    dh, acc = jnp.ones((4, 16)), jnp.full((3, 16, 16), 0.5)
    in_place, fused = _Backward(stage_fn, w, x), _Backward(stage_fn, w, x, in_place=False)
    assert in_place.split is not None and fused.split is None
    assert "scatter-add" in str(jax.make_jaxpr(in_place.whole)(dh, acc))
    assert "scatter-add" not in str(jax.make_jaxpr(fused.whole)(dh, acc))
    dw, dx = jax.vjp(stage_fn, w, x)[1](dh)
    for got in (in_place.whole(dh, acc), fused.whole(dh, acc)):
        assert rel_err(got[0], dx) < 1e-6 and rel_err(got[1], acc + dw) < 1e-6
    assert rel_err(in_place.weight(dh, acc), acc + dw) < 1e-6
    assert rel_err(in_place.input(dh), dx) < 1e-6
    # zero-bubble's W from the frontier a B kept: the same sums
    assert rel_err(in_place.weight(dh, acc, in_place.frontier(dh)), acc + dw) < 1e-6


def test_the_probes_w_runs_the_weight_products_alone_from_the_frontier():
    """Zero-bubble's W as the W lane runs it: from the output gradients a B kept, one product a layer (the
    weight gradients), not the input part's too -- also where the layers are held apart and the sums are
    not added in place.  Timed with the input part in each call, W cost what the whole backward costs."""
    import jax.numpy as jnp
    from jaxpipe.bench import held_as, layers_fn
    from jaxpipe.tune.microbench import _Backward

    stacked = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    x, dh = jax.random.normal(jax.random.key(1), (4, 16)), jnp.ones((4, 16))
    for form in ("apart", "scan"):
        stage_fn, w = layers_fn(form), held_as(form, stacked)
        back = _Backward(stage_fn, w, x)
        assert back.at_frontier is not None
        acc = jax.tree.map(jnp.zeros_like, w)
        front = back.frontier(dh)
        dw = jax.vjp(stage_fn, w, x)[1](dh)[0]
        assert rel_err(back.weight(dh, acc, front), dw) < 1e-6
        if form == "apart":  # three layers, three products (with the input part: six)
            dots = lambda *a: str(jax.make_jaxpr(back.weight)(*a)).count("dot_general")
            assert dots(dh, acc, front) == 3 and dots(dh, acc) == 6
