"""Cutting a model into stages: uneven cuts against even ones, and the balanced cut.

    python -m experiments.cuts                 # GPT, 10 blocks, d 256, 16k vocabulary, 4 stages, one core

Two tables, one process:

1. **Is padding free?**  The same blocks cut evenly (no padding) and unevenly (padding on the short stages),
   one core (``--cores``: every device's work runs one after the other, so each cut does the same work):
   the time of each cut over the even one's.  With more blocks than an even cut allows, the uneven cuts are
   compared among themselves.
2. **The balanced cut.**  :func:`jaxpipe.cuts.balanced.balance` measures one block, the embedding and the
   head-plus-loss, searches the cuts for the least predicted lockstep compute on ``--stages`` devices and
   prints its choice beside the most even cut; both are then timed on one core (where a cut cannot help:
   it checks the total work is the same, so the prediction's gain is the lockstep bound's, not less work).
"""

from __future__ import annotations

import functools
import os
import statistics

from jaxpipe.cli import common as cli
from absl import flags


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_integer(
        "cores", 1, "CPU cores the process may use (os.sched_setaffinity); 0: leave as it is"
    )
    flags.DEFINE_integer("stages", 4, "stages (emulated devices) D")
    flags.DEFINE_integer("blocks", 10, "transformer blocks in the model")
    flags.DEFINE_integer(
        "even_blocks", 8, "blocks of the padding check (a multiple of --stages: an even cut exists)"
    )
    flags.DEFINE_integer("d_model", 256, "model width")
    flags.DEFINE_integer("heads", 4, "attention heads")
    flags.DEFINE_integer("vocab", 16384, "vocabulary (the head's cost)")
    flags.DEFINE_integer("seq_len", 64, "tokens per sequence")
    flags.DEFINE_integer("batch", 32, "sequences per step")
    flags.DEFINE_integer("microbatches", 8, "micro-batches M")
    flags.DEFINE_string("schedule", "1f1b", "schedule")
    flags.DEFINE_integer("rounds", 5, "timed steps of each cut, the cuts taking turns (median)")


FLAGS = flags.FLAGS


def _time(pipes, batch, rounds):
    """Per pipeline, the seconds of its ``loss_and_grad`` in each round, the pipelines run in turn round by
    round (A B C A B C ...): drift of the machine's speed over the run falls on all of them alike."""
    import time
    import jax

    runs = []
    for pipe in pipes:
        state = pipe.init()
        runs.append(lambda pipe=pipe, state=state: jax.block_until_ready(pipe.loss_and_grad(state, batch)))
        runs[-1]()  # compiled and warm before any timing
    ts = [[] for _ in pipes]
    for _ in range(rounds):
        for run, t in zip(runs, ts):
            t0 = time.perf_counter()
            run()
            t.append(time.perf_counter() - t0)
    return ts


def main(_):
    from experiments import emulate_cpu_devices

    emulate_cpu_devices(FLAGS.stages)
    if FLAGS.cores:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: FLAGS.cores]))
    import numpy as np
    import jaxpipe as jp
    from jaxpipe.cuts import even_cut
    from jaxpipe.cuts.balanced import balance

    from experiments.bench import MachineWatch, ratio_spread

    watch = MachineWatch()  # before this run's own work
    D, M = FLAGS.stages, FLAGS.microbatches
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.integers(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq_len)).astype(np.int32),
        "y": rng.integers(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq_len)).astype(np.int32),
    }
    gpt = lambda cut: jp.models.gpt(
        D, vocab=FLAGS.vocab, d_model=FLAGS.d_model, heads=FLAGS.heads, seq_len=FLAGS.seq_len, cut=cut
    )
    pipe_of = lambda cut: jp.Pipeline(
        gpt(cut), FLAGS.schedule, num_microbatches=M, mesh=jp.make_mesh(stages=D)
    )
    print(
        f"GPT d{FLAGS.d_model}, vocab {FLAGS.vocab}, T {FLAGS.seq_len}, batch {FLAGS.batch}, M {M}, "
        f"{FLAGS.schedule} on {D} emulated devices, {FLAGS.cores or 'all'} core(s)\n"
    )

    n = FLAGS.even_blocks
    base = tuple([n // D] * D)
    others = [
        c
        for c in (
            tuple([n // D + 1] * (D // 2) + [n // D - 1] * (D - D // 2)),
            tuple([n // D - 1] * (D - D // 2) + [n // D + 1] * (D // 2)),
        )
        if min(c) >= 1
    ]
    print(
        f"| {n} blocks: cut | padded slots | one-core step | vs even (+- half the rounds' IQR) "
        "|\n|---|---|---|---|"
    )
    t0, *ts = _time([pipe_of(c) for c in (base, *others)], batch, FLAGS.rounds)
    print(f"| {list(base)} | 0 | {statistics.median(t0) * 1e3:.1f} ms | 1.000x |", flush=True)
    spreads = {}
    for c, t in zip(others, ts):
        r, sp = spreads[str(list(c))] = ratio_spread(t, t0)
        print(
            f"| {list(c)} | {D * max(c) - n} | {statistics.median(t) * 1e3:.1f} ms | {r:.3f}x +- {sp:.3f} |",
            flush=True,
        )

    mb = {k: v[: FLAGS.batch // M] for k, v in batch.items()}
    _, choice = balance(gpt(even_cut(FLAGS.blocks, D)), D, mb, FLAGS.schedule, M, verbose=False)
    print(
        f"\n| {FLAGS.blocks} blocks: cut | predicted compute on {D} devices | one-core step |\n|---|---|---|"
    )
    rows = (("even", choice.even_cut, choice.even_predicted), ("balanced", choice.cut, choice.predicted))
    te, tb = _time([pipe_of(c) for _, c, _ in rows], batch, FLAGS.rounds)
    for (label, c, pred), t in zip(rows, (te, tb)):
        print(
            f"| {label} {list(c)} | {pred * 1e3:.2f} ms | {statistics.median(t) * 1e3:.1f} ms |", flush=True
        )
    spreads["measured gain of the balanced cut"] = ratio_spread(te, tb)  # even's time over balanced's
    c = choice.costs
    print(
        f"\nmeasured per micro-batch: block F {c.f_block * 1e3:.3f} B {c.b_block * 1e3:.3f} ms, embedding F "
        f"{c.f_pre * 1e3:.3f} B {c.b_pre * 1e3:.3f} ms, head+loss F {c.f_post * 1e3:.3f} B "
        f"{c.b_post * 1e3:.3f} ms, "
        f"a padding slot F {c.f_pad * 1e3:.3f} B {c.b_pad * 1e3:.3f} ms; "
        f"predicted gain of the balanced cut {choice.gain:.3f}x; measured "
        f"{spreads['measured gain of the balanced cut'][0]:.3f}x +- "
        f"{spreads['measured gain of the balanced cut'][1]:.3f}"
    )
    print(watch.summary())
    for w in watch.warnings(spreads):
        print("warning: " + w)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
