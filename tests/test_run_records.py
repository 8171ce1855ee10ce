"""Issue #52 items 1-2: a run leaves its resolved configuration as an absl flag file that reruns it, its metrics
as TensorBoard event files (read back here with tensorboardX's own protobuf), and its learning rate follows
the schedule chosen by name."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxpipe as jp
from helpers import SUBPROCESS_XLA_FLAGS, read_events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(args, out_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    p = subprocess.run([sys.executable, "-m", "experiments.train", *args, f"--out_dir={out_dir}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]


def test_a_run_writes_tensorboard_events_and_a_config_that_reruns_it(tmp_path):
    args = ["--model=mlp", "--stages=2", "--microbatches=2", "--batch=8", "--d_model=16", "--steps=4",
            "--eval_every=2", "--progress=false", "--lr_schedule=linear", "--warmup=2", "--tensorboard=true"]
    first = _train(args, tmp_path / "a")
    events = read_events(tmp_path / "a" / "tensorboard")
    assert [s for s, _ in events["loss"]] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in events["loss"]], [r["loss"] for r in first], rtol=1e-6)
    assert [s for s, _ in events["eval_loss"]] == [2, 4]
    # linear warm-up over 2 steps to 3e-3 (the default --lr), then linear decay to 0 over the other 2
    np.testing.assert_allclose([r["lr"] for r in first], [0.0, 1.5e-3, 3e-3, 1.5e-3], rtol=1e-6)
    config = (tmp_path / "a" / "config.flags").read_text()
    assert "--lr_schedule=linear" in config and "--steps=4" in config
    again = _train([f"--flagfile={tmp_path / 'a' / 'config.flags'}", "--tensorboard=false"], tmp_path / "b")
    assert [r["loss"] for r in again] == [r["loss"] for r in first]       # the same run, bit for bit
    assert not (tmp_path / "b" / "tensorboard").exists()


@pytest.mark.parametrize("name", sorted(jp.optim.SCHEDULES))
def test_every_named_schedule_warms_up_linearly_then_never_exceeds_its_peak(name):
    s = jp.optim.schedule_by_name(name, 2.0, 40, warmup=0.1)
    lr = np.asarray([float(s(i)) for i in range(41)])
    np.testing.assert_allclose(lr[:5], [0.0, 0.5, 1.0, 1.5, 2.0], rtol=1e-6)
    assert lr.max() <= 2.0 + 1e-6 and lr[4] == pytest.approx(2.0)
    with pytest.raises(jp.ConfigError, match="unknown learning-rate schedule"):
        jp.optim.schedule_by_name("cosin", 1.0, 10)
