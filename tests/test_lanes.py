"""Lane plans (what the executor runs) and the executor running them: placement rules, slots, memory, phases,
exactness and NaN-filled bubbles for every flushing schedule under both placements."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe import schedules
from jaxpipe.schedules.ir import F, SEND_KEEP, SEND_NONE, ScheduleError
from jaxpipe.schedules.lanes import L, MAX_PHASES, plan
from helpers import reference, rel_err, small_model

SCHEDULES = [
    ("gpipe", 4, {}),
    ("1f1b", 4, {}),
    ("zb_h1", 4, {}),
    ("interleaved_1f1b", 4, {"virtual": 2}),
    ("chimera", 4, {}),
    ("chimera", 4, {"concat": "forward_doubling"}),
    ("chimera", 4, {"concat": "backward_halving"}),
    ("chimera", 8, {"pipelines": 4}),
    ("chimera", 4, {"eager_reduce": True}),
    ("zb_h1", 4, {"max_deferred_w": 3}),
]


def _check_plan(p):
    s = p.schedule
    nl = len(p.lanes)
    dev = {k: v[0] for k, v in s.location().items()}
    assert set(p.where) == set(dev)  # every action placed, once
    seen = set()
    for key, (t, li) in p.where.items():
        assert (t, dev[key], li) not in seen  # one action per lane per device per tick
        seen.add((t, dev[key], li))
        for dep in s.deps(jp.schedules.Action(key[0], key[2], key[1])):
            td, ld = p.where[dep]
            if dev[dep] == dev[key]:
                assert (td, ld) < (t, li), (key, dep)  # same device: an earlier lane suffices
            else:
                assert td < t, (key, dep)  # another device: the next tick at least
    # stash slots: a slot is rewritten only after every read of its previous content
    last = "W" if s.has_w() else "B"
    for d in range(s.D):
        owner = {}
        for key in sorted((k for k in p.where if k[0] == F and dev[k] == d), key=lambda k: p.where[k]):
            t, li = p.where[key]
            slot = p.table[t, d, li, L["stash"]]
            if slot in owner:
                tr, lr = p.where[(last, owner[slot][1], owner[slot][2])]
                assert tr * nl + lr < t * nl + li
            owner[slot] = key
            tb, lb = p.where[(last, key[1], key[2])]
            assert p.table[tb, d, lb, L["stash"]] == slot
    # a split backward's frontier slots: B writes, its W reads the same slot, nothing rewrites it in between
    if s.has_w():
        for d in range(s.D):
            owner = {}
            for key in sorted((k for k in p.where if k[0] == "B" and dev[k] == d), key=lambda k: p.where[k]):
                t, li = p.where[key]
                slot = p.table[t, d, li, L["front"]]
                assert 0 <= slot < p.front_capacity
                if slot in owner:
                    tw, lw = p.where[("W", owner[slot][1], owner[slot][2])]
                    assert tw * nl + lw < t * nl + li
                owner[slot] = key
                tw, lw = p.where[("W", key[1], key[2])]
                assert p.table[tw, d, lw, L["front"]] == slot
    # every sent message lands in a real slot that its reader reads
    for key, (t, li) in p.where.items():
        send = p.table[t, dev[key], li, L["send"]]
        assert (
            send == SEND_NONE
            or send == SEND_KEEP
            or p.table[t, :, li, L["recv_p"]].min() < p.mbuf_capacity
            or p.table[t, :, li, L["recv_m"]].min() < p.mbuf_capacity
        )


@pytest.mark.parametrize("name,D,opts", SCHEDULES + [("zb_v", 2, {}), ("dualpipe_v", 4, {})])
@pytest.mark.parametrize("placement", ["lanes", "ordered", "ordered2"])
def test_plans_are_valid(name, D, opts, placement):
    s = schedules.build(name, D, 2 * D, **opts)
    if placement == "ordered2" and s.has_pairs():
        with pytest.raises(ScheduleError, match="placement='ordered2'.*pairs forwards.*'ordered' or 'lanes'"):
            plan(s, placement)
        return
    _check_plan(plan(s, placement))


@pytest.mark.parametrize(
    "name,D,opts", SCHEDULES + [("zb_h1", 2, {}), ("1f1b", 2, {}), ("dualpipe_v", 2, {}), ("zb_v", 2, {})]
)
@pytest.mark.parametrize("placement", ["ordered", "ordered2"])
def test_ordered_ticks_are_fused_where_no_message_moves(name, D, opts, placement, monkeypatch):
    """Issue #49: consecutive ticks of the ordered placement run as one where no message has to move between
    them (each tick ends in an exchange, a rendezvous on a real link); ``ordered2`` fuses them into ticks
    of two rounds of lanes.  Every device runs its actions in the order the schedule's own ticks give them,
    and the plan holds what the unfused one holds."""
    from jaxpipe.schedules import lanes

    s = schedules.build(name, D, 2 * D, **opts)
    if placement == "ordered2" and s.has_pairs():
        pytest.skip("paired forwards are not fused (test_plans_are_valid: refused)")
    fused = plan(s, placement)
    monkeypatch.setattr(lanes, "_fuse_ticks", lambda s_, where, lanes_, dev: where)
    one = plan(s, "ordered")
    dev = {k: v[0] for k, v in s.location().items()}
    for d in range(D):
        order = lambda p: sorted((k for k in p.where if dev[k] == d), key=lambda k: p.where[k])
        assert order(fused) == order(one)
    assert (fused.stash_capacity, fused.front_capacity, fused.mbuf_capacity) == (
        one.stash_capacity,
        one.front_capacity,
        one.mbuf_capacity,
    )
    assert fused.num_ticks <= one.num_ticks

    # as many ppermutes an exchange: a channel the lanes shared (each device sending at most one message on
    # it a tick) is still shared
    def unshared(p):
        chans = [set(c) - {SEND_KEEP} for c in p.channels]
        return {c for c in set().union(*chans) if sum(c in x for x in chans) > 1} - set(p.shared)

    assert unshared(fused) <= unshared(one)
    costs = lanes.unit_costs(s)
    assert fused.lockstep_makespan(*costs) <= one.lockstep_makespan(*costs)


def test_zb_h1_at_two_devices_fuses_13_ticks_into_10():
    p = plan(schedules.build("zb_h1", 2, 4), "ordered")
    assert p.num_ticks == 10 and p.lockstep_makespan(1.0, 1.0, 1.0) == 13.0


def test_two_rounds_of_lanes_halve_a_vs_ticks_at_its_step_and_memory():
    """ZB-V at D = 2, M = 8: the ordered plan runs 49 ticks (a chunk's action each), two rounds of lanes run
    its order in 26 at the same lockstep step and stash -- fewer than half the rendezvous -- where the lanes
    plan's 21 ticks cost 10% more step and a slot more."""
    s = schedules.build("zb_v", 2, 8)
    one, two, lanes_ = plan(s, "ordered"), plan(s, "ordered2"), plan(s, "lanes")
    assert two.lanes == ("F", "B", "W", "F'", "B'", "W'")
    assert (one.num_ticks, two.num_ticks, lanes_.num_ticks) == (49, 26, 21)
    assert two.lockstep_makespan(1, 1, 1) == one.lockstep_makespan(1, 1, 1) == 49.0
    assert lanes_.lockstep_makespan(1, 1, 1) == 54.0
    assert two.stash_capacity == one.stash_capacity == 4 and lanes_.stash_capacity == 5


@pytest.mark.parametrize("name", ["zb_v", "1f1b"])
@pytest.mark.parametrize("placement", ["lanes", "ordered", "ordered2"])
def test_the_drawn_plan_lasts_its_lockstep_step(name, placement):
    """A plan's picture is what the executor runs: each device's lanes one after the other, a tick as long as
    its busiest device.  (The drawing laid every lane of a tick end to end across devices: ZB-V's ordered
    plan at D = 2, M = 8 drew 95 units for a step of 49.)"""
    from jaxpipe.schedules.render import _boxes

    s = schedules.build(name, 2, 8)
    costs = (1.0, 1.0, 1.0) if s.has_w() else (1.0, 2.0, 0.0)
    boxes = list(_boxes(s, placement, *costs))
    assert max(x + width for _, x, width, _ in boxes) == pytest.approx(
        plan(s, placement).lockstep_makespan(*costs)
    )
    for d in range(s.D):  # a device runs one action at a time
        spans = sorted((x, x + width) for dev, x, width, _ in boxes if dev == d)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


def test_two_rounds_of_lanes_are_never_chosen_by_auto():
    """``placement="auto"`` weighs lanes and ordered only: two rounds of lanes compile twice the lanes, and
    on the two-process testbed that cost what their fewer ticks saved (ZB-H1 2-6% slower than ordered, ZB-V
    even; docs/benchmarks.md), which the lockstep step does not price -- even where a tick's exchange makes
    ordered2's step the shortest."""
    from jaxpipe.schedules.lanes import fastest_placement, lockstep_step

    zb_v = schedules.build("zb_v", 2, 8)
    costs = (1.0, 1.0, 1.0, 0.5)
    assert lockstep_step(zb_v, "ordered2", costs) < min(
        lockstep_step(zb_v, p, costs) for p in ("ordered", "lanes")
    )
    assert fastest_placement(zb_v, costs) in ("ordered", "lanes")


def test_the_frontier_holds_only_what_w_has_not_read():
    """ZB-H1's W follows its B closely: its frontier needs far fewer slots than the stash (issue #39: kept in
    the stash's 2D - 1 slots, the frontier cost GPT d1024 2.7 GB a device at D = 4)."""
    for D, M in ((4, 8), (8, 16)):
        p = plan(schedules.build("zb_h1", D, M))
        assert p.front_capacity < p.stash_capacity and p.front_capacity <= 2
    assert plan(schedules.build("1f1b", 4, 8)).front_capacity == 0


@pytest.mark.parametrize("D,M", [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_1f1b_lanes_cost_and_memory(D, M):
    """Lanes: a tick holds an F and a B, so 1F1B costs (M + D - 1)(f + b) -- the event-driven makespan --
    and stage d holds up to 2(D - d) - 1 micro-batches; ordered keeps 1F1B's D - d at max(f, b) per tick."""
    s = schedules.build("1f1b", D, M)
    lanes, ordered = plan(s, "lanes"), plan(s, "ordered")
    assert (
        lanes.lockstep_makespan(1.0, 2.0)
        == pytest.approx((M + D - 1) * 3.0)
        == pytest.approx(s.simulate().makespan)
    )
    assert lanes.peak_inflight() == [min(2 * (D - d) - 1, M) for d in range(D)]
    assert ordered.peak_inflight() == [min(D - d, M) for d in range(D)]
    assert ordered.lockstep_makespan(1.0, 2.0) >= lanes.lockstep_makespan(1.0, 2.0)
    r = s.simulate()
    assert (
        r.lane_makespan == lanes.lockstep_makespan(1.0, 2.0) and r.lane_peak_inflight == lanes.peak_inflight()
    )


@pytest.mark.parametrize("name,D,opts", SCHEDULES[:5])
def test_phases_do_not_grow_with_microbatches(name, D, opts):
    """Compile time stays flat in M: the number of phases (scans) is bounded and the same at M and 8M."""
    n = [len(plan(schedules.build(name, D, m, **opts)).phases) for m in (2 * D, 16 * D)]
    assert n[0] == n[1] <= MAX_PHASES
    p = plan(schedules.build(name, D, 16 * D, **opts))
    active = p.table[..., L["op"]] > 0
    for t0, t1, used in p.phases:  # no phase compiles a lane that none of its ticks uses
        assert all(active[t0:t1, :, li].any() for li in used)
    # a lane the executor runs without a conditional is busy on every device in every tick of its phase
    assert len(p.full) == len(p.phases)
    for (t0, t1, used), full in zip(p.phases, p.full):
        assert set(full) <= set(used) and all(active[t0:t1, :, li].all() for li in full)
    one = (
        plan(schedules.build(name, 1, 8, **{k: v for k, v in opts.items() if k == "virtual"}))
        if name in ("gpipe", "1f1b", "zb_h1")
        else None
    )
    if one is not None:  # one device: every lane busy in every tick
        assert len(one.phases) == 1 and one.full[0] == one.phases[0][2]


def _pipe(kind, name, D, M, opts, **kw):
    model, batch_fn = small_model(kind, D * (opts.get("virtual", 1)))
    pipe = jp.Pipeline(
        model,
        schedule=name,
        num_microbatches=M,
        optimizer=optax.adam(1e-2),
        mesh=jp.make_mesh(stages=D),
        options=dict(opts),
        **kw,
    )
    return model, pipe, batch_fn


@pytest.mark.parametrize(
    "name,D,opts",
    [
        ("zb_h1", 4, {}),
        ("zb_h1", 2, {}),
        ("interleaved_1f1b", 2, {"virtual": 2}),
        ("chimera", 4, {}),
        ("chimera", 4, {"concat": "forward_doubling"}),
    ],
)
def test_ordered_placement_is_exact(name, D, opts):
    """(zb_h1 at D = 2, M = 4 ends with a phase of W alone: its W lane was skipped there, silently -- the
    stage gradients 48% off -- until the W lane ran apart from the B lane's branch.)"""
    model, pipe, batch_fn = _pipe("mlp", name, D, 2 * D, opts, placement="ordered")
    batch = batch_fn(4 * D)
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, batch)
    assert (
        abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        and rel_err(grads, ref_grads) <= 1e-5
    )


@pytest.mark.parametrize(
    "name,D,opts",
    [
        ("zb_h1", 4, {}),
        ("interleaved_1f1b", 2, {"virtual": 2}),
        ("chimera", 4, {"eager_reduce": True}),
        ("chimera", 4, {"concat": "backward_halving"}),
    ],
)
@pytest.mark.parametrize("placement", ["lanes", "ordered"])
def test_nan_bubbles_stay_finite_every_schedule(name, D, opts, placement):
    model, pipe, batch_fn = _pipe("gpt", name, D, 2 * D, opts, placement=placement, nan_bubbles=True)
    batch = batch_fn(4 * D)
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert rel_err(grads, reference(model, batch)[1]) <= 1e-5


@pytest.mark.parametrize(
    "name,D,opts,kind",
    [
        ("zb_v", 2, {}, "mlp"),
        ("dualpipe_v", 2, {}, "gpt"),
        ("interleaved_1f1b", 2, {"virtual": 2}, "mlp"),
        ("zb_h1", 4, {}, "gpt"),
    ],
)
def test_two_rounds_of_lanes_are_exact_with_nan_bubbles(name, D, opts, kind):
    """``placement="ordered2"``: a tick runs F, B, W then F', B', W' -- a device's second action of a kind in
    the second round, reading what the first round left (a V's device its forward down, then its forward
    back up) -- against ``jax.grad`` of the unpipelined model, NaN in every idle slot."""
    chunks = 1 if name == "zb_h1" else 2
    model, batch_fn = small_model(kind, D * chunks)
    pipe = jp.Pipeline(
        model,
        schedule=name,
        num_microbatches=2 * D,
        optimizer=optax.adam(1e-2),
        mesh=jp.make_mesh(stages=D),
        options=dict(opts),
        placement="ordered2",
        nan_bubbles=True,
    )
    assert pipe.lane_plan.placement == "ordered2" and len(pipe.lane_plan.lanes) in (4, 6)
    batch = batch_fn(4 * D)
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5


def test_recompute_is_exact_and_stashes_less():
    """residuals='inputs' stashes each stage's input only (jax.checkpoint) and gives the same gradients."""
    model, batch_fn = small_model("gpt", 4)
    batch = batch_fn(16)
    outs = {}
    for rc in (False, True):
        pipe = jp.Pipeline(
            model,
            schedule="1f1b",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=4),
            residuals="inputs" if rc else "all",
        )
        outs[rc] = pipe.loss_and_grad(pipe.init(), batch)
        outs[rc, "temp"] = (
            pipe.lower("grad", pipe.init(), batch).compile().memory_analysis().temp_size_in_bytes
        )
    assert rel_err(outs[True][1], reference(model, batch)[1]) <= 1e-5
    assert outs[True, "temp"] < outs[False, "temp"]


def test_bad_placement_is_refused():
    model, _ = small_model("mlp", 2)
    with pytest.raises(jp.ConfigError, match="placement='fast'.*'lanes'.*'ordered'.*'ordered2'"):
        jp.Pipeline(
            model,
            schedule="1f1b",
            num_microbatches=2,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=2),
            placement="fast",
        )
