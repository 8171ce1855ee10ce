"""Draw a schedule's timeline (devices as rows, ops as boxes labelled with micro-batch numbers).

    python -m experiments.timeline --schedule=1f1b --stages=4 --microbatches=8 --out=1f1b.png
    python -m experiments.timeline --schedule=gpipe --mode=lockstep --trace=gpipe.json

Also prints the text form and the simulator's report (event-driven and lockstep makespan, bubble ratio,
peak in-flight micro-batches and weight versions per device).  No JAX is imported.
"""
from __future__ import annotations

from absl import app, flags

flags.DEFINE_string("schedule", "1f1b", "schedule to draw (see jaxpipe.schedules.available())")
flags.DEFINE_integer("stages", 4, "pipeline stages (devices)")
flags.DEFINE_integer("microbatches", 8, "micro-batches per step")
flags.DEFINE_float("f", 1.0, "forward time of one stage on one micro-batch")
flags.DEFINE_float("b", 2.0, "backward time of one stage on one micro-batch")
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
        s = schedules.build(FLAGS.schedule, num_stages=FLAGS.stages, num_microbatches=FLAGS.microbatches)
    except ValueError as e:
        raise app.UsageError(str(e))
    if FLAGS.text:
        print(s.render_text())
    print(s.simulate(f=FLAGS.f, b=FLAGS.b).summary())
    if FLAGS.out:
        s.render(FLAGS.out, f=FLAGS.f, b=FLAGS.b, mode=FLAGS.mode)
        print(f"wrote {FLAGS.out}")
    if FLAGS.trace:
        s.to_chrome_trace(FLAGS.trace, f=FLAGS.f, b=FLAGS.b, mode=FLAGS.mode)
        print(f"wrote {FLAGS.trace} (open in ui.perfetto.dev)")


if __name__ == "__main__":
    app.run(main)
