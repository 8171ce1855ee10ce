"""jaxpipe's schedules beside PyTorch's own (``torch.distributed.pipelining``) on the same two devices, in one
session.

The testbed of :mod:`experiments.two_devices`: two processes, each pinned to its own core, are a real pipeline
(an MLP of ``--layers`` ``tanh(h @ W)`` layers, W ``--width``², batch ``--batch``, SGD). jaxpipe's pair
(``two_devices --serve``, Gloo collectives, default options: each pipeline measures its op costs at its first
step) builds and warms up its schedules first, then PyTorch's pair (:mod:`experiments.torch_peer`, Gloo, one
thread) does, so that nothing else runs on the cores while jaxpipe measures. Then the rounds alternate between
the two libraries (jaxpipe first in odd rounds, PyTorch first in even ones), one pair running while the other
waits on its standard input, so a slow phase of the machine touches both alike; within a round every schedule
runs 3 steps in turn. The table: the median step of each schedule in each library, its ratio to the same
library's 1F1B (median of the per-round ratios, +- half their interquartile range) and jaxpipe's step over
PyTorch's.

    python -m experiments.peer                                   # M = 4 and 8, the six shared schedules
    python -m experiments.peer --microbatches=4 --schedules=1f1b,zb_h1 --rounds=5
    python -m experiments.peer --peer_python=/path/to/venv/bin/python --json=peer.json --plot=peer.png

PyTorch comes from ``--peer_python`` (a Python with ``torch``, e.g. a virtual environment of its own:
``python3 -m venv VENV && VENV/bin/pip install torch numpy``), else from this Python if it imports
``torch`` (``pip install "jaxpipe[peer]"``).  Needs a quiet machine with two cores.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import List, NamedTuple, Optional, Sequence, Tuple

from absl import app, flags

from jaxpipe.cli import common as cli


@functools.cache
def define_flags():
    """The runner's flags, defined only when it runs (a test that imports the module to check its table
    defines none that would clash with another runner's)."""
    flags.DEFINE_string(
        "schedules",
        "1f1b,gpipe,interleaved_1f1b,zb_h1,zb_v,dualpipe_v",
        "comma-separated schedules both libraries have (experiments.torch_peer.SCHEDULES); 1f1b is the base",
    )
    flags.DEFINE_string(
        "extra",
        "",
        "comma-separated jaxpipe-only runs shown beside them (no PyTorch column), e.g. zb_v:lanes for "
        "ZB-V in its other placement (two_devices' name:placement), or a schedule file "
        "tests/data/torch_zbv_d2_m{M}.csv",
    )
    flags.DEFINE_bool(
        "sketch",
        True,
        "also time the interleaved sketch and its two-lane 1F1B in jaxpipe's pair (two_devices --sketch): "
        "the rows sketch_interleaved (x the sketch's own 1F1B) and sketch_1f1b",
    )
    flags.DEFINE_string("microbatches", "4,8", "comma-separated M values")
    flags.DEFINE_integer("layers", 8, "tanh layers in the model")
    flags.DEFINE_integer("width", 1024, "layer width")
    flags.DEFINE_integer("batch", 256, "rows per step")
    flags.DEFINE_enum(
        "stage_form",
        "scan",
        ["scan", "apart"],
        "how jaxpipe's model holds a stage's layers, its plain step's alike (two_devices --stage_form): one "
        "stacked array run by a lax.scan, or one array per layer as PyTorch's model holds them",
    )
    flags.DEFINE_integer("rounds", 9, "timing rounds per library (3 steps of each schedule each)")
    flags.DEFINE_integer("port", 12431, "jaxpipe's coordinator port on 127.0.0.1 (PyTorch's: the next one)")
    flags.DEFINE_string("peer_python", "", "a Python that imports torch (default: this one)")
    flags.DEFINE_bool("check", True, "first check each PyTorch schedule's gradients against its plain step")
    flags.DEFINE_string("json", "", "also write the per-round times and the table to this file")
    flags.DEFINE_string(
        "plot",
        "",
        "also draw the table to this PNG: per M, each schedule over its own library's 1F1B (both libraries, "
        "with their spreads, the sketch's interleaved as a line) and jaxpipe's step over PyTorch's",
    )


