"""The ``jaxpipe`` command from a built wheel, installed in a fresh virtual environment and run outside the
repository: every command's ``--help``, and a user's own model factory trained by ``jaxpipe train``."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from helpers import SUBPROCESS_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FACTORY = textwrap.dedent('''
    """A user's own model: two stages of tanh(x @ w), a mean-squared-error head, random regression batches."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import jaxpipe as jp


    def factory(stages, batch, seed):
        keys = jax.random.split(jax.random.key(seed), stages)
        model = jp.PipelineModel(
            stage_fn=lambda w, x: jnp.tanh(x @ w),
            stage_params=jp.stack_stages([0.3 * jax.random.normal(k, (8, 8)) for k in keys]),
            pre=lambda p, b: b["x"], pre_params=(),
            post_loss=lambda p, h, b: jnp.mean((h - b["y"]) ** 2), post_params=())

        def batches():
            rng = np.random.default_rng(seed)
            while True:
                x = rng.normal(size=(batch, 8)).astype(np.float32)
                yield {"x": x, "y": np.sin(x)}
        return {"model": model, "batches": batches, "eval_batches": [next(batches())]}
''')


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A virtual environment holding the wheel built from this tree (its dependencies: this Python's)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # the packaging files and the package: setuptools builds in the tree given
    shutil.copytree(
        os.path.join(ROOT, "jaxpipe"), source / "jaxpipe", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next((root / "dist").glob("jaxpipe-*.whl"))
    venv = root / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120
    )
    subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=SUBPROCESS_XLA_FLAGS, PATH=f"{venv / 'bin'}:{env['PATH']}")
    return venv, env, root


def _run(args, env, cwd, timeout=300):
    p = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.ci_once
def test_the_wheel_gives_the_jaxpipe_command_and_trains_a_users_factory(installed, tmp_path):
    venv, env, root = installed
    jaxpipe = str(venv / "bin" / "jaxpipe")
    rc, out = _run(
        [str(venv / "bin" / "python"), "-c", "import jaxpipe; print(jaxpipe.__file__)"], env, tmp_path
    )
    assert rc == 0 and out.strip().startswith(str(venv)), out  # the wheel's copy, not this tree
    rc, out = _run([jaxpipe, "--version"], env, tmp_path)
    from jaxpipe import __version__

    assert rc == 0 and out.strip() == f"jaxpipe {__version__}", out
    rc, out = _run([jaxpipe], env, tmp_path)
    assert rc == 2 and all(c in out for c in ("train", "launch", "configure", "timeline")), out
    rc, out = _run([jaxpipe, "trian"], env, tmp_path)
    assert rc == 2 and "unknown command 'trian'" in out, out
    wants = {
        "train": "--checkpoint_dir",
        "launch": "--num_processes",
        "configure": "--memory_budget_mb",
        "timeline": "--mode",
    }
    for command, flag in wants.items():
        rc, out = _run([jaxpipe, command, "--help"], env, tmp_path)
        assert rc == 0 and flag in out and f"jaxpipe {command}" in out, (command, out[-1500:])
    rc, out = _run([jaxpipe, "timeline", "--schedule=zb_v", "--stages=4", "--out=zb_v.png"], env, tmp_path)
    assert rc == 0 and (tmp_path / "zb_v.png").stat().st_size > 0, out[-1500:]

    # a schedule of the user's own, in PyTorch's CSV format: 1F1B on 2 devices, 2 micro-batches, by hand
    (tmp_path / "my_1f1b.csv").write_text("0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n")
    rc, out = _run([jaxpipe, "timeline", "--schedule=my_1f1b.csv", "--out=mine.png"], env, tmp_path)
    assert rc == 0 and "my_1f1b: D=2 M=2" in out and (tmp_path / "mine.png").stat().st_size > 0, out[-1500:]

    (tmp_path / "my_model.py").write_text(FACTORY)
    rc, out = _run(
        [
            jaxpipe,
            "train",
            "--model=my_model:factory",
            "--schedule=my_1f1b.csv",
            "--stages=2",
            "--microbatches=2",
            "--batch=8",
            "--steps=3",
            "--eval_every=0",
            "--progress=false",
            f"--out_dir={tmp_path}/run",
            "--compilation_cache_dir=",
        ],
        env,
        tmp_path,
    )
    assert rc == 0 and "my_1f1b.csv, mesh data=1 x stage=2" in out, out[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and "final_loss" in out.replace(" ", "") or "loss" in out, out[-2000:]
