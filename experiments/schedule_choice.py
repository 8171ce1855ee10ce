"""Which synchronous schedule pays off on real devices: each schedule's step predicted on D devices from the
per-op costs measured here and its lockstep lane plan (``jaxpipe.tune.lockstep``), checked first against
what can be measured here -- the one-core step, where every device's work adds up.

    python -m experiments.schedule_choice                   # quiet machine: one core, D = 4 measured
    python -m experiments.schedule_choice --link_gbps=25 --link_us=20

1. On ``--cores`` core(s) (1: nothing runs side by side) it measures one layer's F, B and zero-bubble B/W
   on one micro-batch, one ``ppermute`` over the emulated devices, and each schedule's ``loss_and_grad`` at
   D = ``--stages``, M = ``--microbatches`` beside the plain accumulation (``experiments.executor_cost``'s
   model).  The executor's fixed cost per device and lane-tick is the median of what each schedule's time
   implies; each schedule's one-core step is then predicted and compared with its measurement.  Timed with
   glibc keeping freed memory (``jaxpipe.host_memory``: no per-step page faults, which accelerators do not
   have) unless ``--allocator=default``.
2. For D in ``--devices`` and M in ``--microbatch_counts`` it predicts the step on D real devices, each as
   fast as this core at these ops, linked at ``--link_gbps`` GB/s with ``--link_us`` per message, for a
   model of ``--real_layers`` layers of the same width cut evenly, and says which schedule is fastest.
"""

from __future__ import annotations

import functools
import os

from jaxpipe.cli import common as cli
from absl import app, flags

from experiments import executor_cost


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    executor_cost.define_flags()  # its flags are this runner's too
    flags.DEFINE_string("devices", "4,8", "device counts D to predict for")
    flags.DEFINE_string("microbatch_counts", "8,32", "micro-batch counts M to predict for")
    flags.DEFINE_integer(
        "real_layers", 16, "layers of the model the predictions cut (2 x D stages must divide it)"
    )
    flags.DEFINE_float("link_gbps", 50.0, "predicted devices' link bandwidth, GB/s per message")
    flags.DEFINE_float("link_us", 10.0, "predicted devices' fixed cost per message, microseconds")


FLAGS = flags.FLAGS
SYNC = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v", "chimera")


def build(name: str, D: int, M: int):
    import jaxpipe as jp

    keys = jp.schedules.method(name).builder_keys
    return jp.schedules.build(name, D, M, **({"virtual": 2} if "virtual" in keys else {}))


