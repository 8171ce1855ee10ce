"""``jaxpipe.tune.configure`` (issue #53, first version): the predicted-fastest pipeline within a memory
budget, its memory checked by compiling, and a configuration that fits where the defaults do not."""

import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.errors import ConfigError
from jaxpipe.tune.configure import configure

T = 16


def _batch():
    tok = np.random.default_rng(0).integers(0, 64, (8, T + 1)).astype(np.int32)
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def _model(stages):
    return jp.models.gpt(stages, vocab=64, d_model=32, heads=2, blocks_per_stage=4 // stages, seq_len=T)


def _configure(budget, cache):
    return configure(
        _model,
        _batch(),
        optax.adamw(1e-3),
        devices=2,
        memory_budget=budget,
        schedules=("1f1b",),
        microbatches=(2,),
        residuals=("all", "inputs"),
        verbose=False,
        cache=cache,
    )


@pytest.fixture(scope="module")
def cache_file(tmp_path_factory):
    return str(tmp_path_factory.mktemp("configure") / "measurements.json")


@pytest.fixture(scope="module")
def roomy(cache_file):
    return _configure(1 << 40, cache_file)


def test_every_candidate_is_predicted_and_the_choice_is_checked_by_compiling(roomy):
    assert len(roomy.candidates) == 4 and not any(c.dropped for c in roomy.candidates)
    assert all(np.isfinite(c.step_s) and c.memory > 0 for c in roomy.candidates)
    ranked = sorted(roomy.candidates, key=lambda c: c.step_s)
    assert roomy.best is ranked[0]
    assert roomy.best.compiled_memory is not None and ranked[1].compiled_memory is not None
    table = roomy.table()
    assert table.count("\n") == 1 + len(roomy.candidates) and "chosen" in table


def test_a_budget_the_full_residuals_exceed_chooses_a_recomputing_policy_that_fits_and_trains(roomy):
    keep = [c for c in roomy.candidates if c.residuals == "all"]
    budget = min(c.memory for c in keep) - 1
    small = [c for c in roomy.candidates if c.residuals == "inputs" and c.memory <= budget]
    assert small, "the test needs a recomputing candidate below every full-residual one"
    conf = roomy.within(budget)
    assert conf.best.residuals == "inputs" and conf.best.memory <= budget
    assert all("budget" in c.dropped for c in conf.candidates if c.residuals == "all")
    kw = conf.best.pipeline_kwargs()
    pipe = jp.Pipeline(_model(conf.best.model_stages), optimizer=optax.adamw(1e-3), **kw)
    state, metrics = pipe.step(pipe.init(), pipe.shard_batch(_batch()))
    assert np.isfinite(float(metrics["loss"]))


def test_a_budget_nothing_fits_is_refused_with_the_smallest_need(roomy):
    least = min(c.memory for c in roomy.candidates)
    with pytest.raises(ConfigError, match="no configuration fits .* the smallest needs"):
        roomy.within(least / 4)


def test_a_second_search_reads_every_measurement_from_the_cache(roomy, cache_file):
    """Issue #53 item 5: measurements are kept per (model, backend); the same search again measures and
    compiles nothing and predicts the same."""
    assert roomy.cache_misses > 0
    again = _configure(1 << 40, cache_file)
    assert again.cache_misses == 0 and again.cache_hits > 0
    assert again.best.label() == roomy.best.label()
    assert [c.step_s for c in again.candidates] == [c.step_s for c in roomy.candidates]
    assert [c.memory for c in again.candidates] == [c.memory for c in roomy.candidates]


def test_measure_times_a_few_candidates_and_picks_the_fastest_timed(roomy):
    """``measure=k``: the final choice is the fastest of at most k candidates timed on the devices (the two
    predicted fastest first); the others keep their predictions only."""
    conf = roomy.within(1 << 40, measure=2, rounds=2, min_time_s=0.0)
    timed = [c for c in conf.candidates if c.measured_s is not None]
    assert len(timed) == 2 and all(c.measured_s > 0 for c in timed)
    ranked = sorted((c for c in conf.candidates if not c.dropped), key=lambda c: c.step_s)
    assert set(map(id, timed)) == set(map(id, ranked[:2]))
    assert conf.best is min(timed, key=lambda c: c.measured_s)
    assert "ms |" in conf.table().splitlines()[2]


def test_a_measured_choice_times_short_steps_for_long_enough():
    """Three rounds of three 12-ms steps timed a candidate at 1.33x its own speed and the pick lost 24%: the
    rounds grow until the fastest candidate is timed ``min_time_s`` in all, within [rounds, MAX_ROUNDS]."""
    from jaxpipe.tune.configure import MAX_ROUNDS, _rounds_for

    assert _rounds_for(0.012, 3, 1.0) == 28  # 28 rounds x 3 steps x 12 ms >= 1 s
    assert _rounds_for(0.5, 3, 1.0) == 3  # long steps: the asked rounds suffice
    assert _rounds_for(0.001, 3, 1.0) == MAX_ROUNDS
    assert _rounds_for(0.001, 40, 1.0) == 40  # never fewer than asked
    assert _rounds_for(0.012, 3, 0.0) == 3


@pytest.mark.parametrize("residuals,splits", [("all", True), ("inputs", False)])
def test_the_search_knows_when_zero_bubble_w_recomputes(residuals, splits):
    """A recomputing stage's zero-bubble W back-propagates through the stage again (runtime.wsplit): configure
    prices that W at a whole backward, so it must know which stages split (as the executor decides)."""
    import jax
    from jaxpipe.runtime.wsplit import stage_splits

    pipe = jp.Pipeline(
        _model(2),
        optimizer=optax.adamw(1e-3),
        schedule="zb_h1",
        num_microbatches=2,
        mesh=jp.make_mesh(stages=2),
        residuals=residuals,
    )
    m, mb = pipe.model, {k: v[:2] for k, v in _batch().items()}
    w = jax.tree.map(lambda a: a[0], m.stage_params)
    assert stage_splits(m, w, m.pre(m.pre_params, mb), mb) is splits


def test_on_one_stage_one_schedule_stands_for_the_others():
    """One stage has no pipeline: zero-bubble's split and two chunks on one device only add work there, so
    the search keeps 1F1B's one-stage candidates (or the first listed schedule's) and says why it drops the
    rest; pipelined candidates of every schedule stay."""
    from jaxpipe.tune.configure import _candidates

    cands = _candidates(4, 16, ("zb_h1", "1f1b", "interleaved_1f1b"), (2,), ("all",))
    one = {c.schedule: c.dropped for c in cands if c.stages == 1}
    assert one["1f1b"] == "" and all(
        "1f1b's candidate stands for it" in one[n] for n in ("zb_h1", "interleaved_1f1b")
    )
    assert all(not c.dropped for c in cands if c.stages > 1)
    alone = {
        c.schedule: c.dropped for c in _candidates(2, 16, ("zb_h1", "gpipe"), (2,), ("all",)) if c.stages == 1
    }
    assert alone["zb_h1"] == "" and "zb_h1's candidate" in alone["gpipe"]


def test_gpipe_under_lanes_is_one_program_with_1f1b_and_is_not_timed_twice():
    """Under the lanes placement GPipe runs 1F1B's plan: the search keeps one of the two (timing both measured
    noise between one program: the two-process truth runs picked either by 7-8%), and keeps what differs."""
    from jaxpipe.tune.configure import Candidate, _program_key

    def key(name, placement="auto"):
        c = Candidate(name, 2, 1, 4, "all")
        pipe = jp.Pipeline(
            _model(2), schedule=name, num_microbatches=4, mesh=jp.make_mesh(stages=2), placement=placement
        )
        return _program_key(c, pipe)

    assert key("gpipe") == key("1f1b")
    assert key("gpipe", "ordered") != key("1f1b") and key("zb_h1") != key("1f1b")


def test_one_slope_per_residual_policy_one_compile_per_other_family():
    """README's search compiled two programs per memory family (14); the slope is the residual policy's
    (README's search: 1.44-1.60 under "all" for every split and chunk count, 0.88-1.04 recomputing), so it is
    fitted on the policy's largest family and every other family of the policy compiles once, for its offset
    (10 compiles, every prediction within 4% of XLA's)."""
    from types import SimpleNamespace as NS
    from jaxpipe.tune.configure import _calibrate

    slope = {"all": 1.5, "recompute": 0.9}
    offset = {
        ("all", False, 1): 100.0,
        ("all", True, 1): 300.0,
        ("all", False, 2): 50.0,
        ("recompute", False, 1): 70.0,
        ("recompute", True, 1): 20.0,
    }
    fams, built, cands = {}, {}, []
    for fam in offset:
        for i, working in enumerate((1000.0, 2000.0, 4000.0)[: 3 if fam == ("all", False, 1) else 2]):
            c = NS(compiled_memory=None, fam=fam)
            built[id(c)] = (None, NS(family=fam, working=working, known=10.0 * i, state=5.0))
            fams.setdefault(fam, []).append(c)
            cands.append(c)
    compiled = []

    class Bench:
        def compile_memory(self, jobs):
            for c, _ in jobs:
                fp = built[id(c)][1]
                c.compiled_memory = fp.state + fp.known + slope[fp.family[0]] * fp.working + offset[fp.family]
                compiled.append(c)

    model = _calibrate(fams, built, Bench())
    assert len(compiled) == 2 + 1 + 1 + 2 + 1
    per_fam = {fam: sum(c.fam == fam for c in compiled) for fam in offset}
    assert per_fam[("all", False, 1)] == 2 and per_fam[("all", True, 1)] == per_fam[("all", False, 2)] == 1
    for c in cands:
        fp = built[id(c)][1]
        truth = fp.state + fp.known + slope[fp.family[0]] * fp.working + offset[fp.family]
        assert model.total(fp) == pytest.approx(truth, rel=1e-9), (fp.family, fp.working)


def test_the_choice_and_the_runner_up_are_both_compiled_before_they_are_trusted():
    """Three micro-batch counts of one family: calibration compiles the extremes (M = 2, 8), so the runner-up
    M = 4 keeps a predicted memory until the check compiles it -- and where XLA's figure is over the budget,
    it drops out and the next is checked."""
    from types import SimpleNamespace as NS
    from jaxpipe.tune.configure import Candidate, _checked_best

    cands = [
        Candidate("1f1b", 2, 1, m, "all", step_s=s, memory=100.0) for m, s in ((2, 1.0), (4, 1.1), (8, 1.3))
    ]
    for c in (cands[0], cands[2]):
        c.compiled_memory = 100.0
    xla = {4: 300.0}  # what compiling M = 4 gives (the prediction said 100)
    compiled = []

    def compile_memory(jobs):
        for c, _ in jobs:
            compiled.append(c.microbatches)
            c.compiled_memory = xla[c.microbatches]

    bench = NS(compile_memory=compile_memory)
    built = {id(c): (None, None) for c in cands}
    best = _checked_best(cands, built, bench, budget=1000.0)
    assert best is cands[0] and compiled == [4] and cands[1].memory == 300.0
    # the same with a budget M = 4's compiled figure exceeds: dropped by name, M = 8 is the runner-up now
    for c in cands:
        c.dropped, c.memory = "", 100.0
    cands[1].compiled_memory = None
    compiled.clear()
    best = _checked_best(cands, built, bench, budget=200.0)
    assert best is cands[0] and compiled == [4] and cands[1].dropped.startswith("compiled: ")


def test_each_candidates_stage_is_predicted_at_its_own_micro_batch_rows(roomy):
    """A data-parallel candidate's micro-batch is its replica's share: rows / (data x M) -- predicted at the
    whole batch's rows / M, stage=1 data=2 looked as slow per micro-batch as stage=2 data=1."""
    from jaxpipe.tune.configure import _predict_times

    bench = roomy._bench
    seen = {}

    class Spy:
        def __getattr__(self, name):
            return getattr(bench, name)

        def stage_costs(self, finest, n, residuals, rows, *a, **kw):
            seen.setdefault("stage", []).append(rows)
            return bench.stage_costs(finest, n, residuals, rows, *a, **kw)

        def edges(self, rows):
            seen.setdefault("edges", []).append(rows)
            return bench.edges(rows)

    built = [c for c in roomy.candidates if id(c) in roomy._built]
    before = [c.step_s for c in built]
    _predict_times(built, roomy._built, Spy(), 2)
    want = [bench.rows // (c.data * c.microbatches) for c in built]
    assert seen["stage"] == want and seen["edges"] == want and {c.data for c in built} == {1, 2}
    assert [c.step_s for c in built] == before  # the same measurements, read from the cache


def test_a_model_whose_stages_read_a_mask_is_configured_and_its_pick_trains():
    """``stage_inputs=("mask",)``, the stage testing the mask as a user's attention would (``mask > 0``): the
    search measures it like any other model (it failed inside the user's code: the mask was a shape
    placeholder while the model's key was traced)."""
    import jax.numpy as jnp

    def make(n):
        def stage(w, h, ctx):
            return jnp.tanh(h @ w) * (ctx.inputs["mask"] > 0)[..., None]

        return jp.PipelineModel(
            stage_fn=stage,
            stage_params=jnp.ones((n, 16, 16)) / 16,
            stage_inputs=("mask",),
            pre=lambda p, b: b["x"] @ p,
            pre_params=jnp.ones((4, 16)) / 4,
            post_loss=lambda p, h, b: jnp.mean((h @ p - b["y"]) ** 2),
            post_params=jnp.ones((16, 1)),
        )

    r = np.random.default_rng(0)
    batch = {
        "x": r.normal(size=(8, T, 4)).astype(np.float32),
        "y": r.normal(size=(8, T, 1)).astype(np.float32),
        "mask": (r.random((8, T)) > 0.2).astype(np.float32),
    }
    conf = configure(
        make,
        batch,
        optax.sgd(0.1),
        devices=2,
        memory_budget=1 << 40,
        schedules=("1f1b",),
        microbatches=(2,),
        residuals=("all",),
        verbose=False,
        cache=None,
        balance_cut=False,
    )
    assert all(np.isfinite(c.step_s) for c in conf.candidates if not c.dropped)
    pipe = jp.Pipeline(conf.model(), optimizer=optax.sgd(0.1), **conf.best.pipeline_kwargs())
    _, metrics = pipe.step(pipe.init(), batch)
    assert np.isfinite(float(metrics["loss"]))


def _nnx_pair(n):
    """What from_nnx returns: (model, to_modules)."""
    return _model(n), (lambda params: params)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(schedules=("nope",)), r"schedules=\('nope',\)\): 'nope' is not one; choose from '1f1b'"),
        (
            dict(schedules=("pipedream",)),
            r"'pipedream' is not one; choose from '1f1b'",
        ),  # no-flush: not searched
        (dict(schedules=()), r"schedules=\(\)\): nothing given"),
        (dict(microbatches=(0,)), r"microbatches=\(0,\)\): give positive micro-batch counts"),
        (dict(microbatches="2"), r"microbatches='2'\): give positive"),
        (dict(microbatches=(2.5,)), r"give positive micro-batch counts"),
        (
            dict(residuals=("dots",)),
            r"residuals=\('dots',\)\): 'dots' is not one; choose from 'all', 'inputs'",
        ),
        (dict(devices=0), r"devices=0\): give a device count from 1 to the 8"),
        (dict(devices=2.5), r"devices=2.5\): give a device count"),
        (dict(devices=64), r"devices=64\): give a device count from 1 to the 8"),
        (
            dict(memory_budget=float("nan")),
            r"memory_budget=nan\): give the bytes a device may hold, a positive",
        ),
        (dict(memory_budget=-5), r"memory_budget=-5\): give the bytes"),
        (dict(memory_budget="1GB"), r"memory_budget='1GB'\): give the bytes"),
        (dict(measure=-1), r"measure=-1\): give an integer >= 0"),
        (dict(rounds=0), r"rounds=0\): give an integer >= 1"),
        (dict(min_time_s=float("nan")), r"min_time_s=nan\): give seconds >= 0"),
        (dict(optimizer="adam"), r"optimizer='adam'\): give an optax GradientTransformation"),
        (dict(make_model=_nnx_pair), r"make_model\(1\) returned a tuple, not a jp.PipelineModel -- from_nnx"),
        (dict(make_model=lambda n: _model(2)), r"make_model\(1\) returned a model of 2 stages"),
    ],
    ids=[
        "schedule_unknown",
        "schedule_no_flush",
        "schedules_empty",
        "microbatches_0",
        "microbatches_str",
        "microbatches_float",
        "residuals_dots",
        "devices_0",
        "devices_float",
        "devices_too_many",
        "budget_nan",
        "budget_negative",
        "budget_str",
        "measure_negative",
        "rounds_0",
        "min_time_nan",
        "optimizer_str",
        "make_model_pair",
        "make_model_wrong_stages",
    ],
)
def test_every_argument_is_checked_before_anything_is_measured(kw, match):
    args = dict(
        make_model=_model,
        batch=_batch(),
        optimizer=optax.adamw(1e-3),
        devices=2,
        memory_budget=1 << 40,
        schedules=("1f1b",),
        microbatches=(2,),
        residuals=("all",),
        verbose=False,
        cache=None,
        balance_cut=False,
    )
    args.update(kw)
    with pytest.raises(ConfigError, match=match):
        configure(args.pop("make_model"), args.pop("batch"), args.pop("optimizer"), **args)


