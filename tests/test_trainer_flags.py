"""``experiments.train``'s own inputs checked before it trains, each refusal naming its flag: a path that
cannot be written (``--save_params``, ``--out_dir``, ``--compilation_cache_dir``), flags of the runner's own
models given to a user's factory (they were ignored and written to ``config.flags`` as if they applied), and a
factory returning a dict with a misspelt key."""

import os
import subprocess
import sys

import pytest

from helpers import SUBPROCESS_XLA_FLAGS

# CI's second leg leaves these out (tests/conftest.py): the runner's own flag handling
pytestmark = pytest.mark.ci_once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = [
    "--model=mlp",
    "--stages=2",
    "--microbatches=2",
    "--batch=8",
    "--steps=2",
    "--eval_every=0",
    "--progress=false",
    "--d_model=16",
]


def _train(args, tmp_path, pythonpath=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, ROOT])
    p = subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--out_dir={tmp_path}/run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return p.returncode, p.stdout + p.stderr


def test_a_save_params_path_that_cannot_be_written_is_refused_before_training(tmp_path):
    rc, out = _train(MLP + [f"--save_params={tmp_path}/missing/p.npz"], tmp_path)
    assert (
        rc == 2
        and f"--save_params={tmp_path}/missing/p.npz: the directory {tmp_path}/missing does not exist" in out
    ), out[-2000:]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # nothing trained


def test_an_out_dir_or_cache_dir_that_is_a_file_is_named(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    rc, out = _train(MLP + [f"--out_dir={a_file}"], tmp_path)
    assert rc == 2 and f"--out_dir={a_file}: a file is there, not a directory" in out, out[-2000:]
    rc, out = _train(MLP + [f"--compilation_cache_dir={a_file}"], tmp_path)
    assert rc != 0 and f"--compilation_cache_dir={a_file}: cannot be a directory" in out, out[-2000:]


def test_the_runners_model_flags_are_refused_for_a_users_factory(tmp_path):
    rc, out = _train(
        [
            "--model=examples.own_transformer:factory",
            "--stages=2",
            "--cut=3,2,2,1",
            "--steps=1",
            "--progress=false",
        ],
        tmp_path,
    )
    assert rc != 0 and "--cut=3,2,2,1: flag(s) of the runner's own models" in out, out[-2000:]
    assert not os.path.exists(tmp_path / "run" / "config.flags")


def test_a_factorys_dict_with_a_misspelt_key_is_named_with_the_fields(tmp_path):
    (tmp_path / "my_factory.py").write_text(
        "import jaxpipe as jp\n"
        "def factory(stages, batch, seed):\n"
        "    return {'model': jp.models.residual_mlp(stages, 4, 2, width=8), 'batchs': lambda: iter([])}\n"
    )
    rc, out = _train(
        ["--model=my_factory:factory", "--stages=2", "--steps=1", "--progress=false"],
        tmp_path,
        pythonpath=str(tmp_path),
    )
    assert rc != 0 and "unknown key 'batchs' (did you mean 'batches'?)" in out and "no 'batches'" in out, out[
        -2000:
    ]


@pytest.mark.parametrize(
    "flag,match",
    [
        (
            "--memory_budget_mb=-5",
            r"--memory_budget_mb=-5: give the MiB a device may hold \(> 0\), or 0 for no limit",
        ),
        ("--memory_budget_mb=nan", r"--memory_budget_mb=nan: give the MiB"),
        ("--auto_schedules=nope", r"--auto_schedules=nope: 'nope' is not one; --auto chooses among 1f1b"),
        ("--auto_microbatches=3", r"--auto_microbatches=3: none of them splits --batch=8 rows"),
        ("--auto_microbatches=x", r"--auto_microbatches=x: give positive micro-batch counts"),
    ],
)
def test_the_auto_flags_are_checked_by_name(tmp_path, flag, match):
    import re

    rc, out = _train(MLP + ["--auto", flag], tmp_path)
    assert rc != 0 and re.search(match, out), out[-2000:]
