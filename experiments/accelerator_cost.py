"""What the executor costs a device beyond the model's own work, on any backend.

    python -m experiments.accelerator_cost          # D = 1: MLP 4x4096^2, MLP 4x1024^2, GPT d1024
    python -m experiments.accelerator_cost --stages=4 --models=gpt --residuals=all,inputs,dots
    python -m experiments.accelerator_cost --small --timed  # tiny sizes, timed on any backend

For each model it compares, in one process, the plain jitted one-device step that accumulates the same M
micro-batches and applies one AdamW update (``experiments.bench.plain_train_step``, the whole model on one
device) with the pipeline on D = ``--stages`` devices:

* ``program``: the pipeline's jitted step function called directly (the device program alone);
* ``step``: ``Pipeline.step`` as a user calls it (on-device checks on, the default).

Costs (any backend, no run needed): XLA's own ``cost_analysis()`` flops and bytes accessed and
``memory_analysis()`` temp bytes of each compiled program (per device), as ratios to the plain step's.  Times
(on an accelerator, or with ``--timed``): ``blocked`` waits after every step; ``stream`` runs ``--steps``
steps back to back and waits once, as a training loop does.  On XLA CPU the costs are the proxy; on a GPU, the
truth.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

from jaxpipe.cli import common as cli
from absl import app, flags


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_string(
        "models",
        "mlp4096,mlp1024,gpt",
        "mlp4096 (4x4096^2, 1024-row micro-batches), mlp1024 "
        "(4x1024^2, 256 rows), gpt (d1024, 16 heads, 4 blocks, T 1024, 8 rows)",
    )
    flags.DEFINE_string(
        "placement", "auto", "lane placement of every schedule (auto, lanes, ordered, ordered2)"
    )
    flags.DEFINE_integer("stages", 1, "pipeline devices D (the model's 4 layers / blocks cut into D stages)")
    flags.DEFINE_integer("microbatches", 8, "micro-batches M per step")
    flags.DEFINE_string("schedules", "1f1b", "schedules to compare")
    flags.DEFINE_string(
        "residuals",
        "all",
        "residual policies to compare (Pipeline(residuals=...)): all, inputs, "
        "dots (jax.checkpoint_policies.dots_with_no_batch_dims_saveable)",
    )
    flags.DEFINE_bool("small", False, "tiny sizes (a smoke test)")
    flags.DEFINE_bool("timed", None, "time the steps (default: on anything but CPU)")
    flags.DEFINE_integer("steps", 20, "steps back to back in a 'stream' timing")
    flags.DEFINE_integer(
        "hlo_lines",
        0,
        "also print each program's bytes with its loops counted as often as they run "
        "(jaxpipe.hlo_bytes: XLA's own figure counts a loop body once) and its N dearest HLO lines",
    )


FLAGS = flags.FLAGS


def models(names, D, small, layers=4):
    """``{name: (model, batch, M)}``: the sizes of the H200 measurement (docs/benchmarks.md; or tiny ones),
    ``layers`` layers (blocks) cut into ``D`` stages."""
    import jax
    import jax.numpy as jnp
    from jaxpipe import models as zoo
    from jaxpipe.bench import make_tanh_mlp

    M, key, out = FLAGS.microbatches, jax.random.key(1), {}
    for name in names:
        if name.startswith("mlp"):
            W, rows = (256, 32) if small else ((4096, 1024) if name == "mlp4096" else (1024, 256))
            out[name] = (
                make_tanh_mlp(D, layers // D, W),
                {"x": jax.random.normal(key, (rows * M, W)), "y": jnp.zeros((rows * M, W))},
            )
        elif name == "gpt":
            d, T, rows = (64, 32, 2) if small else (1024, 1024, 8)
            x = jax.random.randint(key, (rows * M, T), 0, 256, jnp.int32)
            out[name] = (
                zoo.gpt(
                    D,
                    vocab=256,
                    d_model=d,
                    heads=16 if not small else 4,
                    blocks_per_stage=layers // D,
                    seq_len=T,
                ),
                {"x": x, "y": jnp.roll(x, -1, axis=1)},
            )
        else:
            raise app.UsageError(f"--models: unknown model {name!r}; choose from mlp4096, mlp1024, gpt")
    return out


def measure(step, timed, n):
    """(blocked ms, stream ms per step), NaN where not timed."""
    import jax

    if not timed:
        return math.nan, math.nan
    for _ in range(3):
        jax.block_until_ready(step())
    blocked = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(step())
        blocked.append(time.perf_counter() - t0)
    stream = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            r = step()
        jax.block_until_ready(r)
        stream.append((time.perf_counter() - t0) / n)
    return statistics.median(blocked) * 1e3, statistics.median(stream) * 1e3


def costs(compiled):
    """(flops, bytes accessed, temp bytes[, HLO byte account]) of a compiled program (per device)."""
    from jaxpipe.bench import compiled_costs

    if not FLAGS.hlo_lines:
        return compiled_costs(compiled)
    from jaxpipe.hlo_bytes import account

    return (*compiled_costs(compiled), account(compiled.as_text(), FLAGS.hlo_lines))


def residual_policy(name):
    import jax

    return {
        "all": "all",
        "inputs": "inputs",
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }[name]


def bench(label, model, batch, D, timed, scheds, layers):
    """Rows ``(what, (blocked, stream), (flops, bytes, temp) or None)`` for one model: its plain step, then
    each of ``scheds`` on the same ``layers`` layers."""
    import jax
    import optax
    from jaxpipe import Pipeline, make_mesh
    from jaxpipe.bench import plain_train_step

    opt, M = optax.adamw(1e-4), FLAGS.microbatches
    dev = jax.devices()[0]
    fn = plain_train_step(model, opt, M)
    st = {"p": jax.device_put(model.params, dev, may_alias=False)}
    st["o"] = jax.jit(opt.init)(st["p"])
    b = jax.device_put(batch, dev)

    def plain():
        st["p"], st["o"], loss = fn(st["p"], st["o"], b)
        return loss

    rows = [("plain", measure(plain, timed, FLAGS.steps), costs(fn.lower(st["p"], st["o"], b).compile()))]
    st.clear()  # the plain step's state freed before the pipelines are built
    from jaxpipe import schedules

    for schedule in scheds:
        # a schedule with several model stages a device (interleaved, the V-schedules) gets the same layers
        # cut into that many more stages: the same work as the plain step
        n = D * schedules.method(schedule).stages_per_device({})
        staged = model if n == D else models([label], n, FLAGS.small, layers)[label][0]
        for res in FLAGS.residuals.split(","):
            pipe = Pipeline(
                staged,
                schedule=schedule,
                num_microbatches=M,
                optimizer=opt,
                mesh=make_mesh(stages=D),
                residuals=residual_policy(res),
                placement=FLAGS.placement,
            )
            box = {"s": pipe.init()}
            pb = pipe.shard_batch(batch)
            what = f"{schedule} residuals={res}"
            program = pipe._runner._fn("step", pb, box["s"])  # the jitted step function itself

            def run_program():
                box["s"], m = program(box["s"], pb)
                return m["loss"]

            def run_step():
                box["s"], m = pipe.step(box["s"], pb)
                return m["loss"]

            rows.append(
                (
                    f"{what} program",
                    measure(run_program, timed, FLAGS.steps),
                    costs(program.lower(box["s"], pb).compile()),
                )
            )
            rows.append((f"{what} step", measure(run_step, timed, FLAGS.steps), None))
            box.clear()
    return rows


def report(label, rows, timed):
    (bl0, sm0), (f0, by0, t0) = rows[0][1], rows[0][2][:3]
    for what, (bl, sm), c in rows:
        times = (
            f"blocked {bl:8.3f} ms ({bl / bl0:.3f}x)  stream {sm:8.3f} ms ({sm / sm0:.3f}x)" if timed else ""
        )
        cost = (
            ""
            if c is None
            else (
                f"  flops {c[0] / max(f0, 1):.2f}x  bytes {c[1] / max(by0, 1):.2f}x  "
                f"temp {c[2] / 2**20:,.0f} MiB ({c[2] / max(t0, 1):.2f}x)"
            )
        )
        if times or cost:
            print(f"| {label} | {what} | {times}{cost} |", flush=True)
    for what, _, c in rows:
        if c is not None and len(c) > 3:
            a, a0 = c[3], rows[0][2][3]
            print(
                f"  {label} {what}: {a.static / 1e6:,.1f} MB with each loop body once (XLA's count), "
                f"{a.per_call / 1e6:,.1f} MB per call ({a.per_call / max(a0.per_call, 1):.2f}x the plain "
                "step's) "
                f"with loops {[n for n, _ in a.loops]} times; conditionals at their dearest branch"
            )
            for comp, line, b in a.top:
                print(f"    {b / 1e6:9.1f} MB  {line}   [{comp}]")


def main(argv):
    del argv
    from experiments import emulate_cpu_devices

    emulate_cpu_devices(max(FLAGS.stages, 1))
    import jax

    D = FLAGS.stages
    if D not in (1, 2, 4):
        raise app.UsageError(f"--stages={D}: the models have 4 layers / blocks; use 1, 2 or 4")
    for r in FLAGS.residuals.split(","):
        if r not in ("all", "inputs", "dots"):
            raise app.UsageError(f"--residuals: unknown policy {r!r}; choose from all, inputs, dots")
    dev = jax.devices()[0]
    timed = FLAGS.timed if FLAGS.timed is not None else dev.platform != "cpu"
    print(
        f"jax {jax.__version__} on {dev.platform} ({getattr(dev, 'device_kind', '?')}), D = {D}, "
        f"M = {FLAGS.microbatches}{'' if timed else ' (costs only: --timed to time on CPU)'}",
        flush=True,
    )
    print("| model | program | ratios to the plain one-device step |\n|---|---|---|")
    from jaxpipe import schedules

    # layers -> schedules: 4, or one a stage where a schedule has more than 4 stages (zb_v at D = 4)
    groups = {}
    for s in FLAGS.schedules.split(","):
        groups.setdefault(max(4, D * schedules.method(s).stages_per_device({})), []).append(s)
    for layers, scheds in groups.items():
        if layers != 4:
            print(
                f"| ({layers} layers: {', '.join(scheds)} at D = {D} cut one a stage; the plain step runs "
                "the "
                f"same {layers}) | | |"
            )
        for label, (model, batch) in models(FLAGS.models.split(","), D, FLAGS.small, layers).items():
            report(label, bench(label, model, batch, D, timed, scheds, layers), timed)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
