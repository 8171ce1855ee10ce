"""How steady is a tick's price on a real two-device pipeline, and would another estimator be steadier?

Two processes pinned to a core each (the two-process testbed of ``experiments.two_devices``) build the
tick-price probe's loops once (:func:`jaxpipe.tune.running_costs.tick_loops`: every device runs the stage
twice a tick then the ring exchange, one device twice and the other once, or twice with no exchange) and
time them ``--repeats`` times, ``--rounds`` rounds each (every loop once a round, in turns).  From the same
rounds each repeat prints three estimates of what a tick's exchange adds:

* ``pipeline``: what ``Pipeline`` measures (``running_costs._tick_cost``): the median over groups of three
  rounds of the price from each loop's least call;
* ``least``: the price from each loop's least call over all the rounds;
* ``paired``: the median over rounds of the price from that round's calls alone.

and, last, each estimate's median and range over the repeats.  The stage is ``--layers`` / 2 layers of the
testbed's ``tanh(h @ W)`` MLP held as one stacked array (a ``lax.scan``), on ``--rows``-row micro-batches.

    python -m experiments.tick_price                       # the testbed's stage at M = 8 (32 rows)
    python -m experiments.tick_price --rows=64 --repeats=4
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import flags

from jaxpipe.cli import common as cli

FLAGS = flags.FLAGS


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined only when it runs (a test that imports the module for its estimates
    defines none that would clash with another runner's): its own, and ``experiments.two_devices``' (the
    testbed's --layers, --width, --rounds, --port, --link_thread)."""
    from experiments import two_devices

    two_devices.define_flags()

    flags.DEFINE_integer("repeats", 6, "repeats of the probe in one process pair")
    flags.DEFINE_integer("rows", 32, "rows of the micro-batch a tick's stage runs (the testbed: 256 / M)")
    FLAGS.set_default("rounds", 15)  # two_devices' flag: here, every loop once a round


#: the probe's loop lengths, as ``Pipeline``'s (``running_costs._tick_cost``)
LENGTHS = (4, 16)
#: rounds a ``Pipeline`` price takes the least call of (its ``calls``)
GROUP = 3


def _per_tick(rounds, kinds, lengths=LENGTHS) -> dict:
    """Seconds a tick of each loop kind from ``rounds`` (``[{(kind, n): seconds}]``), as ``Pipeline``'s probe
    takes them (:func:`jaxpipe.tune.microbench.iteration_seconds` of each loop's least call)."""
    from jaxpipe.tune.microbench import iteration_seconds

    least = {at: min(r[at] for r in rounds) for at in rounds[0]}
    return {k: iteration_seconds(least, k, lengths) for k in kinds}


def estimates(rounds, kinds=("even", "uneven", "alone"), lengths=LENGTHS, group=GROUP) -> dict:
    """The three estimates of a tick's exchange (module docstring) from one repeat's ``rounds``, in seconds.

    Args:
        rounds: ``[{(kind, n): seconds of that loop's call}]``, a dict a round.
        kinds: the loop kinds (:data:`jaxpipe.tune.running_costs.TICK_LOOPS`).
        lengths: the short and long loops' ticks.
        group: rounds a ``pipeline`` price takes the least call of.

    Returns:
        ``{"pipeline", "least", "paired", "alone"}``: the three prices and the loop without exchanges'
        seconds a tick (its least calls).
    """
    from jaxpipe.tune.running_costs import exchange_price

    groups = [rounds[i : i + group] for i in range(0, len(rounds) - group + 1, group)]
    whole = _per_tick(rounds, kinds, lengths)
    return {
        "pipeline": float(np.median([exchange_price(_per_tick(g, kinds, lengths)) for g in groups])),
        "least": exchange_price(whole),
        "paired": float(np.median([exchange_price(_per_tick([r], kinds, lengths)) for r in rounds])),
        "alone": whole["alone"],
    }


def worker(pid: int) -> None:
    from experiments import two_devices

    jax, _ = two_devices._join(pid)
    from jaxpipe.bench import layers_fn
    from jaxpipe.tune.running_costs import TICK_LOOPS, tick_loops

    r = np.random.default_rng(0)
    w = np.asarray(r.normal(size=(FLAGS.layers // 2, FLAGS.width, FLAGS.width)), np.float32)
    w /= np.sqrt(FLAGS.width)
    x = np.asarray(r.normal(size=(FLAGS.rows, FLAGS.width)), np.float32)
    loops = tick_loops(layers_fn("scan"), w, x, 2)  # the testbed's stage, held as one stacked array
    thunks = {(k, n): loops[k](n) for k in TICK_LOOPS for n in LENGTHS}
    for thunk in thunks.values():  # compiled and warm
        jax.block_until_ready(thunk())
    for repeat in range(FLAGS.repeats):
        rounds = []
        for _ in range(FLAGS.rounds):
            took = {}
            for at, thunk in thunks.items():
                t0 = time.perf_counter()
                jax.block_until_ready(thunk())
                took[at] = time.perf_counter() - t0
            rounds.append(took)
        if pid == 0:
            print(json.dumps({"repeat": repeat, **estimates(rounds, TICK_LOOPS)}), flush=True)


NAMES = ("pipeline", "least", "paired")


def _row(row) -> str:
    prices = "  ".join(f"{row[n] * 1e3:9.3f}" for n in NAMES)
    return f"{row['repeat']:>6}  {prices}   {row['alone'] * 1e3:.3f}"


def summary(rows) -> str:
    """Each estimate's median and range over the repeats, in ms."""
    lines = []
    for n in NAMES:
        v = np.array([row[n] for row in rows]) * 1e3
        lines.append(f"{n}: median {np.median(v):.3f} ms, range {v.min():.3f}-{v.max():.3f}")
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.worker >= 0:
        return worker(FLAGS.worker)
    args = [a for a in sys.argv[1:] if not a.startswith("--worker")]
    from jaxpipe import host_memory

    env = {**os.environ, **host_memory.KEEP_FREED_ENV}
    logs = {p: tempfile.TemporaryFile("w+") for p in (0, 1)}
    procs = [
        subprocess.Popen(
            ["taskset", "-c", str(p), sys.executable, "-m", "experiments.tick_price", *args, f"--worker={p}"],
            stdout=subprocess.PIPE,
            stderr=logs[p],
            text=True,
            env=env,
        )
        for p in (1, 0)
    ]
    rows = []
    print(f"{'repeat':>6}  " + "  ".join(f"{n:>9}" for n in NAMES) + "   alone (ms a tick)", flush=True)
    for line in procs[1].stdout:
        if line.startswith("{"):
            rows.append(json.loads(line))
            print(_row(rows[-1]), flush=True)
    procs[1].wait()
    procs[0].wait()
    if not rows:
        for p in (0, 1):  # what each worker said before it stopped
            logs[p].seek(0)
            print(f"--- worker {p}, the end of its output:\n{logs[p].read()[-3000:]}", file=sys.stderr)
        raise SystemExit(
            f"experiments.tick_price: the workers reported nothing (is port {FLAGS.port} free, and are "
            "there two cores?)"
        )
    print(summary(rows))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
