"""Schedule IR: builders, validation, simulator oracle formulas, rendering (no JAX needed)."""

import json
import subprocess
import sys

import pytest

from jaxpipe import schedules
from jaxpipe.schedules import Action, B, F, Schedule, ScheduleError

GRID = [(D, M) for D in (1, 2, 3, 4, 5, 8) for M in (1, 2, 3, 4, 6, 7, 8, 16)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("D,M", GRID)
def test_bubble_ratio_formula(name, D, M):
    s = schedules.build(name, num_stages=D, num_microbatches=M)
    for f, b in [(1.0, 2.0), (1.0, 1.0), (1.0, 3.0)]:
        r = s.simulate(f=f, b=b)
        assert r.bubble_ratio == pytest.approx((D - 1) / (M + D - 1), abs=1e-12)
        assert r.makespan == pytest.approx((M + D - 1) * (f + b))
    assert s.num_ticks == 2 * (M + D - 1)


@pytest.mark.parametrize("D,M", GRID)
def test_memory_and_lockstep(D, M):
    g = schedules.build("gpipe", D, M).simulate(1.0, 2.0)
    o = schedules.build("1f1b", D, M).simulate(1.0, 2.0)
    assert g.peak_inflight == [M] * D  # GPipe: N * M_a
    assert o.peak_inflight == [min(D - d, M) for d in range(D)]  # 1F1B: [M_a, D * M_a]
    assert g.weight_versions == o.weight_versions == [1] * D
    # GPipe never mixes F and B in a tick: lockstep costs nothing extra; 1F1B pays max(f, b) on mixed ticks.
    assert g.lockstep_makespan == pytest.approx(g.makespan)
    assert o.lockstep_makespan >= o.makespan
    if D > 1 and M > 1:
        assert o.lockstep_makespan > o.makespan


def test_plan_consistent():
    """The one lowered table: B (and W) read the stash slot their F wrote, on every device."""
    from jaxpipe.schedules.lanes import L

    for name, D, M in [("1f1b", 4, 8), ("zb_h1", 4, 8), ("zb_v", 2, 4)]:
        s = schedules.build(name, D, M)
        for placement in ("ordered", "lanes"):
            p = s.plan(placement)
            if (name, placement) == ("1f1b", "ordered"):
                assert p.stash_capacity == 4 and p.mbuf_capacity == 2
            tab = p.table
            for dev in range(D):
                slots = {}
                for t in range(p.num_ticks):
                    for li, kind in enumerate(p.lanes):
                        row = tab[t, dev, li]
                        if row[L["op"]] > 0:
                            slots.setdefault((int(row[L["stage"]]), int(row[L["mb"]])), set()).add(
                                int(row[L["stash"]])
                            )
                assert len(slots) == M * s.num_model_stages // D and all(len(v) == 1 for v in slots.values())


def test_validate_catches_errors():
    # missing backward
    with pytest.raises(ScheduleError, match="never run"):
        Schedule("bad", 2, 1, [[Action(F, 0, 0), Action(B, 0, 0)], [Action(F, 0, 1)]]).validate()
    # deadlock: stage 0 waits for B of mb 0 before running F of mb 0's successor's input
    with pytest.raises(ScheduleError, match="deadlock"):
        Schedule(
            "bad", 2, 1, [[Action(B, 0, 0), Action(F, 0, 0)], [Action(F, 0, 1), Action(B, 0, 1)]]
        ).validate()
    # duplicated action
    with pytest.raises(ScheduleError, match="twice"):
        Schedule("bad", 1, 1, [[Action(F, 0, 0), Action(F, 0, 0), Action(B, 0, 0)]]).validate()


def test_build_errors():
    with pytest.raises(ValueError, match="unknown schedule 'zz'.*1f1b"):
        schedules.build("zz", 4, 8)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        schedules.build("1f1b", 4, 0)


def test_render(tmp_path):
    s = schedules.build("1f1b", 4, 8)
    txt = s.render_text()
    assert txt.splitlines()[1].split()[:2] == ["dev0", "F0"]
    p = tmp_path / "t.png"
    s.render(str(p))
    assert p.stat().st_size > 5000 and p.read_bytes()[:4] == b"\x89PNG"
    s.render(str(tmp_path / "l.png"), mode="lockstep")
    tr = s.to_chrome_trace(str(tmp_path / "t.json"))
    ev = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(ev) == 4 * 8 * 2 and tr["traceEvents"]


def test_ir_imports_no_jax():
    code = (
        "import sys; from jaxpipe import schedules; schedules.build('1f1b', 4, 8).simulate(); "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_b_is_the_whole_backward_for_every_schedule():
    """One cost convention: ``b`` is a stage's whole backward; a split backward runs it as B = b - w and W = w
    (default b / 2).  So ZB-H1 at D = 4, M = 8 is drawn at its bubble (29 against 1F1B's 33, README's table),
    never slower than 1F1B -- its B and W priced 2 + 1 drew it at 43, the executor's plan at 53."""
    from jaxpipe.schedules.simulate import split_backward

    one = schedules.build("1f1b", 4, 8).simulate(f=1.0, b=2.0)
    zb = schedules.build("zb_h1", 4, 8)
    for r in (zb.simulate(f=1.0, b=2.0), zb.simulate(f=1.0, b=2.0, w=1.0)):
        assert (r.makespan, r.lockstep_makespan, r.lane_makespan) == (29.0, 29.0, 29.0)
        assert r.makespan < one.makespan == 33.0
    assert split_backward(zb, 2.0) == (1.0, 1.0) and split_backward(zb, 3.0, 1.0) == (2.0, 1.0)
    assert split_backward(schedules.build("1f1b", 2, 4), 2.0, 5.0) == (2.0, 0.0)  # unsplit: w unused
    with pytest.raises(ValueError, match=r"w=3 is the weight-gradient part of the whole backward b=2"):
        zb.simulate(f=1.0, b=2.0, w=3.0)
    for name in ("zb_v", "dualpipe_v"):  # two chunks a device: half-stage ops, the same rule
        v = schedules.build(name, 4, 8).simulate(f=0.5, b=1.0)
        assert v.makespan < one.makespan, name


def test_the_timeline_runner_draws_zero_bubble_at_its_bubble_by_default(tmp_path):
    """``python -m experiments.timeline --schedule=zb_h1`` with its defaults (f = 1, b = 2): 29, not 43."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.timeline",
            "--schedule=zb_h1",
            "--stages=4",
            "--microbatches=8",
            f"--out={tmp_path}/zb.png",
            "--text=false",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "b=2 (B 1 + W 1) | event-driven makespan 29" in p.stdout and "makespan 29, bubble" in p.stdout, (
        p.stdout
    )
    assert (tmp_path / "zb.png").stat().st_size > 0
