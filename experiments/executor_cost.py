"""The executor's own cost: each schedule's gradient over the plain one-device accumulation of the same
micro-batches, with every emulated device pinned to ``--cores`` CPU cores (1: nothing runs side by side, so
the ratio is the work the executor adds, not how emulated devices share cores), beside the textbook scan-GPipe
(MaxText / praxis pattern: every stage computes every tick, autodiff through the scan) as an anchor.

    python -m experiments.executor_cost --cores=1                      # quiet machine
    python -m experiments.executor_cost --cores=1 --schedules=1f1b,zb_v,dualpipe_v
    python -m experiments.executor_cost --cores=1 --stages=2 --microbatches=4 --batch=256 \\
        --schedules=1f1b,zb_v:lanes,zb_v:ordered        # a placement of one's own
    python -m experiments.executor_cost --cores=1 --allocator=default   # glibc's defaults only

The model: ``--layers`` x ``tanh(h @ W)``, W ``--width``^2, each stage a ``lax.scan`` over its layers (the
form the Flax adapters and MaxText-style models build; ``--stage_form=indexed``: a Python loop over ``w[i]``,
``apart``: a tuple of one array per layer); D = ``--stages``, M = ``--microbatches``, batch
``--batch``; round-robin, medians of ``--rounds``.  Schedules with two chunks per device (interleaved,
V-schedules) cut the same layers into 2D stages.

On XLA CPU every execution allocates its large buffers afresh (outputs and temps), and glibc's malloc maps
buffers that large anew and returns them when freed, so each step page-faults its whole footprint again: a
program that allocates more per step (Chimera: the fetched replica, a second gradient sum, the sum sent home)
pays for it in time although it computes no more.  So every program is timed twice in the one process
(``--allocator=both``): first with glibc's defaults, then after ``jaxpipe.host_memory.keep_freed_memory()``
(glibc keeps what is freed, as accelerator allocators pool memory); beside each time, the page faults and
kernel time per step, which say how much of it the allocator is.
"""

from __future__ import annotations

import functools
import os

from jaxpipe.bench import STAGE_FORMS, held_as, layers_fn, stacked_back
from jaxpipe.cli import common as cli
from absl import app, flags


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_integer(
        "cores", 1, "CPU cores the process may use (os.sched_setaffinity); 0: leave as it is"
    )
    flags.DEFINE_string(
        "schedules",
        "gpipe,1f1b,interleaved_1f1b,zb_h1,zb_v,dualpipe_v,chimera",
        "schedules to time, each optionally name:placement (zb_v:ordered; default auto, what Pipeline runs)",
    )
    flags.DEFINE_enum(
        "stage_form",
        "scan",
        list(STAGE_FORMS),
        "how a stage holds and runs its layers: a lax.scan over the stacked array, a Python loop over w[i] "
        "of it (jaxpipe.bench.make_tanh_mlp's form), or a tuple of one array per layer",
    )
    flags.DEFINE_integer("stages", 4, "devices D (emulated)")
    flags.DEFINE_integer("microbatches", 8, "micro-batches M")
    flags.DEFINE_integer("layers", 8, "layers in total")
    flags.DEFINE_integer("width", 1024, "hidden width")
    flags.DEFINE_integer("batch", 512, "batch size")
    flags.DEFINE_integer("rounds", 7, "timed rounds (median)")
    flags.DEFINE_integer(
        "block",
        3,
        "consecutive steps per program and round in the second timing (as training runs "
        "them; the first switches program at every step); 0: round-robin only",
    )
    flags.DEFINE_enum(
        "allocator",
        "both",
        ["both", "default", "keep_freed"],
        "host allocator the programs are timed with: glibc's defaults (XLA CPU allocates each execution's "
        "large buffers afresh, and every step maps and page-faults them anew -- a cost in proportion to "
        "the buffers a step allocates, which accelerator allocators, pooling memory, do not have), "
        "keep_freed (jaxpipe.host_memory.keep_freed_memory()), or both, one after the other in this process",
    )
    flags.DEFINE_string(
        "profile",
        "",
        "after the timed rounds, trace 3 steps of every program with jax.profiler into this folder (one "
        "sub-folder each) and print each program's largest operation kinds (experiments.profiling.by_kind): "
        "thread ms a step, calls a step, ms a call; on one core and one device, what each program computes",
    )


FLAGS = flags.FLAGS


