"""Issue #52's bar: a user's own NNX model (``examples/own_transformer.py``'s, with a tied head, padding masks
and dropout) trains through ``experiments.train --model=package.module:factory`` from a config file, is
stopped by SIGTERM and resumes bit-equal -- from the config the first run saved --, runs on two processes
through the launcher, and TensorBoard reads its events.  The same runs check the learning-rate schedule by
name and the runners' compilation cache (on in a directory given, off with '')."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from helpers import SUBPROCESS_XLA_FLAGS, read_events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = [
    "--model=examples.own_transformer:factory",
    "--schedule=1f1b",
    "--stages=2",
    "--microbatches=2",
    "--batch=8",
    "--steps=5",
    "--eval_every=2",
    "--progress=false",
    "--tensorboard=true",
    "--lr_schedule=linear",
    "--warmup=2",
]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)


def _losses(out_dir):
    return [json.loads(l)["loss"] for l in open(os.path.join(out_dir, "metrics.jsonl"))]


def _train(args, timeout=300, env=None):
    p = subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=ROOT,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p.returncode, p.stdout + p.stderr


def test_own_model_from_a_config_file_stops_on_sigterm_and_resumes_bit_equal(tmp_path):
    config = tmp_path / "own.flags"
    config.write_text("\n".join(CONFIG) + "\n")
    cache = tmp_path / "cache"
    rc, out = _train(
        [
            f"--flagfile={config}",
            f"--out_dir={tmp_path}/ref",
            f"--compilation_cache_dir={cache}",
            f"--save_params={tmp_path}/own.npz",
        ],
        env=dict(_env(), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"),
    )
    assert rc == 0, out[-3000:]
    # the trained parameters in the NNX modules' own layout (the factory gives to_modules), by their paths
    saved = np.load(tmp_path / "own.npz")
    assert "blocks/0/attn/key/kernel" in saved.files and any(f.startswith("embed/") for f in saved.files), (
        saved.files[:8]
    )
    assert not any(f.startswith(("stages/", "arr_")) for f in saved.files)
    assert any(cache.iterdir()), "the run kept no compiled program in --compilation_cache_dir"
    ref = _losses(tmp_path / "ref")
    assert len(ref) == 5 and np.all(np.isfinite(ref))
    events = read_events(tmp_path / "ref" / "tensorboard")
    assert [s for s, _ in events["loss"]] == [1, 2, 3, 4, 5] and [s for s, _ in events["eval_loss"]] == [
        2,
        4,
        5,
    ]
    np.testing.assert_allclose([v for _, v in events["loss"]], ref, rtol=1e-6)
    # --lr_schedule=linear --warmup=2: up to the default --lr 3e-3 in 2 steps, then down to 0 over the other 3
    lr = [json.loads(l)["lr"] for l in open(tmp_path / "ref" / "metrics.jsonl")]
    np.testing.assert_allclose(lr, [0.0, 1.5e-3, 3e-3, 2e-3, 1e-3], rtol=1e-6)

    ck, run = tmp_path / "ck", tmp_path / "run"
    # (this run and the resume compile nothing: the first run's programs are in its cache)
    args = [
        f"--flagfile={config}",
        f"--out_dir={run}",
        f"--checkpoint_dir={ck}",
        "--checkpoint_every=0",
        f"--compilation_cache_dir={cache}",
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *args, "--throttle_s=0.5"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log, deadline = run / "metrics.jsonl", time.monotonic() + 240
    while time.monotonic() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 2):
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 143, out[-3000:]
    stopped = len(_losses(run))
    assert 2 <= stopped < 5, out[-2000:]
    # resumed from the configuration the first run saved (its --out_dir and the checkpoint's given again)
    rc, out = _train([f"--flagfile={tmp_path / 'ref' / 'config.flags'}", *args[1:]])
    assert rc == 0 and f"resumed from {ck} at step {stopped}" in out, out[-3000:]
    assert _losses(run) == ref  # bit for bit: the same batches, dropout keys and optimizer state


def test_own_model_runs_on_two_processes_through_the_launcher(tmp_path):
    unused = tmp_path / "unused"  # '' turns the compilation cache off, whatever the environment says
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.launch",
            "--num_processes=2",
            "--",
            *[a for a in CONFIG if not a.startswith("--steps")],
            "--steps=3",
            f"--out_dir={tmp_path}/run",
            "--compilation_cache_dir=",
        ],
        cwd=ROOT,
        env=dict(_env(), JAX_COMPILATION_CACHE_DIR=str(unused)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert not unused.exists() or not any(unused.iterdir())
    losses = _losses(tmp_path / "run")
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["processes"] == 2 and summary["model"] == "examples.own_transformer:factory"
