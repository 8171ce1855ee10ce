"""Draw a schedule's timeline (devices as rows, ops as boxes labelled with micro-batch numbers).

    jaxpipe timeline --schedule=1f1b --stages=4 --microbatches=8 --out=1f1b.png
    jaxpipe timeline --schedule=gpipe --mode=lockstep --trace=gpipe.json
    jaxpipe timeline --schedule=chimera --stages=4 --microbatches=4 --out=chimera.png  # Fig. 3
    jaxpipe timeline --schedule=interleaved_1f1b --virtual=2 --microbatches=8
    jaxpipe timeline --schedule=zb_h1 --stages=4 --microbatches=8    # B and W share b: 29 vs 1F1B's 33
    jaxpipe timeline --schedule=my_order.csv    # your own, in PyTorch's CSV format (its devices, its M)
    jaxpipe timeline --schedule=zb_v --stages=2 --microbatches=4 --csv=my_order.csv   # a start for it

Also prints the text form and the simulator's report (event-driven and lockstep makespan, bubble ratio,
peak in-flight micro-batches and weight versions per device).  No JAX is imported.
"""

from __future__ import annotations

import functools
from jaxpipe.cli import common as cli
from absl import app, flags


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_string(
        "schedule", "1f1b", "schedule to draw (see jaxpipe.schedules.available())" + cli.OWN_SCHEDULE_HELP
    )
    flags.DEFINE_integer("stages", 4, "pipeline stages (devices)")
    flags.DEFINE_integer("microbatches", 8, "micro-batches per step")
    flags.DEFINE_float("f", 1.0, "forward time of one stage on one micro-batch")
    flags.DEFINE_float(
        "b",
        2.0,
        "backward time of one stage on one micro-batch: the whole backward, for every "
        "schedule (a split one -- zb_h1, zb_v, dualpipe_v -- runs it as B and W)",
    )
    flags.DEFINE_float(
        "w",
        None,
        "split backward (zb_h1, zb_v, dualpipe_v): the weight-gradient part W of --b "
        "(B runs b - w); default b / 2",
    )
    flags.DEFINE_integer("pipelines", 2, "chimera: 2f pipelines (f dividing stages/2)")
    flags.DEFINE_integer("virtual", 2, "interleaved_1f1b: model chunks per device")
    flags.DEFINE_integer(
        "advance", 0, "avgpipe: forwards issued beyond 1F1B's warm-up (0 = 1F1B, M-1 = AFAB)"
    )
    flags.DEFINE_enum(
        "mode",
        "event",
        ["event", "lockstep", "lanes", "ordered", "ordered2"],
        "event: as-soon-as-possible (MPMD) timeline; lanes: what the executor runs by default (an F "
        "and a B lane per tick, each as long as its slowest op); ordered: the executor's "
        'placement="ordered" (one op per device per tick); ordered2: that order in ticks of two rounds of '
        "lanes; lockstep: one op per tick costing the slowest",
    )
    flags.DEFINE_string("out", "timeline.png", "PNG path ('' to skip)")
    flags.DEFINE_string("trace", "", "optional Chrome/Perfetto trace JSON path")
    flags.DEFINE_string(
        "csv",
        "",
        "also write the schedule's actions to this file in PyTorch's CSV format (one row per device): a "
        "start for a schedule of your own, which --schedule=FILE.csv and jaxpipe train read back",
    )
    flags.DEFINE_bool("text", True, "print the text timeline (one column per lockstep tick)")


FLAGS = flags.FLAGS


def main(argv):
    del argv
    from jaxpipe import schedules

    if FLAGS.schedule in ("cdp_dp", "cyclic"):
        return cyclic_timeline()
    s = cli.schedule_file(FLAGS.schedule, FLAGS.microbatches)  # its own devices and micro-batches
    if s is not None:
        return draw(s)
    try:
        opts = {
            "chimera": {"pipelines": FLAGS.pipelines},
            "interleaved_1f1b": {"virtual": FLAGS.virtual},
            "avgpipe": {"advance": FLAGS.advance},
        }
        s = schedules.build(
            FLAGS.schedule,
            num_stages=FLAGS.stages,
            num_microbatches=FLAGS.microbatches,
            **opts.get(FLAGS.schedule, {}),
        )
        if FLAGS.schedule == "wpipe":
            # three batches, to show the steady state between fill and drain
            from jaxpipe.schedules import wpipe

            s = wpipe.build_wpipe(FLAGS.stages, FLAGS.microbatches, batches=3).validate()
            ss = wpipe.steady_state(FLAGS.stages, FLAGS.microbatches)
            print(
                f"wpipe steady state: bubble {ss.bubble:g}, period {ss.period} ticks per batch, in flight "
                "per "
                f"device G0 {ss.g0_inflight} G1 {ss.g1_inflight} micro-batches ({ss.activations_units:g} "
                f"partition-activations in all; WPipe Table 1's (4M-N+1)/4 S_a is {ss.table1_units:g}), "
                f"G0 two versions + G1 one"
            )
            print("| WPipe | paper (Table 1, §3.2) | this timeline |\n|---|---|---|")
            for what, paper, here in ss.table1():
                print(f"| {what} | {paper} | {here} |")
    except ValueError as e:
        raise app.UsageError(str(e))
    draw(s)


