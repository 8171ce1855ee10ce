"""Performance model (Chimera §3.4): IR-derived counts, the cost formula, the search; a micro-benchmark
smoke."""

import jax.numpy as jnp
import pytest

from jaxpipe import schedules
from jaxpipe.tune import (
    Costs,
    critical_path_counts,
    enumerate_candidates,
    lockstep_profile,
    memory_estimate,
    predict,
)


def test_critical_path_of_chimera_figure6():
    """Figure 6: Chimera with N = D = 6 has C_f = 6 forwards and C_b = 10 backwards on its critical path."""
    assert critical_path_counts(schedules.build("chimera", 6, 6), f=1.0, b=2.0) == (6, 10)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_critical_path_of_flushing_pipelines(name):
    """GPipe / 1F1B: the critical path runs N + D - 1 forwards and as many backwards."""
    D, N = 4, 8
    assert critical_path_counts(schedules.build(name, D, N), f=1.0, b=2.0) == (N + D - 1, N + D - 1)


def test_lockstep_profile_counts_every_busy_tick():
    s = schedules.build("1f1b", 4, 8)
    prof = lockstep_profile(s)
    assert sum(prof.values()) == s.num_ticks  # 1F1B has no all-idle tick
    assert sum(k * n for (_, k), n in prof.items()) == 2 * 4 * 8  # every op counted once


def _costs(D, f=1.0, b=2.0, alpha=0.0, beta=0.0):
    return Costs(
        op={"F": [f] * D, "B": [b] * D, "W": [1.0] * D},
        p2p_alpha=alpha,
        p2p_beta=beta,
        ar_alpha=alpha,
        ar_beta=beta,
    )


def test_predict_equals_lockstep_makespan_without_communication():
    for name in ("gpipe", "1f1b", "chimera", "zb_h1"):
        s = schedules.build(name, 4, 8)
        b = 1.0 if s.has_w() else 2.0
        p = predict(s, _costs(4, b=b), act_bytes=0, grad_bytes=0, replicas=1)
        sim = s.simulate(f=1.0, b=b + (1.0 if s.has_w() else 0.0), w=1.0 if s.has_w() else None)
        assert p["lockstep"] == pytest.approx(sim.lockstep_makespan)
        assert p["paper"] == pytest.approx((p["C_f"] * 1.0 + p["C_b"] * b))


def test_predict_adds_communication_and_allreduce():
    s = schedules.build("1f1b", 4, 8)
    base = predict(s, _costs(4), 0, 0, replicas=2)["lockstep"]
    with_comm = predict(s, _costs(4, alpha=1e-3, beta=1e-9), act_bytes=1e6, grad_bytes=1e6, replicas=2)
    per_msg = 1e-3 + 1e-9 * 1e6
    assert with_comm["p2p"] == pytest.approx(s.num_ticks * 2 * per_msg)
    assert with_comm["allreduce"] == pytest.approx(2 * 1 * 1e-3 + 2 * 0.5 * 1e-9 * 1e6)
    assert with_comm["lockstep"] == pytest.approx(base + with_comm["p2p"] + with_comm["allreduce"])


def test_op_overhead_counts_every_device_op_of_every_pipeline():
    s = schedules.build("1f1b", 4, 8)
    base = predict(s, _costs(4), 0, 0, replicas=1, width=2)["lockstep"]
    more = predict(s, _costs(4), 0, 0, replicas=1, width=2, op_overhead=1e-3)["lockstep"]
    assert more - base == pytest.approx(1e-3 * 2 * (2 * 4 * 8))  # 2 pipelines x (F + B) x D x M


def test_search_space_and_memory():
    cands = enumerate_candidates(8, 64, 8, micro_batch_sizes=[4, 8])
    assert {c.schedule for c in cands} >= {"gpipe", "1f1b", "chimera", "zb_h1", "interleaved_1f1b"}
    assert all(c.W * c.D == 8 and c.W * c.B * c.N == 64 for c in cands)
    assert not any(c.schedule == "chimera" and c.D % 2 for c in cands)
    g = next(c for c in cands if c.schedule == "gpipe" and c.D == 4 and c.B == 4)
    o = next(c for c in cands if c.schedule == "1f1b" and c.D == 4 and c.B == 4)
    ch = next(c for c in cands if c.schedule == "chimera" and c.D == 4 and c.B == 4)
    mem = lambda c: memory_estimate(c, stage_param_bytes=1e6, stash_bytes_per_mb=1e5)
    assert mem(o) < mem(g)  # 1F1B stashes D micro-batches, GPipe N
    assert mem(ch) > mem(o)  # Chimera holds two weight replicas


def test_microbenchmarks_run_and_are_positive():
    from jaxpipe.tune import microbench as mb

    c = mb.measure(lambda w, x: jnp.tanh(x @ w), jnp.ones((16, 16)) * 0.1, jnp.ones((4, 16)), devices=2)
    assert len(c.op["F"]) == 2 and all(t > 0 for t in c.op["F"] + c.op["B"])
    # the fits are clamped at 0, so ">= 0" could not fail: a 1 MiB message must cost more than a 4 KiB one
    # (a fit whose slope came out <= 0 -- clamped to 0 -- fails here), and every cost must be a real time
    assert c.p2p_beta > 0 and c.p2p(1 << 20) > c.p2p(1 << 12), (c.p2p_alpha, c.p2p_beta)
    assert c.allreduce(1 << 20, 2) > c.allreduce(1 << 12, 2), (c.ar_alpha, c.ar_beta)


def test_chimera_free_regions_figure6():
    """Figure 6 (N = D = 6): a device's free regions after a replica's last backward are its bubbles inside
    the step -- regions (a), (b) -- and the tail -- region (c); they add up to the step minus its busy time
    from that point on; some device has a bubble before the tail."""
    from jaxpipe.tune.perf_model import free_regions

    s = schedules.build("chimera", 6, 6)
    place = s.place(1.0, 2.0)
    end = max(place["finish"].values())
    inner = 0
    for d in range(6):
        regions = free_regions(s, d, 0.0, place)
        busy = sum(place["finish"][k] - place["start"][k] for k, dev in place["device"].items() if dev == d)
        assert sum(b - a for a, b in regions) == pytest.approx(end - busy)
        assert all(b > a for a, b in regions)
        inner += sum(1 for a, b in regions if b < end)
    assert inner > 0


def test_unoverlapped_allreduce_fills_free_regions_first():
    """Short all-reduces fit into the free regions, except the one of the replica whose last backward is the
    step's last op (nothing is left to overlap it); beyond the regions every extra second of all-reduce
    (two per device: two replicas) is a second of step time."""
    from jaxpipe.tune.perf_model import unoverlapped_allreduce

    s = schedules.build("chimera", 6, 6)
    un = lambda alpha: unoverlapped_allreduce(s, _costs(6, alpha=alpha), grad_bytes=0, replicas=2)
    assert un(1e-3) == pytest.approx(2 * 1e-3)  # exactly one all-reduce (2 alpha) stays exposed
    big1, big2 = un(100.0), un(200.0)  # allreduce(0 bytes, 2 replicas) = 2 alpha
    assert big2 - big1 == pytest.approx(2 * 2 * 100.0)
