"""List the largest ``copy`` instructions XLA left in a compiled pipeline step (a performance probe).

    python -m experiments.hlo_copies --schedule=1f1b --stages=1 --width=1024 --microbatch=4096

Prints how many copies the optimized HLO holds and the biggest by bytes, with the computation they sit in
(the scan's while body runs once per tick): a whole-buffer copy inside the loop body costs its size every
tick.
"""
from __future__ import annotations

import re

from experiments import cli
from absl import app, flags

flags.DEFINE_string("schedule", "1f1b", "schedule")
flags.DEFINE_string("placement", "auto", "lane placement (auto, lanes, ordered)")
flags.DEFINE_integer("stages", 1, "pipeline stages (devices)")
flags.DEFINE_integer("layers", 4, "tanh layers per stage (per chunk where the schedule puts several on a device)")
flags.DEFINE_integer("width", 1024, "width")
flags.DEFINE_integer("microbatch", 4096, "rows per micro-batch")
flags.DEFINE_integer("microbatches", 8, "micro-batches")
flags.DEFINE_integer("top", 12, "copies to list")
FLAGS = flags.FLAGS

_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1, "u32": 4, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import optax
    import jaxpipe as jp
    from jaxpipe import schedules
    from jaxpipe.bench import make_tanh_mlp

    D, M = FLAGS.stages, FLAGS.microbatches
    model = make_tanh_mlp(D * schedules.method(FLAGS.schedule).stages_per_device({}), FLAGS.layers, FLAGS.width)
    n = M * FLAGS.microbatch
    batch = {"x": jnp.zeros((n, FLAGS.width), jnp.float32), "y": jnp.zeros((n, FLAGS.width), jnp.float32)}
    pipe = jp.Pipeline(model, schedule=FLAGS.schedule, num_microbatches=M, optimizer=optax.adamw(1e-3),
                       mesh=jp.make_mesh(stages=D), placement=FLAGS.placement)
    txt = pipe.lower("step", pipe.init(), batch).compile().as_text()
    comp, copies = None, []
    for line in txt.splitlines():
        m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and "=" not in line.split("{")[0]:
            comp = m.group(1)
        m = re.search(r"=\s*(\w+)\[([\d,]*)\][^=]*\s(copy|copy-start)\(", line)
        if m:
            dims = [int(d) for d in m.group(2).split(",") if d]
            size = _BYTES.get(m.group(1), 4)
            for d in dims:
                size *= d
            copies.append((size, comp or "?", line.strip()[:140]))
    copies.sort(reverse=True)
    print(f"{jax.devices()[0].platform}: {len(copies)} copies, {sum(c[0] for c in copies) / 2**20:.1f} MiB in all")
    for size, comp, line in copies[:FLAGS.top]:
        print(f"{size / 2**20:9.1f} MiB  in {comp}:  {line}")


if __name__ == "__main__":
    cli.run(main)