def test_when_nothing_fits_each_reason_is_said_with_an_example():
    """Micro-batch counts that split no split of the rows: every candidate dropped before it is built, and the
    error says why (it was "min() arg is an empty sequence")."""
    with pytest.raises(
        ConfigError,
        match=r"no configuration fits .* Dropped: 1 x 8 rows do not split into "
        r"data=2 x M=3 micro-batches \(e.g. 1f1b stage=1 data=2 M=3",
    ):
        configure(
            _model,
            _batch(),
            optax.adamw(1e-3),
            devices=2,
            memory_budget=1 << 40,
            schedules=("1f1b",),
            microbatches=(3,),
            residuals=("all",),
            verbose=False,
            cache=None,
            balance_cut=False,
        )


def test_every_tick_of_a_pipelined_candidate_pays_the_measured_rendezvous(roomy):
    """A tick's price beyond its message (the wait for the slower device) is paid once a tick: a candidate's
    predicted step grows by its plan's ticks times the rendezvous; one stage, with no exchange, pays none."""
    from jaxpipe.tune.configure import _predict_times

    bench = roomy._bench
    extra = {"s": 0.0}

    class Spy:
        def __getattr__(self, name):
            return getattr(bench, name)

        def tick(self, finest, rows, devices, pipe_of):
            assert devices > 1
            return 1.0 + extra["s"]  # the message's link cost is far below a second

    built = [c for c in roomy.candidates if id(c) in roomy._built]
    steps = {}
    for s in (0.0, 0.5):
        extra["s"] = s
        _predict_times(built, roomy._built, Spy(), 2)
        steps[s] = [c.step_s for c in built]
    _predict_times(built, roomy._built, bench, 2)  # the fixture's own predictions back
    for c, slow, fast in zip(built, steps[0.5], steps[0.0]):
        pipe = roomy._built[id(c)][0]
        ticks = pipe.schedule.plan(pipe.placement).num_ticks if c.stages > 1 else 0
        assert slow - fast == pytest.approx(0.5 * ticks, rel=1e-9), c.label()
    assert {c.stages for c in built} == {1, 2}