def scan_gpipe(stage_fn, D: int, M: int, mesh):
    """The textbook scan-GPipe's ``value_and_grad``: every stage computes every one of the M + D - 1 ticks."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def loss(ws, xs, ys):
        w, i = ws[0], jax.lax.axis_index("stage")
        mb = xs.shape[1:]

        def tick(c, t):
            state, outs = c
            out = stage_fn(w, jnp.where(i == 0, xs[jnp.clip(t, 0, M - 1)], state))
            k = t - (D - 1)
            outs = jnp.where((i == D - 1) & (k >= 0), outs.at[jnp.clip(k, 0, M - 1)].set(out), outs)
            return (jax.lax.ppermute(out, "stage", [(j, j + 1) for j in range(D - 1)]), outs), None

        zero = lambda s: jax.lax.pcast(jnp.zeros(s), ("stage",), to="varying")
        (_, outs), _ = jax.lax.scan(tick, (zero(mb), zero((M,) + mb)), jnp.arange(M + D - 1))
        return jax.lax.psum(jnp.where(i == D - 1, jnp.mean((outs - ys) ** 2), 0.0), "stage")

    return jax.jit(
        jax.value_and_grad(jax.shard_map(loss, mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=P()))
    )


def mlp_setup(L: int, H: int, B: int, form: str = "scan"):
    """The benchmark's model: ``L`` x ``tanh(h @ W)``, each stage's layers held as ``form``
    (:data:`STAGE_FORMS`); stage_fn, W (stacked ``[L, H, H]``), x, y."""
    import jax
    import numpy as np

    W = jax.random.normal(jax.random.PRNGKey(0), (L, H, H)) / np.sqrt(H)
    x, y = (jax.random.normal(jax.random.PRNGKey(k), (B, H)) for k in (1, 2))
    return layers_fn(form), W, x, y


def build_runs(names, D: int, M: int, L: int, H: int, B: int, anchor: bool = True, form: str = "scan"):
    """``(runs, errs, ref)``: a zero-argument callable per program -- the plain one-device accumulation of
    the M micro-batches, the scan-GPipe anchor (``anchor``), each schedule's ``loss_and_grad`` -- and each
    program's stage gradient beside the plain one's (``ref``); every stage's layers held as ``form``
    (:data:`STAGE_FORMS`; the anchor's always a ``lax.scan``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxpipe as jp

    stage_fn, W, x, y = mlp_setup(L, H, B, form)
    loss = lambda w, xb, yb: jnp.mean((stage_fn(w, xb) - yb) ** 2)

    @jax.jit
    def accum(w, x, y):
        def body(c, xy):
            l, g = jax.value_and_grad(loss)(w, *xy)
            return (c[0] + l / M, jax.tree.map(lambda a, b: a + b / M, c[1], g)), None

        zero = jax.tree.map(jnp.zeros_like, w)
        return jax.lax.scan(body, (0.0, zero), (x.reshape(M, -1, H), y.reshape(M, -1, H)))[0]

    runs, errs = {"plain accumulation": lambda w=held_as(form, W): accum(w, x, y)}, {}
    ref = stacked_back(form, runs["plain accumulation"]()[1])
    if anchor:
        mesh = jax.make_mesh((D,), ("stage",))
        ws = jax.device_put(W.reshape(D, L // D, H, H), NamedSharding(mesh, P("stage")))
        xs, ys = (jax.device_put(a.reshape(M, -1, H), NamedSharding(mesh, P())) for a in (x, y))
        gpipe_anchor = scan_gpipe(layers_fn("scan"), D, M, mesh)
        runs["textbook scan-GPipe"] = lambda: gpipe_anchor(ws, xs, ys)
        errs["textbook scan-GPipe"] = gpipe_anchor(ws, xs, ys)[1].reshape(L, H, H)
    batch = {"x": x, "y": y}
    for spec in names:
        name, _, placement = spec.partition(":")
        S = D * jp.schedules.method(name).stages_per_device({"virtual": 2})
        model = jp.PipelineModel(
            stage_fn=stage_fn,
            stage_params=held_as(form, W.reshape(S, L // S, H, H)),
            post_loss=lambda _, h, b: jnp.mean((h - b["y"]) ** 2),
        )
        pipe = jp.Pipeline(
            model,
            schedule=name,
            num_microbatches=M,
            mesh=jp.make_mesh(stages=D),
            placement=placement or "auto",
        )
        state = pipe.init()
        runs[spec] = lambda p=pipe, s=state: p.loss_and_grad(s, batch)
        errs[spec] = stacked_back(form, runs[spec]()[1][0]).reshape(L, H, H)
    return runs, errs, ref


def pin_cores(n: int) -> None:
    """This process (and the threads XLA starts later) on its first ``n`` CPU cores; 0: as it is."""
    if n:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:n]))


def timed(runs, rounds: int, block: int):
    """Per program: median ms per step, the median page faults and kernel ms per step (this process's
    ``getrusage`` around each call), the programs round-robin for ``rounds`` rounds; then (``block`` > 0) the
    ratio to the plain step with each program run ``block`` steps in a row per round (median of the rounds'
    ratios; nan where ``block`` is 0)."""
    import resource
    import jax
    import numpy as np
    from experiments.bench import block_medians, interleaved_medians, median_ratio, ratio_spread

    usage = {k: [] for k in runs}

    def counted(k, run):
        def call():
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            out = jax.block_until_ready(run())
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            usage[k].append((r1.ru_minflt - r0.ru_minflt, 1e3 * (r1.ru_stime - r0.ru_stime)))
            return out

        return call

    times = interleaved_medians({k: counted(k, r) for k, r in runs.items()}, rounds)
    out = {
        k: (
            1e3 * float(np.median(times[k])),
            float(np.median([u[0] for u in usage[k][-rounds:]])),
            float(np.median([u[1] for u in usage[k][-rounds:]])),
        )
        for k in runs
    }
    blocks = block_medians(runs, rounds, block) if block else None
    # + (consecutive ratio, (round-robin ratio, its spread)): the ratios of each round, not of the medians
    return {
        k: v
        + (
            median_ratio(blocks[k], blocks["plain accumulation"]) if blocks else float("nan"),
            ratio_spread(times[k], times["plain accumulation"]),
        )
        for k, v in out.items()
    }


def allocator_phases(which: str):
    """The allocator phases ``--allocator`` asks for, in the order they must run: glibc's defaults can only
    be measured before ``keep_freed_memory`` (which is permanent); yields each phase's name after setting
    it."""
    from jaxpipe import host_memory

    if which in ("both", "default"):
        if host_memory.keeps_freed_memory():
            raise app.UsageError(
                "glibc was started keeping freed memory (MALLOC_*_ in the environment), so its "
                "defaults cannot be measured here: unset them, or pass --allocator=keep_freed"
            )
        yield "glibc defaults"
    if which in ("both", "keep_freed"):
        if not host_memory.keep_freed_memory():
            print(f"--allocator={which}: {host_memory.describe()}; the kept-memory phase is skipped")
            return
        yield "freed memory kept"


def main(argv):
    del argv
    pin_cores(FLAGS.cores)
    from experiments import emulate_cpu_devices

    D, M, L, H, B = FLAGS.stages, FLAGS.microbatches, FLAGS.layers, FLAGS.width, FLAGS.batch
    emulate_cpu_devices(D)
    import jax
    import jax.numpy as jnp

    from jaxpipe import host_memory

    host_memory.choose(FLAGS.allocator == "keep_freed")  # the Pipelines built next leave the defaults alone
    from experiments.bench import MachineWatch

    watch = MachineWatch()  # before this run's own work, on the cores it was pinned to
    runs, errs, ref = build_runs(FLAGS.schedules.split(","), D, M, L, H, B, form=FLAGS.stage_form)
    phases = {name: timed(runs, FLAGS.rounds, FLAGS.block) for name in allocator_phases(FLAGS.allocator)}
    print(
        f"jax {jax.__version__}, {D} emulated devices on {len(os.sched_getaffinity(0))} core(s); MLP {L} x "
        f"{H}^2 tanh, stage form {FLAGS.stage_form}; batch {B}, M={M}; medians of {FLAGS.rounds} "
        "rounds "
        f"per allocator phase (one process: " + " first, then ".join(phases) + "); x plain: programs "
        f"round-robin, step by step; consecutive: {FLAGS.block} steps in a row of each"
    )
    head = "".join(f" {p}: ms | x plain | consecutive | faults/step | kernel ms |" for p in phases)
    print(f"| program |{head} gradient rel. error |\n|---|" + "---|---|---|---|---|" * len(phases) + "---|")
    for k in runs:
        cells = "".join(
            f" {t[k][0]:.1f} | {t[k][4][0]:.3f}x +- {t[k][4][1]:.3f} | {t[k][3]:.3f}x | "
            f"{t[k][1]:.0f} | {t[k][2]:.1f} |"
            for t in phases.values()
        )
        err = 0.0 if k not in errs else float(jnp.linalg.norm(errs[k] - ref) / jnp.linalg.norm(ref))
        print(f"| {k} |{cells} {err:.1e} |")
    spreads = {f"{k} ({p})": t[k][4] for p, t in phases.items() for k in runs if k != "plain accumulation"}
    print(watch.summary())
    for w in watch.warnings(spreads):
        print("warning: " + w)
    if FLAGS.profile:
        print_profiles(runs, FLAGS.profile)


def print_profiles(runs, folder: str, steps: int = 3, kinds: int = 12) -> None:
    """Trace ``steps`` calls of each program of ``runs`` into ``folder`` and print, per program, its wall
    time and its ``kinds`` largest operation kinds."""
    import re

    from experiments.profiling import by_kind, trace_steps

    for name, run in runs.items():
        b = trace_steps(run, steps, os.path.join(folder, re.sub(r"[^A-Za-z0-9_.-]+", "_", name)))
        print(f"\n{name}: {b.wall_ms:.1f} ms a traced step; largest operation kinds (thread time)")
        print("| category | kind | ms/step | calls/step | ms a call |\n|---|---|---|---|---|")
        for cat, kind, ms, calls, each in by_kind(b, kinds):
            print(f"| {cat} | {kind} | {ms:.2f} | {calls:.0f} | {each:.3f} |")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
