"""Bubble ratios: the simulator next to the papers' formulas, every synchronous schedule, many (D, N).

    python -m experiments.bubbles                       # D in {4, 8, 16, 32}, N in {D, 2D, 4D}
    python -m experiments.bubbles --stages=4,8 --microbatches=1,2,4,8 --markdown=bubbles.md

Columns: the event-driven bubble ratio (an MPMD runtime: each op starts when its inputs are there) in the
setting of the formula (GPipe/1F1B (D-1)/(N+D-1) with b = 2f; Chimera Table 2/3 with f = b; interleaved
1F1B (D-1)/(vN) of the ideal time with chunk times f/v, b/v; ZB-H1's paper value (D-1)/(3N+D-1) with
f = b = w, reached with max_deferred_w = D-1 at the cost of memory), the formula, and the *lockstep* bubble
the SPMD executor really pays (one op per device per tick, a tick costs its slowest op; f = 1, b = 2, or b = w
= 1 for ZB-H1), with peak in-flight micro-batches (min-max over devices) and weight copies per device.  No JAX
is imported.
"""

from __future__ import annotations

import functools
from jaxpipe.cli import common as cli
from absl import flags


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_string("stages", "4,8,16,32", "comma-separated D values")
    flags.DEFINE_string("microbatches", "", "comma-separated N values (default: D, 2D, 4D for each D)")
    flags.DEFINE_string("markdown", "", "also write the table to this Markdown file")


TITLE = "# Bubble ratios: the simulator beside the papers' formulas"
FLAGS = flags.FLAGS


def rows_for(D: int, N: int):
    from jaxpipe import schedules as S

    out = []

    def add(label, sched, sim_kw, formula, lock_kw):
        r = sched.simulate(**sim_kw)
        lk = sched.simulate(**lock_kw)
        out.append(
            (
                label,
                D,
                N,
                r.bubble_ratio,
                formula,
                lk.lockstep_bubble_ratio,
                lk.num_ticks,
                f"{min(r.peak_inflight)}-{max(r.peak_inflight)}",
                max(r.weight_versions),
            )
        )

    std = dict(f=1.0, b=2.0)
    for name in ("gpipe", "1f1b"):
        add(name, S.build(name, D, N), std, (D - 1) / (N + D - 1), std)
    if D % 2 == 0:
        f = 1
        while f <= D // 2:
            if (D // 2) % f == 0 and (f == 1 or f == 2):
                s = S.build("chimera", D, N, pipelines=2 * f)
                form = (D - 2 * f) / (2 * f * N + D - 2 * f) if N % D == 0 else float("nan")
                add(f"chimera 2f={2 * f}", s, dict(f=1.0, b=1.0), form, std)
            f += 1
    if N % D == 0:
        v = 2
        s = S.build("interleaved_1f1b", D, N, virtual=v)
        x = (D - 1) / (v * N)
        add(f"interleaved v={v}", s, dict(f=1.0 / v, b=2.0 / v), x / (1 + x), dict(f=1.0 / v, b=2.0 / v))
    s = S.build("zb_h1", D, N)
    add(
        "zb_h1 (1F1B peak memory)",
        s,
        dict(f=1.0, b=2.0, w=1.0),
        (D - 1) / (3 * N + D - 1),
        dict(f=1.0, b=2.0, w=1.0),
    )
    s = S.build("zb_h1", D, N, max_deferred_w=D - 1)
    add(
        "zb_h1 max_deferred_w=D-1",
        s,
        dict(f=1.0, b=2.0, w=1.0),
        (D - 1) / (3 * N + D - 1),
        dict(f=1.0, b=2.0, w=1.0),
    )
    return out


def main(argv):
    del argv
    Ds = [int(x) for x in FLAGS.stages.split(",") if x]
    lines = [
        "| schedule | D | N | simulated bubble | formula | lockstep bubble (SPMD) | ticks | in-flight "
        "min-max | weight copies |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print(lines[0] + "\n" + lines[1], flush=True)
    for D in Ds:
        Ns = [int(x) for x in FLAGS.microbatches.split(",") if x] or [D, 2 * D, 4 * D]
        for N in Ns:
            for r in rows_for(D, N):
                form = "-" if r[4] != r[4] else f"{r[4]:.3f}"
                line = (
                    f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {form} | {r[5]:.3f} | {r[6]} | {r[7]} | "
                    f"{r[8]} |"
                )
                print(line, flush=True)
                lines.append(line)
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as fh:
            fh.write(f"{TITLE}\n\n`python -m experiments.bubbles`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