FLAGS = flags.FLAGS
#: where ``python -m experiments.<worker>`` finds the workers
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peer_python(given: str = "") -> str:
    """The Python that runs PyTorch's side (``given``, else this one), or a usage error that says how to get
    one."""
    exe = given or sys.executable
    probe = subprocess.run(
        [exe, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        raise app.UsageError(
            f"{exe} cannot import torch: install the peer (pip install 'jaxpipe[peer]'), or make a virtual "
            "environment for it (python3 -m venv VENV && VENV/bin/pip install torch numpy) and pass "
            "--peer_python=VENV/bin/python"
        )
    return exe


class Pair:
    """One library's two worker processes, a core each, talking a line at a time (``round`` -> JSON)."""

    def __init__(self, label: str, commands, env):
        self.label = label
        self.logs = [tempfile.TemporaryFile("w+") for _ in commands]
        self.procs = [
            subprocess.Popen(
                ["taskset", "-c", str(core), *cmd],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                cwd=REPOSITORY,
            )
            for core, (cmd, log) in enumerate(zip(commands, self.logs))
        ]

    def answers(self):
        """Each process's next JSON line (rank 0's first), or SystemExit with the end of their output."""
        out = []
        for proc in self.procs:
            line = proc.stdout.readline()
            while line and not line.startswith("{"):
                line = proc.stdout.readline()
            if not line:
                self.close()
                raise SystemExit(f"experiments.peer: {self.label}'s workers stopped:\n{self.tails()}")
            out.append(json.loads(line))
        return out

    def ask(self, command: str):
        for proc in self.procs:
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return self.answers()

    def tails(self) -> str:
        text = []
        for rank, log in enumerate(self.logs):
            log.seek(0)
            text.append(f"--- {self.label}, rank {rank}:\n{log.read()[-2500:]}")
        return "\n".join(text)

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _common():
    return [
        f"--microbatches={FLAGS.microbatches}",
        f"--layers={FLAGS.layers}",
        f"--width={FLAGS.width}",
        f"--batch={FLAGS.batch}",
    ]


def _env():
    from jaxpipe import host_memory

    return {**os.environ, **host_memory.KEEP_FREED_ENV, "OMP_NUM_THREADS": "1"}


def _jax_pair():
    runs = ",".join(filter(None, [FLAGS.schedules, FLAGS.extra]))
    jax_cmd = [sys.executable, "-m", "experiments.two_devices", *_common(), f"--schedules={runs}"]
    jax_cmd.append(f"--stage_form={FLAGS.stage_form}")
    jax_cmd += [f"--port={FLAGS.port}", "--serve"] + (["--sketch"] if FLAGS.sketch else [])
    return Pair("jaxpipe", [jax_cmd + [f"--worker={p}"] for p in (0, 1)], _env())


def _torch_pair(torch_python: str):
    torch_cmd = lambda r: [
        torch_python,
        "-m",
        "experiments.torch_peer",
        str(r),
        str(FLAGS.port + 1),
        *_common(),
        f"--schedules={FLAGS.schedules}",
    ]
    return Pair("PyTorch", [torch_cmd(r) for r in (0, 1)], _env())


def collect(jax_pair, torch_pair, rounds: int):
    """``{library: {"M,schedule": [seconds a step, per round]}}``, the libraries' rounds alternating."""
    times = {"jaxpipe": {}, "torch": {}}
    for r in range(rounds):
        order = ((jax_pair, "jaxpipe"), (torch_pair, "torch"))
        for pair, lib in order if r % 2 == 0 else order[::-1]:
            for key, t in pair.ask("round")[0].items():
                times[lib].setdefault(key, []).append(t)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return times


class Row(NamedTuple):
    """One line of the table: medians in seconds; ratios as ``(median of the rounds, half their IQR)``,
    None where a library has no such run."""

    M: int
    schedule: str
    jaxpipe: float
    torch: Optional[float]
    jaxpipe_to_1f1b: Tuple[float, float]
    torch_to_1f1b: Optional[Tuple[float, float]]
    jaxpipe_to_torch: Optional[Tuple[float, float]]


#: the sketch's rows (``--sketch``), each ratio to the sketch's own two-lane 1F1B
SKETCH_ROWS = ("sketch_1f1b", "sketch_interleaved")


def table(times, schedules: Sequence[str], extra: Sequence[str] = ()) -> List[Row]:
    """The rows, per micro-batch count: the plain step, then ``schedules`` (both libraries), then ``extra``
    (jaxpipe only), then the sketch's where timed (:data:`SKETCH_ROWS`: its ratios to its own 1F1B), from
    ``times`` as :func:`collect` returns them."""
    from experiments.bench import ratio_spread

    rows = []
    for M in sorted({int(k.split(",")[0]) for k in times["jaxpipe"]}):

        def to_base(lib, ts, name):
            base = f"{M},{SKETCH_ROWS[0] if name in SKETCH_ROWS else '1f1b'}"
            return ratio_spread(ts, times[lib][base]) if base in times[lib] else None

        for name in ["plain", *schedules, *extra, *SKETCH_ROWS]:
            j, t = times["jaxpipe"].get(f"{M},{name}"), times["torch"].get(f"{M},{name}")
            if not j:
                continue
            rows.append(
                Row(
                    M,
                    name,
                    statistics.median(j),
                    statistics.median(t) if t else None,
                    to_base("jaxpipe", j, name),
                    to_base("torch", t, name) if t else None,
                    ratio_spread(j, t) if t else None,
                )
            )
    return rows


def _ratio(r) -> str:
    return "" if r is None else f"{r[0]:.3f} +- {r[1]:.3f}"


def report(rows: Sequence[Row], heading: str) -> str:
    """The table in Markdown under ``heading`` (the versions and the workload)."""
    out = [
        f"# {heading}; ratios: median of the rounds +- IQR/2",
        "| M | schedule | jaxpipe ms | PyTorch ms | jaxpipe x its 1F1B | PyTorch x its 1F1B "
        "| jaxpipe / PyTorch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        own = r.schedule not in ("plain", "1f1b", SKETCH_ROWS[0])
        torch_ms = "" if r.torch is None else f"{r.torch * 1e3:.1f}"
        out.append(
            f"| {r.M} | {r.schedule} | {r.jaxpipe * 1e3:.1f} | {torch_ms} "
            f"| {_ratio(r.jaxpipe_to_1f1b) if own else ''} | {_ratio(r.torch_to_1f1b) if own else ''} "
            f"| {_ratio(r.jaxpipe_to_torch)} |"
        )
    return "\n".join(out)


def plot(rows: Sequence[Row], heading: str, path: str) -> None:
    """The table drawn to ``path`` (PNG): a row of two panels per micro-batch count -- each schedule's step
    over its own library's 1F1B, jaxpipe's and PyTorch's bars side by side with their spreads (IQR/2) and
    the interleaved sketch's ratio as a dashed line; and jaxpipe's step over PyTorch's, the plain step
    first."""
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # (its font cache's first build logs at INFO)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r.M for r in rows})
    fig, axes = plt.subplots(len(counts), 2, figsize=(13, 3.6 * len(counts)), squeeze=False)
    for (own_ax, peer_ax), M in zip(axes, counts):
        at_m = [r for r in rows if r.M == M]
        shared = [r for r in at_m if r.schedule not in ("plain", "1f1b", *SKETCH_ROWS) and r.torch_to_1f1b]
        xs = range(len(shared))
        for shift, label, pick in (
            (-0.2, "jaxpipe", lambda r: r.jaxpipe_to_1f1b),
            (0.2, "PyTorch", lambda r: r.torch_to_1f1b),
        ):
            own_ax.bar(
                [x + shift for x in xs],
                [pick(r)[0] for r in shared],
                0.4,
                yerr=[pick(r)[1] for r in shared],
                capsize=3,
                label=label,
            )
        sketch = [r for r in at_m if r.schedule == SKETCH_ROWS[1]]
        if sketch:
            own_ax.axhline(sketch[0].jaxpipe_to_1f1b[0], ls="--", c="gray", label="sketch's interleaved")
        own_ax.axhline(1.0, c="black", lw=0.8)
        own_ax.set_xticks(list(xs), [r.schedule for r in shared], fontsize=8)
        own_ax.set_ylim(0.7, 1.3)
        own_ax.set_ylabel("step / its library's 1F1B")
        own_ax.set_title(f"M = {M}: each schedule over its own 1F1B (lower is faster)", fontsize=10)
        own_ax.legend(fontsize=8)
        both = [r for r in at_m if r.jaxpipe_to_torch]
        peer_ax.bar(
            range(len(both)),
            [r.jaxpipe_to_torch[0] for r in both],
            yerr=[r.jaxpipe_to_torch[1] for r in both],
            capsize=3,
            color="tab:green",
        )
        peer_ax.axhline(1.0, c="black", lw=0.8)
        peer_ax.set_xticks(range(len(both)), [r.schedule for r in both], fontsize=8)
        peer_ax.set_ylabel("jaxpipe's step / PyTorch's")
        peer_ax.set_title(
            f"M = {M}: jaxpipe over PyTorch, same schedule (under 1: jaxpipe faster)", fontsize=10
        )
    fig.suptitle(heading, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def placed(plans) -> str:
    """One line per jaxpipe pipeline: the placement its first step chose, and the op costs it chose it for
    (measured on this testbed unless given)."""
    out = []
    for key, (placement, costs) in sorted(plans.items()):
        M, _, spec = key.partition(",")
        where = (
            ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in zip(("F", "B", "W", "tick"), costs))
            if costs
            else "unit costs"
        )
        out.append(f"jaxpipe M={M} {spec}: {placement}, for {where}")
    return "\n".join(out)


def main(argv):
    del argv
    from experiments.bench import MachineWatch, cpu_model

    if "1f1b" not in FLAGS.schedules.split(","):
        raise app.UsageError("--schedules must include 1f1b: every ratio is to the same library's 1F1B")
    watch = MachineWatch()  # before this run's own work
    torch_python = peer_python(FLAGS.peer_python)
    # jaxpipe's pipelines measure their op costs at their first step: built before PyTorch's pair starts, so
    # that its warm-up does not share their cores (measured beside it, one stage's F moved 2x)
    jax_pair, torch_pair = _jax_pair(), None
    try:
        plans = jax_pair.answers()[0].get("plans", {})  # built and warm
        torch_pair = _torch_pair(torch_python)
        torch_ready = torch_pair.answers()[0]
        import jax

        versions = (
            f"jax {jax.__version__}, torch {torch_ready['ready']}; {FLAGS.layers} x tanh(h @ W), W "
            f"{FLAGS.width}^2, batch {FLAGS.batch}, SGD; jaxpipe's stages: {FLAGS.stage_form}; "
            f"{FLAGS.rounds} rounds alternating, 3 steps each; {cpu_model()}"
        )
        if FLAGS.check:
            worst = torch_pair.ask("check")[0]
            print(
                "PyTorch's gradients against its plain step (max rel. difference): "
                + ", ".join(f"M={k.replace(',', ' ')} {v:.1e}" for k, v in worst.items())
            )
        times = collect(jax_pair, torch_pair, FLAGS.rounds)
    finally:
        jax_pair.close()
        if torch_pair is not None:
            torch_pair.close()
    rows = table(times, FLAGS.schedules.split(","), [e for e in FLAGS.extra.split(",") if e])
    print(report(rows, versions))
    print(placed(plans))
    if FLAGS.plot:
        plot(rows, versions, FLAGS.plot)
        print(f"wrote {FLAGS.plot}")
    spreads = {
        f"M={r.M} {r.schedule} jaxpipe/PyTorch": r.jaxpipe_to_torch for r in rows if r.jaxpipe_to_torch
    }
    print(watch.summary())
    for warning in watch.warnings(spreads):
        print("warning: " + warning)
    if FLAGS.json:
        with open(FLAGS.json, "w") as fh:
            json.dump(
                {
                    "versions": versions,
                    "machine": watch.summary(),
                    "times": times,
                    "rows": [r._asdict() for r in rows],
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    define_flags()
    cli.run(main)
