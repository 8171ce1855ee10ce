"""Single-device stage efficiency on the running backend (run it on a GPU to see the accelerator's side).

    python -m experiments.stage_efficiency                    # MLP stage (layers x width^2 tanh) and GPT stage
    python -m experiments.stage_efficiency --widths=1024,4096 --microbatch_sizes=64,256,1024

For each micro-batch size it times one stage's forward and forward+backward (``jax.vjp``, as the executor
runs them), jitted, median of ``--reps`` calls after warm-up, and reports achieved TFLOP/s (MLP: 2 B W^2
per layer forward, twice that backward).  Then the D = 1 pipeline step (the executor's scan/switch/buffers
around the same work) against the plain jitted step accumulating the same micro-batches: the executor's
own overhead with no pipeline to hide it.
"""
from __future__ import annotations

import statistics
import time

from experiments import cli
from absl import app, flags

flags.DEFINE_string("widths", "1024,4096", "MLP widths")
flags.DEFINE_integer("layers", 4, "MLP layers per stage")
flags.DEFINE_string("microbatch_sizes", "64,256,1024,4096", "micro-batch sizes B")
flags.DEFINE_integer("reps", 20, "timed calls per measurement")
flags.DEFINE_string("precision", "default", "jax_default_matmul_precision: default | high | highest")
flags.DEFINE_string("json_out", "", "optional JSON output path")
FLAGS = flags.FLAGS


def _time(fn, *args, reps=20):
    import jax
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv):
    del argv
    import json
    import jax
    import jax.numpy as jnp
    import optax
    from jaxpipe.bench import make_tanh_mlp, pipeline_runner, plain_runner, interleaved_medians, median_ratio

    jax.config.update("jax_default_matmul_precision", FLAGS.precision)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.platform} ({getattr(dev, 'device_kind', '?')}), matmul precision "
          f"{FLAGS.precision}", flush=True)
    rows = []
    print("| stage | B | forward ms | fwd+bwd ms | forward TFLOP/s | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for W in [int(w) for w in FLAGS.widths.split(",")]:
        model = make_tanh_mlp(1, FLAGS.layers, W)
        w = model.stage_params[0]
        for B in [int(b) for b in FLAGS.microbatch_sizes.split(",")]:
            x = jax.random.normal(jax.random.key(0), (B, W), jnp.float32)
            fwd = jax.jit(model.stage_fn)

            def fb(w, x):
                y, pull = jax.vjp(model.stage_fn, w, x)
                return pull(jnp.ones_like(y))

            fb = jax.jit(fb)
            tf, tfb = _time(fwd, w, x, reps=FLAGS.reps), _time(fb, w, x, reps=FLAGS.reps)
            flops = 2.0 * B * W * W * FLAGS.layers
            r = {"stage": f"mlp {FLAGS.layers}x{W}^2", "B": B, "fwd_ms": tf * 1e3, "fb_ms": tfb * 1e3,
                 "fwd_tflops": flops / tf / 1e12, "fb_tflops": 3 * flops / tfb / 1e12}
            rows.append(r)
            print(f"| {r['stage']} | {B} | {r['fwd_ms']:.3f} | {r['fb_ms']:.3f} | {r['fwd_tflops']:.1f} | "
                  f"{r['fb_tflops']:.1f} |", flush=True)
    # the executor at D = 1 against the plain accumulating step, same model and micro-batches
    W, M, Bt = int(FLAGS.widths.split(",")[0]), 8, 8 * int(FLAGS.microbatch_sizes.split(",")[-1])
    model = make_tanh_mlp(1, FLAGS.layers, W)
    batch = {"x": jax.random.normal(jax.random.key(1), (Bt, W), jnp.float32),
             "y": jnp.zeros((Bt, W), jnp.float32)}
    opt = optax.adamw(1e-3)
    runners = {"accum": plain_runner(model, batch, M, opt)}
    runners["1f1b_D1"], info = pipeline_runner("1f1b", model, batch, M, opt)
    times = interleaved_medians(runners, 9)
    ratio = median_ratio(times["1f1b_D1"], times["accum"])
    print(f"\nD=1 pipeline step vs plain accumulating step (MLP {FLAGS.layers}x{W}^2, batch {Bt}, M={M}, AdamW): "
          f"{statistics.median(times['1f1b_D1']) * 1e3:.2f} ms vs {statistics.median(times['accum']) * 1e3:.2f} "
          f"ms, ratio {ratio:.3f}x (median of 9 interleaved rounds)")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as fh:
            json.dump({"rows": rows, "d1_ratio": ratio, "device": str(dev)}, fh, indent=1)


if __name__ == "__main__":
    cli.run(main)
