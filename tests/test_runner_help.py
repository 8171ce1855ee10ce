"""Every runner answers ``--help`` with exit 0 and the flags it reads (those it takes from another module
too), and every module in ``experiments/`` is a runner listed with its question or a named helper."""

import ast
import os
import subprocess
import sys

import pytest

import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = {
    "__init__",
    "bench",
    "one_device",
    "profiling",
    "sketch_interleaved",
    "sketch_two_lane",
    "torch_peer",
}
#: flags a runner's --help must list beside its docstring (the ones it takes from another module included)
MUST_LIST = {
    "train": ["--schedule", "--checkpoint_dir", "zb_v", "dualpipe_v", "--compilation_cache_dir"],
    "schedule_choice": ["--devices", "--microbatches", "--cores", "flags of experiments.executor_cost"],
    "launch": ["--num_processes", "--stall_timeout"],
    "configure": ["--memory_budget_mb", "--auto_schedules", "flags of jaxpipe.cli.train"],
    "timeline": ["--schedule", "--mode"],
}


def _doc(name):
    """The runner's docstring (for a command of ``jaxpipe``, the command's), read without importing it."""
    cli = os.path.join(ROOT, "jaxpipe", "cli", f"{name}.py")
    path = cli if os.path.exists(cli) else os.path.join(ROOT, "experiments", f"{name}.py")
    with open(path) as fh:
        return ast.get_docstring(ast.parse(fh.read())).strip()


def test_every_module_in_experiments_is_a_listed_runner_or_a_helper():
    modules = {f[:-3] for f in os.listdir(os.path.join(ROOT, "experiments")) if f.endswith(".py")}
    assert modules - HELPERS == set(experiments.RUNNERS), (
        "list each runner in experiments.RUNNERS with its question"
    )
    assert all(q.strip() for q in experiments.RUNNERS.values())


@pytest.mark.ci_once
def test_every_runners_help_exits_0_and_lists_its_flags():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    names, outs = list(experiments.RUNNERS), {}
    for start in range(0, len(names), 4):  # four at a time: each imports its libraries
        procs = {
            n: subprocess.Popen(
                [sys.executable, "-m", f"experiments.{n}", "--help"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for n in names[start : start + 4]
        }
        for n, p in procs.items():
            outs[n] = (p.communicate(timeout=300)[0], p.returncode)
    for name, (out, rc) in outs.items():
        assert rc == 0, (name, out[-2000:])
        assert _doc(name).splitlines()[0] in out, (name, out[:500])  # its docstring, then its flags
        assert "flags of" in out, (name, out[-1000:])
        for want in MUST_LIST.get(name, []):
            assert want in out, (name, want, out[-2000:])


def test_every_runner_imports_beside_every_other_without_defining_a_flag():
    """A runner's flags are defined when it runs, not when it is imported: a program (or a test) that imports
    two runners sharing a flag name (``--stages``, ``--schedules``) gets no ``DuplicateFlagError``."""
    code = (
        "import importlib, pkgutil, experiments, jaxpipe.cli\n"
        "from absl import flags\n"
        "for package in (experiments, jaxpipe.cli):\n"
        "    for m in pkgutil.iter_modules(package.__path__):\n"
        "        importlib.import_module(f'{package.__name__}.{m.name}')\n"
        "print(sorted(m for m in flags.FLAGS.flags_by_module_dict() if not m.startswith('absl')))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['jaxpipe.cli.common']", out.stdout  # the shared --compilation_cache_dir


def test_a_runners_flag_definitions_run_once_however_often_asked():
    """``define_flags`` is called by the runner and by each runner that takes its flags (configure takes
    train's, op_profile throughput's): a second call defines nothing again."""
    code = (
        "import sys\n"
        "from absl import flags\n"
        "if sys.argv[1] == 'train':\n"
        "    from jaxpipe.cli import configure, train\n"
        "    for define in (train.define_flags, configure.define_flags, train.define_flags):\n"
        "        define()\n"
        "    print(flags.FLAGS['schedule'].default)\n"
        "else:\n"
        "    from experiments import op_profile, throughput\n"
        "    for define in (throughput.define_flags, op_profile.define_flags, op_profile.define_flags):\n"
        "        define()\n"
        "    print(flags.FLAGS['trace_dir'].default)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for runner, want in (("train", "1f1b"), ("op_profile", "/tmp/jaxpipe_op_profile")):
        out = subprocess.run(
            [sys.executable, "-c", code, runner], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, (runner, out.stderr[-2000:])
        assert out.stdout.strip() == want, (runner, out.stdout)
