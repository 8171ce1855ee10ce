"""Convergence of the asynchronous methods vs GPipe: the small-scale analogue of PipeOptim Table IV, Figs.
2-4.

    python -m experiments.convergence                      # all three tasks below, 3 seeds, D=4
    python -m experiments.convergence --task=digits --optimizer=momentum --schedules=gpipe,pipeoptim

Tasks: ``digits`` (scikit-learn digits, residual MLP classifier; SGD-momentum or AdamW) and ``bytelm``
(byte-level GPT on pydoc text; Adam).  Every method trains the same model from the same initialisation on
the same batches; asynchronous methods drain at the end.  Writes ``results.csv`` (per evaluation point),
``summary.md`` (final metric mean ± std per method) and one PNG of curves per task to ``--out_dir``.
"""

from __future__ import annotations

import functools
import os
import sys
import numpy as np

from jaxpipe.cli import common as cli
from absl import app, flags

from experiments import emulate_cpu_devices


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_enum(
        "task", "all", ["all", "digits", "bytelm"], "all = digits+momentum, digits+adamw, bytelm+adam"
    )
    flags.DEFINE_string(
        "optimizer",
        "",
        "for a single --task: momentum | adamw | adam | sgd (default: momentum for digits, adam for bytelm)",
    )
    flags.DEFINE_string(
        "schedules",
        "gpipe,pipedream,pipedream_2bw,spectrain,pipeoptim",
        "methods to compare; "
        "spectrain is skipped (with a note) for optimizers without momentum, as it requires; "
        "'dp' is the synchronous data-parallel baseline (computed exactly by GPipe); also "
        "cdp_v1, cdp_v2 (cyclic data parallelism, pipeline form; the DP form jp.CyclicDataParallel "
        "computes the same numbers, tested), avgpipe (--avgpipe_pipes parallel pipelines, the global "
        "batch split over them, elastic averaging with alpha = 1/N), wpipe (the same --stages partitions "
        "on stages/2 devices), wpipe_apc (wpipe with float16-compressed messages, APC)",
    )
    flags.DEFINE_integer("avgpipe_pipes", 2, "parallel pipelines N of avgpipe (N x stages devices)")
    flags.DEFINE_float(
        "target_slack",
        0.05,
        "steps-to-target: the first evaluation whose eval loss is within this "
        "fraction of the dp baseline's final eval loss (AvgPipe Fig. 14)",
    )
    flags.DEFINE_integer("seeds", 3, "seeds per method (model init and data order)")
    flags.DEFINE_integer("stages", 4, "pipeline stages D")
    flags.DEFINE_integer("microbatches", 4, "micro-batches per step M (pipedream_2bw needs M >= D)")
    flags.DEFINE_integer("batch", 64, "global batch size")
    flags.DEFINE_integer("steps", 0, "optimizer steps per run (0: task default, 300 digits / 150 bytelm)")
    flags.DEFINE_float("lr", 0.0, "learning rate (0: task default: momentum 0.05, adamw/adam 3e-3)")
    flags.DEFINE_integer("eval_every", 25, "evaluate every this many steps")
    flags.DEFINE_string("out_dir", "runs/convergence", "output directory")


FLAGS = flags.FLAGS


def _task(task: str, seed: int):
    """``(model, batches, evals)`` of ``task``: digits with a residual MLP, or the byte corpus with a GPT."""
    import itertools

    import jaxpipe as jp

    D = FLAGS.stages
    if task == "digits":
        train, val = jp.data.digits(seed=0)
        model = jp.models.residual_mlp(D, 64, 10, width=64, seed=seed)
        return model, jp.data.class_batches(train, FLAGS.batch, seed=seed), [val]
    train, val = jp.data.byte_corpus()
    model = jp.models.gpt(D, d_model=32, heads=2, seq_len=32, seed=seed)
    evals = list(itertools.islice(jp.data.lm_batches(val, FLAGS.batch, 32, seed=999), 4))
    return model, jp.data.lm_batches(train, FLAGS.batch, 32, seed=seed), evals


