"""What the training loop adds to ``Pipeline.step``: a bare loop of steps against ``jp.train``, its metrics
read once the next step is dispatched (``overlap_steps=True``, the default) and read before the next starts.

A loop that reads each step's loss before it dispatches the next leaves the device idle while the host logs
that step and prepares the next one (the batch, the step's checks, the call): on an accelerator whose step
takes a millisecond or two, that host work is a share of every step.  The bare loop dispatches step after
step and waits once; ``jp.train`` writes ``metrics.jsonl`` and shows progress as a user's run does (no
evaluation, no checkpoint: those steps are read at once by design).  Interleaved rounds, the median of
each; ms a step and the ratio to the bare loop:

    python -m experiments.loop_overhead
    python -m experiments.loop_overhead --width=1024 --rows=256 --steps=100
"""

from __future__ import annotations

import functools
import statistics

from absl import flags

from experiments.bench import LOOPS, loop_seconds
from jaxpipe.cli import common as cli


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_integer("width", 256, "width of the MLP's layers")
    flags.DEFINE_integer("layers", 2, "layers of each stage")
    flags.DEFINE_integer("rows", 64, "rows of a batch")
    flags.DEFINE_integer("stages", 2, "pipeline stages (CPU: emulated devices)")
    flags.DEFINE_integer("microbatches", 4, "micro-batches a step")
    flags.DEFINE_string("schedule", "1f1b", "the schedule")
    flags.DEFINE_integer("steps", 200, "steps a timed run")
    flags.DEFINE_integer("rounds", 3, "interleaved rounds (the median is reported)")


FLAGS = flags.FLAGS


def _pipeline():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxpipe as jp

    width, layers, stages = FLAGS.width, FLAGS.layers, FLAGS.stages
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(stages, layers, width, width)) / np.sqrt(width)
    model = jp.PipelineModel(
        stage_fn=lambda w, h: jax.lax.scan(lambda x, wi: (jnp.tanh(x @ wi), None), h, w)[0],
        stage_params=jnp.asarray(weights, jnp.float32),
        post_loss=lambda _, h, b: jnp.mean((h - b["y"]) ** 2),
    )
    pipe = jp.Pipeline(
        model,
        schedule=FLAGS.schedule,
        num_microbatches=FLAGS.microbatches,
        optimizer=optax.adamw(1e-4),
        mesh=jp.make_mesh(stages=stages),
    )
    x = rng.normal(size=(FLAGS.rows, width)).astype(np.float32)
    return pipe, {"x": x, "y": np.zeros_like(x)}


def main(argv):
    del argv
    from experiments import emulate_cpu_devices

    emulate_cpu_devices(FLAGS.stages)  # (before the backend starts)
    import jax

    pipe, batch = _pipeline()
    rounds = [loop_seconds(pipe, batch, FLAGS.steps) for _ in range(FLAGS.rounds)]
    median = {loop: statistics.median(r[loop] for r in rounds) for loop in LOOPS}
    print(
        f"{FLAGS.schedule}, {FLAGS.stages} stages of {FLAGS.layers} x {FLAGS.width}^2, {FLAGS.rows} rows, "
        f"M = {FLAGS.microbatches}, {jax.devices()[0].platform}; median of {FLAGS.rounds} rounds of "
        f"{FLAGS.steps} steps"
    )
    for loop in LOOPS:
        spread = ", ".join(f"{r[loop] * 1e3:.3f}" for r in rounds)
        print(f"{loop:<28s} {median[loop] * 1e3:8.3f} ms  {median[loop] / median[LOOPS[0]]:.3f}x  ({spread})")


if __name__ == "__main__":
    define_flags()
    cli.run(main, __doc__)
