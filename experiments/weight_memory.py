"""Weight memory of the no-flush methods, measured, beside PipeOptim's Table II.

    python -m experiments.weight_memory                  # MLP 8 x 1024², D=4, M=8, AdamW

Table II of PipeOptim states each method's *weights memory* in units of one stage's weights M_θ (PipeDream
[M_θ, D M_θ], PipeDream-2BW 2 M_θ, SpecTrain 2 M_θ, PipeOptim [M_θ, 2 M_θ]).  This runner reports, per device
and in the same unit: the versions jaxpipe declares (the simulator's ``weight_versions``, stage 0 .. D-1),
what the train state really holds between calls (the stage's weights plus the weight policy's state,
split into weight versions / updates kept for prediction / gradient accumulators), and the temporary
bytes XLA allocates for one compiled step (``compiled.memory_analysis()``: where a predicted ŵ or a
gradient is materialised).  SPMD allocates the same buffers on every device, so the measured figure is
the declared maximum on every stage.
"""

from __future__ import annotations

import functools
from jaxpipe.cli import common as cli
from absl import flags

from experiments import emulate_cpu_devices


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_string(
        "methods",
        "pipedream,pipedream_2bw,spectrain,pipeoptim,pipeoptim:code,pipeoptim:decay_free,cdp_v1,cdp_v2,wpipe",
        "methods (pipeoptim:<option value> for variants)",
    )
    flags.DEFINE_integer("stages", 4, "pipeline stages D")
    flags.DEFINE_integer("microbatches", 8, "micro-batches M")
    flags.DEFINE_integer("width", 1024, "hidden width")
    flags.DEFINE_integer("layers", 8, "layers in all")
    flags.DEFINE_integer("batch", 512, "global batch")


FLAGS = flags.FLAGS

PAPER = {
    "pipedream": "[1, D] (stashing)",
    "pipedream_2bw": "2",
    "spectrain": "2",
    "pipeoptim": "[1, 2]",
    "cdp_v1": "2 (2BW's rule)",
    "cdp_v2": "1 + shadow (§3.2: 'no copy')",
    "wpipe": "G0: 2, G1: 1 (eq. 1)",
}
VARIANTS = {"code": {"distance": "code"}, "decay_free": {"prediction": "decay_free"}}


def _bytes(tree) -> int:
    import jax

    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def measure(name: str, options: dict):
    import jax.numpy as jnp
    import optax
    import jaxpipe as jp
    from jaxpipe.bench import make_tanh_mlp

    D, M = FLAGS.stages, FLAGS.microbatches
    stages = 2 * D if name == "wpipe" else D
    model = make_tanh_mlp(stages, FLAGS.layers // stages, FLAGS.width)
    opt = optax.sgd(1e-3, momentum=0.9) if name == "spectrain" else optax.adamw(1e-3)
    pipe = jp.Pipeline(
        model,
        schedule=name,
        num_microbatches=M,
        optimizer=opt,
        mesh=jp.make_mesh(stages=D),
        options=options or None,
    )
    state = pipe.init()
    x = jnp.zeros((FLAGS.batch, FLAGS.width), jnp.float32)
    batch = {"x": x, "y": x}
    state = pipe.prepare(state, batch)
    ma = pipe.lower("step", state, batch).compile().memory_analysis()
    unit = _bytes(model.stage_params) / stages  # M_θ: one stage's weights
    per_dev = lambda b: b / D / unit
    # per model chunk of a device (WPipe: G0 and G1), its weights and what its policy keeps beside them
    K = pipe.schedule.periodic.chunks
    params, pstates = (
        (state.params, state.policy_state) if K > 1 else ((state.params,), (state.policy_state,))
    )
    v = u = a = 0
    for lp, ps in zip(params, pstates):
        v += _bytes(lp[0])
        fields = getattr(ps, "_fields", ())
        if "shadow" in fields:  # 2BW / CDP / WPipe's G0: the previous version and the sums
            v, a = v + _bytes(ps.shadow[0]), a + _bytes(ps.acc[0])
        elif "acc" in fields:  # WPipe's G1: one version and the batch's sum
            a += _bytes(ps.acc[0])
        elif "pending" in fields:  # PipeOptim decay_free: the update and its direction
            u += _bytes(ps.pending[0]) + _bytes(ps.direction[0])
        elif name == "pipedream":  # the stash: D slots of every stage's versions
            v += _bytes(ps[0])
        else:  # PipeOptim / SpecTrain: the last update
            u += _bytes(ps[0])
    versions, updates, accs = per_dev(v), per_dev(u), per_dev(a)
    return {
        "declared": list(pipe.schedule.weight_versions),
        "versions": versions,
        "updates": updates,
        "accs": accs,
        "temp": ma.temp_size_in_bytes / unit,
        "unit_mib": unit / 2**20,
    }


def main(argv):
    del argv
    emulate_cpu_devices(FLAGS.stages)
    print(
        f"MLP {FLAGS.layers} x {FLAGS.width}², D={FLAGS.stages}, M={FLAGS.microbatches}, AdamW (spectrain: "
        "SGD-momentum); per device, "
        f"in units of one stage's weights M_θ"
    )
    print(
        "| method | PipeOptim Table II / paper | declared (simulator, stage 0..D-1) | state: weight "
        "versions | "
        "state: updates kept for prediction | state: gradient accumulators | XLA temp of one step | M_θ MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec in FLAGS.methods.split(","):
        name, _, var = spec.partition(":")
        r = measure(name, VARIANTS.get(var, {}))
        print(
            f"| {spec} | {PAPER.get(name, '-')} | {r['declared']} | {r['versions']:.2f} | "
            f"{r['updates']:.2f} | "
            f"{r['accs']:.2f} | {r['temp']:.2f} | {r['unit_mib']:.1f} |"
        )
    print(
        "(M_θ: one model stage's weights; WPipe's model has 2D stages, two per device. The optimizer's own "
        "state -- AdamW's two moments -- is not counted)"
    )


if __name__ == "__main__":
    define_flags()
    cli.run(main)