def _optimizer(opt_name: str, lr: float):
    import optax

    return {
        "momentum": lambda: optax.sgd(lr, momentum=0.9),
        "sgd": lambda: optax.sgd(lr),
        "adam": lambda: optax.adam(lr),
        "adamw": lambda: optax.adamw(lr, weight_decay=1e-4),
    }[opt_name]()


def _pipeline(model, schedule: str, opt):
    """The pipeline ``schedule`` names: "dp" is the synchronous baseline -- plain data-parallel SGD semantics
    (one update per step from the gradient at the current weights), which every synchronous schedule
    computes exactly -- run as GPipe; "wpipe_apc" is WPipe with its automatic precision compression of
    activations and gradients (appendix A.3)."""
    import jaxpipe as jp

    D, M = FLAGS.stages, FLAGS.microbatches
    name = {"dp": "gpipe", "wpipe_apc": "wpipe"}.get(schedule, schedule)
    if name == "wpipe":
        # the same model (D partitions) on D/2 devices: G0 = partitions 0..D/2-1, G1 the rest
        if D % 2:
            raise app.UsageError(
                f"wpipe cuts the model into 2 x devices partitions: --stages={D} must be even"
            )
        mesh, options = jp.make_mesh(stages=D // 2), {"apc": schedule == "wpipe_apc"}
    elif name == "avgpipe":
        # N pipelines, each on its share of the global batch (same samples per step as dp)
        mesh, options = jp.make_mesh(pipes=FLAGS.avgpipe_pipes, stages=D), {"advance": 0}
    else:
        mesh, options = jp.make_mesh(stages=D), None
    return jp.Pipeline(model, schedule=name, num_microbatches=M, optimizer=opt, mesh=mesh, options=options)


def run_one(task, opt_name, schedule, seed, steps, lr):
    """One training run: a row every ``--eval_every`` steps and at the end (the mean training loss since
    the last row, the held-out loss, and on digits the held-out accuracy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    model, batches, evals = _task(task, seed)
    pipe = _pipeline(model, schedule, _optimizer(opt_name, lr))
    loss_fn = jax.jit(model.loss)

    def evaluate(params):
        out = {"eval_loss": float(np.mean([float(loss_fn(params, b)) for b in evals]))}
        if task == "digits":
            logits = model.head(params[2], model.forward(params, evals[0]))
            out["eval_acc"] = float(jnp.mean(jnp.argmax(logits, -1) == evals[0]["y"]))
        return out

    state, rows, recent = pipe.init(), [], []
    for i in range(steps):
        state, m = pipe.step(state, next(batches))
        if np.isfinite(float(m["loss"])):
            recent.append(float(m["loss"]))
        if (i + 1) % FLAGS.eval_every == 0 or i + 1 == steps:
            if i + 1 == steps:
                state, _ = pipe.drain(state)
            train_loss = float(np.mean(recent)) if recent else float("nan")
            rows.append({"step": i + 1, "train_loss": train_loss, **evaluate(pipe.params(state))})
            recent = []
    return rows


#: the summary table's header
SUMMARY_HEADER = [
    "| task | optimizer | method | final eval loss | final eval acc | steps to dp target | seeds |",
    "|---|---|---|---|---|---|---|",
]


def main(argv):
    del argv
    if "jax" not in sys.modules:
        emulate_cpu_devices(max(8, FLAGS.stages * FLAGS.avgpipe_pipes))
    if FLAGS.task == "all":
        configs = [("digits", "momentum"), ("digits", "adamw"), ("bytelm", "adam")]
    else:
        configs = [(FLAGS.task, FLAGS.optimizer or ("momentum" if FLAGS.task == "digits" else "adam"))]
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    all_rows, summary = [], list(SUMMARY_HEADER)
    for task, opt_name in configs:
        rows, lines = _run_config(task, opt_name)
        all_rows += rows
        summary += lines
    _write(all_rows, summary)


def _run_config(task: str, opt_name: str):
    """``(rows, summary lines)`` of every method and seed on ``task`` with ``opt_name``, its curves drawn."""
    from tqdm import tqdm

    steps = FLAGS.steps or (300 if task == "digits" else 150)
    lr = FLAGS.lr or (0.05 if opt_name in ("momentum", "sgd") else 3e-3)
    methods = [s for s in FLAGS.schedules.split(",") if s]
    if opt_name not in ("momentum",) and "spectrain" in methods:
        print(f"[{task}/{opt_name}] spectrain skipped: it predicts from the SGD-momentum buffer only")
        methods.remove("spectrain")
    runs = [(m, s) for m in methods for s in range(FLAGS.seeds)]
    all_rows, curves = [], {}
    for method, seed in tqdm(runs, desc=f"{task}/{opt_name}", unit="run"):
        rows = run_one(task, opt_name, method, seed, steps, lr)
        for r in rows:
            all_rows.append({"task": task, "optimizer": opt_name, "method": method, "seed": seed, **r})
        curves.setdefault(method, []).append(rows)
    target = None
    if "dp" in curves:
        target = float(np.mean([run[-1]["eval_loss"] for run in curves["dp"]])) * (1 + FLAGS.target_slack)
    _plot(task, opt_name, lr, curves)
    return all_rows, [_summary_line(task, opt_name, method, rs, target) for method, rs in curves.items()]


def _summary_line(task: str, opt_name: str, method: str, rs, target) -> str:
    """One method's row: its final eval loss (and accuracy) over the seeds, and the steps it took to reach
    ``target`` (data parallelism's final loss, with slack), where there is one."""

    def steps_to(run):
        hit = [r["step"] for r in run if r["eval_loss"] <= target]
        return hit[0] if hit else float("nan")

    fl = np.array([run[-1]["eval_loss"] for run in rs])
    fa = np.array([run[-1].get("eval_acc", np.nan) for run in rs])
    acc = f"{np.mean(fa):.4f} ± {np.std(fa):.4f}" if task == "digits" else "-"
    if target is None:
        reach = "-"
    else:
        st = np.array([steps_to(run) for run in rs], float)
        reach = (
            f"{np.nanmean(st):.0f} ({int(np.sum(np.isfinite(st)))}/{len(rs)} reached)"
            if np.any(np.isfinite(st))
            else f"not reached (0/{len(rs)})"
        )
    loss = f"{np.mean(fl):.4f} ± {np.std(fl):.4f}"
    return f"| {task} | {opt_name} | {method} | {loss} | {acc} | {reach} | {len(rs)} |"


def _plot(task: str, opt_name: str, lr: float, curves) -> None:
    """Each method's training loss and eval metric against the step, mean ± std over the seeds, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    metric = "eval_acc" if task == "digits" else "eval_loss"
    for method, rs in curves.items():
        steps_axis = [r["step"] for r in rs[0]]
        for ax, key in zip(axes, ("train_loss", metric)):
            vals = np.array([[r[key] for r in run] for run in rs])
            mu, sd = np.nanmean(vals, 0), np.nanstd(vals, 0)
            ax.plot(steps_axis, mu, label=method)
            ax.fill_between(steps_axis, mu - sd, mu + sd, alpha=0.2)
            ax.set_xlabel("step")
            ax.set_ylabel(key)
    axes[0].legend()
    fig.suptitle(
        f"{task}, {opt_name} lr {lr:g}, D={FLAGS.stages}, M={FLAGS.microbatches}, "
        f"batch {FLAGS.batch}, mean ± std over {FLAGS.seeds} seeds"
    )
    fig.tight_layout()
    fig.savefig(os.path.join(FLAGS.out_dir, f"{task}_{opt_name}.png"), dpi=110)
    plt.close(fig)


def _write(all_rows, summary) -> None:
    """``results.csv`` (every evaluation of every run) and ``summary.md`` in ``--out_dir``."""
    import csv

    with open(os.path.join(FLAGS.out_dir, "results.csv"), "w", newline="") as fh:
        keys = ["task", "optimizer", "method", "seed", "step", "train_loss", "eval_loss", "eval_acc"]
        w = csv.DictWriter(fh, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(all_rows)
    with open(os.path.join(FLAGS.out_dir, "summary.md"), "w") as fh:
        fh.write("\n".join(summary) + "\n")
    print("\n".join(summary))
    print(f"\nwrote {FLAGS.out_dir}/results.csv, summary.md and the curves (PNG)")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
