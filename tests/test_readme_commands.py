"""Every `python -m experiments.X` command in README.md's bash blocks runs as written (issue #14), in a quick
mode: the README's flags first, then small flags appended for that runner (absl: a later flag wins), in a
scratch directory (relative output paths land there), each bounded by its subprocess timeout."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import SUBPROCESS_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [
    "--steps=2",
    "--eval_every=0",
    "--sample_len=8",
    "--progress=false",
    "--batch=16",
    "--seq_len=16",
    "--auto_schedules=1f1b",
    "--auto_microbatches=2",
]  # the last two: --auto's search, small
QUICK = {
    "train": TRAIN,
    # throughput and convergence run every method by default; here a synchronous, an asynchronous and a
    # cyclic one (each method's numbers are tested elsewhere), which halves the file's CI time
    "convergence": [
        "--task=digits",
        "--seeds=1",
        "--steps=2",
        "--eval_every=1",
        "--batch=16",
        "--schedules=gpipe,pipeoptim",
    ],
    "timeline": [],
    "bubbles": [],
    "throughput": [
        "--steps=1",
        "--compile_m2=0",
        "--layers=8",
        "--width=32",
        "--batch=64",
        "--schedules=1f1b,chimera,pipedream,cdp_dp_v1",
    ],
    "op_profile": ["--schedules=chimera,cdp_dp_v1", "--steps=1", "--layers=4", "--width=32", "--batch=64"],
    "tune": [
        "--devices=4",
        "--layers=4",
        "--width=32",
        "--batch=16",
        "--validate=1",
        "--micro_batch_sizes=4",
    ],
    "tune_avgpipe": ["--devices=4", "--width=32", "--batch=16", "--ms=1,2", "--ns=1", "--steps=1"],
    "executor_cost": [
        "--width=32",
        "--batch=64",
        "--rounds=1",
        "--schedules=1f1b,zb_v",
        "--profile=traces",  # each program traced and its operation kinds printed
    ],
    "schedule_choice": [
        "--width=32",
        "--batch=64",
        "--rounds=1",
        "--devices=4",
        "--microbatch_counts=8",
        "--real_layers=8",
    ],
    "accelerator_cost": ["--small", "--timed", "--steps=2", "--microbatches=2"],
    "loop_overhead": ["--width=16", "--rows=8", "--steps=5", "--rounds=1"],
    # (--link_thread=shared: the runner's default puts each process's Gloo thread at SCHED_IDLE, which starves
    # beside the suite's other workers -- 25 s alone, 95-101 s beside three workers)
    "two_devices": [
        "--width=32",
        "--layers=4",
        "--batch=16",
        "--microbatches=4",
        "--schedules=1f1b,zb_h1",
        "--rounds=1",
        "--measure_ops",
        "--link_thread=shared",
    ],
    # two pinned processes, tiny loops: one repeat of three rounds
    "tick_price": [
        "--width=32",
        "--layers=2",
        "--rows=4",
        "--repeats=1",
        "--rounds=3",
        "--link_thread=shared",
    ],
    "program_text": ["--only=1f1b", "--models=mlp"],
    "cuts": [
        "--blocks=5",
        "--even_blocks=8",
        "--d_model=16",
        "--heads=2",
        "--vocab=64",
        "--seq_len=8",
        "--batch=8",
        "--microbatches=4",
        "--rounds=1",
        "--cores=0",
    ],
}


#: the pages whose bash blocks run here: the front page, Getting started and the guide
PAGES = ["README.md", "docs/getting_started.md"] + sorted(
    os.path.join("docs", "guide", f)
    for f in os.listdir(os.path.join(ROOT, "docs", "guide"))
    if f.endswith(".md")
)


def readme_commands():
    text = "\n".join(open(os.path.join(ROOT, p)).read() for p in PAGES)
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("pip install") and "&&" in line:
                line = line.split("&&", 1)[1].strip()  # the install step is the CI's own
            if line.startswith("jaxpipe "):  # the installed command, run as python -m jaxpipe (the same code)
                line = "python -m " + line
            if line.startswith(("python -m experiments.", "python -m jaxpipe ")) and line not in out:
                out.append(line)
    return out


def runner_of(cmd):
    """``train`` of ``python -m jaxpipe train ...`` and of ``python -m experiments.train ...``."""
    args = cmd.split()
    return args[3] if args[2] == "jaxpipe" else args[2].split(".", 1)[1]


COMMANDS = readme_commands()


def quick(cmd):
    """The command with its runner's quick flags appended (after the launcher's ``--`` for launch)."""
    args = shlex.split(cmd.rstrip("&").strip())
    runner = runner_of(cmd)
    own = [a for a in args if a.startswith("--model=") and ":" in a]
    # a user's factory builds its model itself: the runner's own model flags (--seq_len, ...) are refused
    # there
    from jaxpipe.cli.factories import MODEL_FLAGS

    train = [a for a in TRAIN if not own or a[2:].split("=")[0] not in MODEL_FLAGS]
    if runner == "launch":
        return args + train
    return args + (train if runner == "train" else QUICK[runner])


def test_the_readme_has_commands_for_every_runner_listed():
    runners = {runner_of(c) for c in COMMANDS}
    assert runners - {"launch"} <= set(QUICK), f"add quick flags for {runners - set(QUICK) - {'launch'}}"
    assert {"train", "timeline", "throughput", "launch"} <= runners


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if not c.endswith("&") and "--process_id=1" not in c])
def test_readme_command_runs(cmd, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # each runner sets its own device count
    p = subprocess.run(
        [sys.executable if a == "python" else a for a in quick(cmd)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr
    if "--auto" in cmd:  # the run trains what jp.configure chose (issue #53 item 1)
        chose = re.search(
            r"--auto chose: --stages=(\d+) --data=(\d+)(?: --(?:tensor|fsdp)=\d+)* --schedule=(\S+) "
            r"--microbatches=(\d+)",
            p.stdout,
        )
        assert chose, p.stdout[-2000:]
        stages, data, schedule, m = chose.groups()
        assert f"{schedule}, mesh data={data} x stage={stages}" in p.stdout and f"M={m}," in p.stdout, (
            p.stdout[-2000:]
        )


def test_readme_two_process_commands_run(tmp_path):
    """The two manually started processes (the first with '&') train together, both exit 0, and neither
    prints gloo's connection chatter (dropped unless --verbose) nor loses its own output."""
    pair = [c for c in COMMANDS if "--num_processes=2 --process_id=" in c]
    assert len(pair) == 2
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # each runner sets its own device count
    procs = []
    for c in pair:
        args = [sys.executable if a == "python" else a for a in quick(c)]
        args = [a.replace("12355", str(12355 + os.getpid() % 1000)) for a in args]
        procs.append(
            subprocess.Popen(
                args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=420) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, f"{o[-2000:]}\n{e[-3000:]}"
        assert "[Gloo]" not in o + e, o[:2000]
    assert "final" in outs[0][0].lower() or "loss" in outs[0][0].lower(), outs[0][0][-2000:]


def test_readme_api_snippet_runs(tmp_path):
    """The README's first Python block ("The API in ten lines") runs as written in a fresh process."""
    text = open(os.path.join(ROOT, "README.md")).read()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    assert "import jaxpipe" in code
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # a user's fresh process: the snippet sets the device count only if unset
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "1f1b: D=4 M=8" in p.stdout


def test_ci_runs_the_readmes_test_command_verbatim():
    """`.ci/run`'s first leg is the README's test command, character for character (its comment aside)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    wanted = [
        l.split("  #")[0].rstrip()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for l in block.splitlines()
        if "pytest" in l and l.startswith("pip install")
    ]
    assert len(wanted) == 1, wanted
    assert wanted[0] in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
