"""The examples in examples/ run as a user runs them, and say what they claim (issue #32 item 2)."""

import os
import re
import subprocess
import sys

from helpers import SUBPROCESS_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_own_transformer_example():
    """A user's NNX transformer (mask, dropout, tied head, padding, bf16) through from_nnx: exact against
    nnx.value_and_grad, trained with 1F1B (checkpointed, resumed) and with PipeDream-2BW, modules back out."""
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4 " + SUBPROCESS_XLA_FLAGS,
    )
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "own_transformer.py"), "--steps=4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = p.stdout
    assert p.returncode == 0, out[-2000:] + p.stderr[-3000:]
    loss, ref, err = re.search(
        r"exactness: loss ([\d.]+) vs ([\d.]+); tied embedding gradient rel. error ([\d.e+-]+)", out
    ).groups()
    assert abs(float(loss) - float(ref)) <= 1e-5 * float(ref) and float(err) <= 1e-5, out
    assert "resumed from the checkpoint of step 2" in out and "1f1b: step 4" in out, out
    assert "pipedream_2bw: step 4" in out, out
    assert "head shares the embedding's Variable: True" in out, out
    final = float(re.search(r"loss on the first batch ([\d.]+)", out).group(1))
    assert final < float(ref), out  # training lowered the loss


def test_drawing_a_schedule_prints_no_stray_log_line(tmp_path):
    """Issue #32 item 6: matplotlib's first font-cache build logged "font_manager ... generated new
    fontManager" through absl's INFO handler into a user's run."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", MPLCONFIGDIR=str(tmp_path / "mpl"))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.timeline",
            "--schedule=1f1b",
            "--stages=4",
            "--microbatches=8",
            f"--out={tmp_path}/t.png",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert os.path.exists(tmp_path / "t.png")
    assert "font_manager" not in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