def one_core_check(names, costs, copy, D, M, L, H, B):
    """Measure and predict the one-core steps; returns the per-op costs as a step pays them (the isolated
    measurement scaled so that the plain accumulation is its ops) and the calibrated tick (seconds)."""
    import numpy as np
    from experiments.bench import interleaved_medians
    from jaxpipe.tune import calibrate_tick, predict_one_core

    runs, _, _ = executor_cost.build_runs(names, D, M, L, H, B, anchor=False)
    t = {k: float(np.median(v)) for k, v in interleaved_medians(runs, FLAGS.rounds).items()}
    act, plain = (B // M) * H * 4, t.pop("plain accumulation")
    # an op inside a step streams its weights from memory and adds to gradient sums, which the isolated
    # micro-benchmark (one stage's weights, hot in cache) does not: scaled so the plain step is its ops
    scale = plain / (M * L * (costs.f + costs.b))
    costs = costs.scaled(scale)
    built = {n: build(n, D, M) for n in names}
    args = lambda n: (built[n], costs, L / built[n].num_model_stages)
    stage = lambda n: L / built[n].num_model_stages * H * H * 4
    # the median of what each schedule's measurement implies: one schedule alone is at the noise (+-3%)
    implied = {n: calibrate_tick(*args(n), copy, act, stage(n), t[n]) for n in names}
    tick = float(np.median(list(implied.values())))
    print(
        f"\nOne core, D = {D}, M = {M}: plain accumulation {plain * 1e3:.1f} ms = its {M * L * 2} layer ops "
        "at "
        f"{scale:.2f}x their isolated cost; the executor's fixed cost per device and lane-tick "
        f"{tick * 1e6:.0f} us (the median of what each schedule's time implies: "
        f"{', '.join(f'{n} {v * 1e6:.0f}' for n, v in implied.items())})"
    )
    print("| schedule | measured ms | x plain | predicted ms (ops + fixed + messages + layout) | error |")
    print("|---|---|---|---|---|")
    for n in names:
        p = predict_one_core(*args(n), tick, copy, act, stage(n))
        step = p["step"]
        print(
            f"| {n} | {t[n] * 1e3:.1f} | {t[n] / plain:.3f}x | {step * 1e3:.1f} ({p['work'] * 1e3:.0f} + "
            f"{p['fixed'] * 1e3:.0f} + {p['messages'] * 1e3:.0f} + {p['layout'] * 1e3:.0f}) | "
            f"{(step - t[n]) / t[n] * 100:+.1f}% |"
        )
    return costs, tick


def real_devices(names, costs, tick, H, mb):
    from jaxpipe.tune import Link, predict_devices
    from jaxpipe.tune.lockstep import fastest

    link = Link(FLAGS.link_us * 1e-6, 1.0 / (FLAGS.link_gbps * 1e9))
    print(
        f"\nPredicted on real devices (each as fast as this core at these ops; {FLAGS.link_gbps:g} GB/s and "
        f"{FLAGS.link_us:g} us per message; fixed cost {tick * 1e6:.0f} us per lane-tick); a model of "
        f"{FLAGS.real_layers} x {H}^2 layers, micro-batches of {mb} rows:"
    )
    for D in (int(v) for v in FLAGS.devices.split(",")):
        for M in (int(v) for v in FLAGS.microbatch_counts.split(",")):
            preds, parts, refused = {}, {}, []
            for n in names:
                try:
                    s = build(n, D, M)
                except ValueError as e:  # ScheduleError: e.g. DualPipeV needs M >= 2 D
                    refused.append(f"{n} ({str(e).split(';')[0]})")
                    continue
                per = FLAGS.real_layers / s.num_model_stages
                parts[n] = predict_devices(s, costs, per, tick, link, mb * H * 4, per * H * H * 4)
                preds[n] = parts[n]["step"]
            order = fastest(preds)
            (best, tb, _), (second, ts, _) = order[0], order[1]
            print(
                f"\nD = {D}, M = {M}: fastest **{best}** ({tb * 1e3:.1f} ms), {(ts / tb - 1) * 100:.1f}% "
                "ahead of "
                f"{second}"
                + (f"; 1f1b {(preds['1f1b'] / tb - 1) * 100:+.1f}%" if "1f1b" in preds else "")
                + (f"; not built: {', '.join(refused)}" if refused else "")
            )
            print(
                "| schedule | predicted ms | x fastest | bubble-free ms | lane-ticks | fixed ms | messages "
                "ms |"
            )
            print("|---|---|---|---|---|---|---|")
            for n, v, x in order:
                q = parts[n]
                print(
                    f"| {n} | {v * 1e3:.1f} | {x:.3f} | {q['busy'] * 1e3:.1f} | {q['lane_ticks']:.0f} | "
                    f"{q['fixed'] * 1e3:.1f} | {(q['messages'] + q['layout']) * 1e3:.1f} |"
                )


def main(argv):
    del argv
    from jaxpipe import host_memory

    host_memory.choose(
        FLAGS.allocator != "default"
    )  # measured once: memory kept unless defaults are asked for
    alloc = host_memory.describe()
    executor_cost.pin_cores(FLAGS.cores)
    from experiments import emulate_cpu_devices

    D, M, L, H, B = FLAGS.stages, FLAGS.microbatches, FLAGS.layers, FLAGS.width, FLAGS.batch
    emulate_cpu_devices(D)
    import jax
    from jaxpipe.tune import Link
    from jaxpipe.tune.microbench import layer_costs, p2p_alpha_beta

    for d in (int(v) for v in FLAGS.devices.split(",")):
        if FLAGS.real_layers % (2 * d):
            raise app.UsageError(
                f"--real_layers={FLAGS.real_layers} must be a multiple of 2 x D = {2 * d} (two "
                f"chunks per device for interleaved and the V-schedules)"
            )
    stage_fn, W, x, _ = executor_cost.mlp_setup(L, H, B)
    k = L // D
    costs = layer_costs(stage_fn, W[:k], x[: B // M], k)
    copy = Link(*p2p_alpha_beta(D))
    print(
        f"jax {jax.__version__}, {D} emulated devices on {len(os.sched_getaffinity(0))} core(s), {alloc}. "
        "Per layer and "
        f"micro-batch ({B // M} x {H}): F {costs.f * 1e3:.3f} ms, B {costs.b * 1e3:.3f}, zero-bubble B "
        f"{costs.b_input * 1e3:.3f} + W {costs.w * 1e3:.3f}; one ppermute over {D} devices here: "
        f"{copy.alpha * 1e6:.0f} us + {copy.beta * 1e9:.2f} ns/byte"
    )
    names = chosen_schedules(FLAGS.schedules)
    costs, tick = one_core_check(names, costs, copy, D, M, L, H, B)
    real_devices(names, costs, tick, H, B // M)


def chosen_schedules(flag: str):
    """The ``--schedules`` to compare: synchronous ones (those the performance model predicts), two or
    more."""
    names = [n.strip() for n in flag.split(",") if n.strip()]
    bad = [n for n in names if n not in SYNC]
    if bad or len(names) < 2:
        raise app.UsageError(
            f"--schedules={flag!r}: give two or more of {', '.join(SYNC)}"
            + (f" ({', '.join(bad)} is not one)" if bad else " to compare")
        )
    return names


if __name__ == "__main__":
    define_flags()
    cli.run(main)
