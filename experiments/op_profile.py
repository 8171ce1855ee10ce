"""Where a pipelined step's time goes, next to the plain step it is compared with: a ``jax.profiler`` trace
of each, cut into operation categories (``experiments.profiling``).

    python -m experiments.op_profile                                   # gpipe, chimera, spectrain, cdp_dp_v1
    python -m experiments.op_profile --schedules=chimera --steps=5 --trace_dir=/tmp/prof

Same model, batch and flags as ``experiments.throughput``; every process emulates exactly the devices its
meshes use.  For each schedule it traces ``--steps`` pipelined steps and ``--steps`` of each plain step it
is compared with (throughput's baseline; SpecTrain/PipeOptim also the plain step making their weight
predictions; the DP form of Cyclic Data Parallelism also synchronous DP), then prints per step: wall time,
and the thread milliseconds of XLA's worker threads by category (matmul, elementwise, data movement,
control = conditionals and loops, collective = ppermute/all-reduce including waiting for the peer, pool
wait = an operation's parallel share waiting for busy pool threads) with how many operations of the
category ran.  The traces stay under ``--trace_dir`` for TensorBoard / Perfetto (``vm.xplane.pb``,
``perfetto_trace.json.gz``).
"""

from __future__ import annotations

import functools
import os
import sys

from jaxpipe.cli import common as cli
from absl import app, flags

from experiments import throughput


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    throughput.define_flags()  # its flags are this runner's too
    flags.DEFINE_string(
        "trace_dir", "/tmp/jaxpipe_op_profile", "where the traces are written (one folder per step)"
    )
    flags.DEFINE_string(
        "out",
        "",
        "optional picture (.png/.svg/.pdf): per traced step and device, its time by "
        "operation kind (several device-count groups: one file each, suffixed _<n>dev)",
    )
    flags.DEFINE_integer("top_ops", 6, "operations listed per traced step, by thread time")


FLAGS = flags.FLAGS
DEFAULT_SCHEDULES = "gpipe,chimera,spectrain,cdp_dp_v1"


def _table(cols, breakdowns):
    """A markdown table: one column per traced step, a row per category (thread ms/step, operations/step)."""
    from experiments.profiling import CATEGORY_NAMES

    cats = CATEGORY_NAMES
    print("| per step | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    print("| wall ms | " + " | ".join(f"{b.wall_ms:.1f}" for b in breakdowns) + " |")
    for c in cats:
        print(
            f"| {c} ms (ops) | "
            + " | ".join(f"{b.ms.get(c, 0.0):.1f} ({b.calls.get(c, 0):.0f})" for b in breakdowns)
            + " |"
        )
    print("| all threads ms | " + " | ".join(f"{b.total:.1f}" for b in breakdowns) + " |")


def _per_device(name, b):
    """Per emulated device: its operations' exclusive ms per step by category (their sum is about the
    step's wall time: a device runs its program in order), and the largest operations of the step."""
    from experiments.profiling import CATEGORY_NAMES

    cats = CATEGORY_NAMES
    print(
        f"  {name} per device, ms/step: "
        + "; ".join(
            f"device {d}: "
            + " ".join(f"{c.split()[0]} {ms.get(c, 0.0):.0f}" for c in cats)
            + f" = {sum(ms.values()):.0f}"
            for d, ms in b.per_device.items()
        )
    )
    top = sorted(b.ops.items(), key=lambda kv: -kv[1])[: FLAGS.top_ops]
    print(
        f"  {name}'s largest operations (thread ms/step, calls): "
        + ", ".join(f"{k} {v:.1f} (x{b.op_calls.get(k, 0):.0f})" for k, v in top)
    )


def profile_group(names):
    import logging

    logging.getLogger("jax._src.profiler").setLevel(logging.WARNING)  # "Writing perfetto_trace.json.gz..."
    import jax
    from experiments.profiling import trace_steps

    steps = FLAGS.steps if FLAGS["steps"].present else 3
    opt, model, batch = throughput.benchmark_setup(f"traced steps: {steps} each")
    r = throughput.build_runners(names, model, batch, opt)
    done, pictured = {}, []

    def traced(key):
        if key not in done:
            done[key] = trace_steps(r.runners[key], steps, os.path.join(FLAGS.trace_dir, key))
        return done[key]

    for name in names:
        base = r.base_of.get(name, "accum_momentum" if name in r.opts else "accum")
        cols = (
            [name, base]
            + ([r.predicting[name]] if name in r.predicting else [])
            + (["sync_dp"] if name.startswith("cdp_dp_") else [])
        )
        bds = [traced(c) for c in cols]
        print(f"\n{name}: {bds[0].wall_ms / bds[1].wall_ms:.3f}x {base} in wall time (traced steps)")
        _table(cols, bds)
        _per_device(name, bds[0])
        pictured += [(c, b) for c, b in zip(cols, bds) if c not in {p for p, _ in pictured}]
    if FLAGS.out:
        from experiments.profiling import plot_breakdowns

        path = FLAGS.out
        if os.environ.get("JAXPIPE_OP_PROFILE_GROUPS", "1") != "1":
            stem, ext = os.path.splitext(path)
            path = f"{stem}_{len(jax.devices())}dev{ext}"
        plot_breakdowns(
            pictured,
            path,
            f"MLP {FLAGS.layers} x {FLAGS.width}^2, batch {FLAGS.batch}, "
            f"D={FLAGS.stages}, M={FLAGS.microbatches}, {FLAGS.optimizer}, {len(jax.devices())} devices",
        )
        print(f"picture: {path}")
    print(
        f"\ntraces: {FLAGS.trace_dir}/<step>/plugins/profile/*/ (TensorBoard's profile plugin, or "
        f"perfetto_trace.json.gz in ui.perfetto.dev)"
    )


def main(argv):
    names = (FLAGS.schedules if FLAGS["schedules"].present else DEFAULT_SCHEDULES).split(",")
    if FLAGS.layers % FLAGS.stages:
        raise app.UsageError(f"--layers={FLAGS.layers} must be a multiple of --stages={FLAGS.stages}")
    if FLAGS.child or "jax" in sys.modules:
        return profile_group(names)
    groups = throughput.groups_by_devices(names)
    os.environ["JAXPIPE_OP_PROFILE_GROUPS"] = str(len(groups))  # the children name their pictures by it
    for n, group in groups.items():
        throughput.spawn_group("experiments.op_profile", group, n)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
