"""Draw a schedule's timeline (devices as rows, ops as boxes labelled with micro-batch numbers).

    python -m experiments.timeline --schedule=1f1b --stages=4 --microbatches=8 --out=1f1b.png
    python -m experiments.timeline --schedule=gpipe --mode=lockstep --trace=gpipe.json
    python -m experiments.timeline --schedule=chimera --stages=4 --microbatches=4 --out=chimera.png  # Fig. 3
    python -m experiments.timeline --schedule=interleaved_1f1b --virtual=2 --microbatches=8
    python -m experiments.timeline --schedule=zb_h1 --b=1 --w=1

Also prints the text form and the simulator's report (event-driven and lockstep makespan, bubble ratio,
peak in-flight micro-batches and weight versions per device).  No JAX is imported.
"""
from __future__ import annotations

from absl import app, flags

flags.DEFINE_string("schedule", "1f1b", "schedule to draw (see jaxpipe.schedules.available())")
flags.DEFINE_integer("stages", 4, "pipeline stages (devices)")
flags.DEFINE_integer("microbatches", 8, "micro-batches per step")
flags.DEFINE_float("f", 1.0, "forward time of one stage on one micro-batch")
flags.DEFINE_float("b", 2.0, "backward time of one stage on one micro-batch (zb_h1: its input-gradient part)")
flags.DEFINE_float("w", 1.0, "zb_h1 only: weight-gradient time W")
flags.DEFINE_integer("pipelines", 2, "chimera: 2f pipelines (f dividing stages/2)")
flags.DEFINE_integer("virtual", 2, "interleaved_1f1b: model chunks per device")
flags.DEFINE_enum("mode", "event", ["event", "lockstep"], "event: as-soon-as-possible (MPMD) timeline; "
                  "lockstep: the ticks the SPMD executor runs, each as long as its slowest op")
flags.DEFINE_string("out", "timeline.png", "PNG path ('' to skip)")
flags.DEFINE_string("trace", "", "optional Chrome/Perfetto trace JSON path")
flags.DEFINE_bool("text", True, "print the text timeline (one column per lockstep tick)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from jaxpipe import schedules
    try:
        opts = {"chimera": {"pipelines": FLAGS.pipelines}, "interleaved_1f1b": {"virtual": FLAGS.virtual}}
        s = schedules.build(FLAGS.schedule, num_stages=FLAGS.stages, num_microbatches=FLAGS.microbatches,
                            **opts.get(FLAGS.schedule, {}))
    except ValueError as e:
        raise app.UsageError(str(e))
    if FLAGS.text:
        print(s.render_text())
    w = FLAGS.w if s.has_w() else None
    print(s.simulate(f=FLAGS.f, b=FLAGS.b, w=w).summary())
    if FLAGS.out:
        s.render(FLAGS.out, f=FLAGS.f, b=FLAGS.b, w=FLAGS.w, mode=FLAGS.mode)
        print(f"wrote {FLAGS.out}")
    if FLAGS.trace:
        s.to_chrome_trace(FLAGS.trace, f=FLAGS.f, b=FLAGS.b, w=FLAGS.w, mode=FLAGS.mode)
        print(f"wrote {FLAGS.trace} (open in ui.perfetto.dev)")


if __name__ == "__main__":
    app.run(main)