def draw(s) -> None:
    """The schedule ``s`` printed as text, simulated at --f, --b (and --w), and drawn to --out and --trace."""
    if FLAGS.text:
        print(s.render_text())
    w = FLAGS.w if s.has_w() else None
    if w is not None and not 0 <= w <= FLAGS.b:
        raise app.UsageError(
            f"--w={w:g}: the weight-gradient part of the whole backward --b={FLAGS.b:g}; give 0 <= w <= b"
        )
    print(s.simulate(f=FLAGS.f, b=FLAGS.b, w=w).summary())
    if FLAGS.out:
        s.render(FLAGS.out, f=FLAGS.f, b=FLAGS.b, w=w, mode=FLAGS.mode)
        print(f"wrote {FLAGS.out}")
    if FLAGS.trace:
        s.to_chrome_trace(FLAGS.trace, f=FLAGS.f, b=FLAGS.b, w=w, mode=FLAGS.mode)
        print(f"wrote {FLAGS.trace} (open in ui.perfetto.dev)")
    if FLAGS.csv:
        write_csv(s, FLAGS.csv)


def write_csv(s, path: str) -> None:
    """``s``'s actions to ``path`` in PyTorch's CSV format, and whether it reads back as a schedule of one's
    own (not where a stage runs on two devices, as Chimera's replicas do)."""
    from jaxpipe import schedules

    try:
        text = schedules.to_csv(s, path)
    except (KeyError, ValueError) as e:  # an action no CSV cell writes
        raise app.UsageError(f"--csv: {s.name} cannot be written in PyTorch's CSV format ({e})")
    flushes = s.name not in schedules.METHODS or schedules.method(s.name).flushes
    try:
        schedules.from_csv(text)
        print(
            f"wrote {path} (PyTorch's CSV format; --schedule={path} reads it back"
            + ("" if flushes else f" as a synchronous schedule: the order, not {s.name}'s weight versions")
            + ")"
        )
    except schedules.ScheduleError as e:
        print(f"wrote {path} (PyTorch's CSV format); it does not read back as a schedule of your own: {e}")


def cyclic_timeline():
    """Cyclic Data Parallelism's DP form (``--schedule=cdp_dp``): N = --stages workers, one row each, and
    the activations one device would hold running them all, cyclic vs DP order (Figure 1, Table 1)."""
    from jaxpipe.schedules import cyclic as cyc

    N = FLAGS.stages
    ticks = range(0, 6 * N)
    for i in range(N):
        cells = []
        for t in ticks:
            kind, j, k = cyc.op_of(N, i, t)
            cells.append(f"{kind}{j}" if kind else "..")
        print(f"worker {i}: " + " ".join(f"{c:>3}" for c in cells))
    prof_c = [cyc.live_units(N, t) for t in ticks]
    prof_d = [cyc.live_units(N, t, cyclic=False) for t in ticks]
    print(
        f"stage activations held on one device: cyclic {prof_c}\n                                       DP "
        f"{prof_d}"
    )
    print(
        f"steady state: cyclic {N * (N + 1) // 2} units = (N+1)/2 B Psi_A at every tick; DP peaks at {N * N} "
        f"= N B Psi_A (Table 1)"
    )
    if FLAGS.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3))
        ax.step(list(ticks), prof_d, where="mid", label="DP (all workers in step)")
        ax.step(list(ticks), prof_c, where="mid", label="cyclic (workers 2 steps apart)")
        ax.set_xlabel("time step")
        ax.set_ylabel("stage activations held")
        ax.set_title(f"Cyclic Data Parallelism, N={N}: activations on a single device")
        ax.legend()
        fig.tight_layout()
        fig.savefig(FLAGS.out, dpi=110)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    cli.run(main, __doc__)
