"""The peer benchmark (``experiments.peer``): its table from per-round times, its refusal without PyTorch, and
jaxpipe's side of it -- two processes serving rounds on standard input -- run end to end at a tiny size.
PyTorch's side runs where ``PEER_PYTHON`` names a Python with torch (CI has none)."""

import json
import os
import subprocess
import sys

import pytest
from absl import app


from experiments import peer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_table_takes_each_ratio_round_by_round_and_leaves_jaxpipe_only_rows_without_a_peer():
    # the machine slows by 2x in rounds 2 and 3, both libraries alike: every ratio holds in every round
    times = {
        "jaxpipe": {
            "4,plain": [2.0, 4.0, 4.0],
            "4,1f1b": [1.0, 2.0, 2.0],
            "4,zb_v": [1.2, 2.4, 2.4],
            "4,zb_v:lanes": [1.1, 2.2, 2.2],
        },
        "torch": {"4,plain": [3.0, 6.0, 6.0], "4,1f1b": [1.25, 2.5, 2.5], "4,zb_v": [1.0, 2.0, 2.0]},
    }
    rows = {r.schedule: r for r in peer.table(times, ["1f1b", "zb_v"], ["zb_v:lanes"])}
    assert list(rows) == ["plain", "1f1b", "zb_v", "zb_v:lanes"]
    assert rows["zb_v"].jaxpipe_to_1f1b == pytest.approx((1.2, 0.0))
    assert rows["zb_v"].torch_to_1f1b == pytest.approx((0.8, 0.0))
    assert rows["1f1b"].jaxpipe_to_torch == pytest.approx((0.8, 0.0))
    assert rows["zb_v"].jaxpipe == 2.4 and rows["zb_v"].torch == 2.0
    lanes = rows["zb_v:lanes"]
    assert lanes.torch is None and lanes.jaxpipe_to_torch is None
    assert lanes.jaxpipe_to_1f1b == pytest.approx((1.1, 0.0))
    text = peer.report(list(rows.values()), "jax x, torch y").splitlines()
    assert text[1].startswith("| M | schedule | jaxpipe ms | PyTorch ms")
    assert text[5] == "| 4 | zb_v | 2400.0 | 2000.0 | 1.200 +- 0.000 | 0.800 +- 0.000 | 1.200 +- 0.000 |"
    assert text[6] == "| 4 | zb_v:lanes | 2200.0 |  | 1.100 +- 0.000 |  |  |"
    # the sketch's rows: each to the sketch's own two-lane 1F1B, not to jaxpipe's
    times["jaxpipe"].update({"4,sketch_1f1b": [0.5, 1.0, 1.0], "4,sketch_interleaved": [0.6, 1.3, 1.2]})
    rows = {r.schedule: r for r in peer.table(times, ["1f1b", "zb_v"])}
    assert list(rows)[-2:] == list(peer.SKETCH_ROWS)
    assert rows["sketch_interleaved"].jaxpipe_to_1f1b[0] == pytest.approx(1.2)
    assert rows["sketch_interleaved"].torch is None


def test_the_plot_draws_the_table(tmp_path):
    times = {
        "jaxpipe": {
            "4,plain": [2.0, 2.1, 2.2],
            "4,1f1b": [1.0, 1.0, 1.1],
            "4,zb_v": [0.9, 1.0, 1.0],
            "4,sketch_1f1b": [1.0, 1.0, 1.0],
            "4,sketch_interleaved": [1.0, 1.1, 1.0],
        },
        "torch": {"4,plain": [2.0, 2.0, 2.0], "4,1f1b": [1.0, 1.0, 1.0], "4,zb_v": [0.9, 0.9, 0.9]},
    }
    path = tmp_path / "peer.png"
    peer.plot(peer.table(times, ["1f1b", "zb_v"]), "jax x, torch y", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_without_torch_it_says_how_to_get_the_peer():
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("this Python has torch")
    with pytest.raises(app.UsageError, match=r"cannot import torch.*jaxpipe\[peer\].*--peer_python"):
        peer.peer_python(sys.executable)


def _serving_pair(module_args, label):
    # the pipelines' default: op costs measured at the first step, the same on both processes (process 0's)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXPIPE_OP_COSTS": "measure"}
    return peer.Pair(label, [module_args(rank) for rank in (0, 1)], env)


@pytest.mark.ci_once
def test_jaxpipes_workers_serve_a_round_for_each_line_and_stop_on_quit():
    args = ["--layers=4", "--width=16", "--batch=8", "--microbatches=2"]
    args += ["--schedules=1f1b,zb_h1,gpipe:ordered", "--sketch"]
    pair = _serving_pair(
        lambda p: [
            sys.executable,
            "-m",
            "experiments.two_devices",
            *args,
            "--port=12447",
            "--serve",
            f"--worker={p}",
        ],
        "jaxpipe",
    )
    try:
        ready = pair.answers()
        assert ready[1] == {"ready": True} and ready[0]["ready"] is True
        plans = ready[0]["plans"]  # placed at the first step for costs measured on both processes
        assert (
            set(plans) == {"2,1f1b", "2,zb_h1", "2,gpipe:ordered"}
            and plans["2,gpipe:ordered"][0] == "ordered"
        )
        assert all(len(costs) == 4 and costs[0] > 0 for _, costs in plans.values())
        for _ in range(2):
            first, second = pair.ask("round")
            assert set(first) == {"2,1f1b", "2,zb_h1", "2,gpipe:ordered", "2,plain"} | {
                f"2,{name}" for name in peer.SKETCH_ROWS
            }
            assert second == {}
            assert all(t > 0 for t in first.values())
    finally:
        pair.close()
    assert [p.returncode for p in pair.procs] == [0, 0], pair.tails()


@pytest.mark.skipif(not os.environ.get("PEER_PYTHON"), reason="PEER_PYTHON: a Python with torch")
def test_pytorchs_workers_are_exact_and_serve_rounds():
    args = ["--layers=4", "--width=16", "--batch=8", "--microbatches=2", "--schedules=1f1b,zb_v"]
    pair = _serving_pair(
        lambda r: [os.environ["PEER_PYTHON"], "-m", "experiments.torch_peer", str(r), "12449", *args],
        "PyTorch",
    )
    try:
        assert "ready" in pair.answers()[0]
        worst = pair.ask("check")[0]
        assert set(worst) == {"2,1f1b", "2,zb_v"} and max(worst.values()) < 1e-5, json.dumps(worst)
        assert set(pair.ask("round")[0]) == {"2,1f1b", "2,zb_v", "2,plain"}
    finally:
        pair.close()
