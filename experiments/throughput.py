"""Pipeline-overhead benchmark: pipelined step time over the plain one-device step, same process.

    python -m experiments.throughput                     # MLP 8 x (1024x1024 tanh), batch 512, D=4, M=8
    python -m experiments.throughput --schedules=1f1b --steps=9

For each schedule it prints: the pipelined ``step`` time (median of ``--steps`` after warm-up), its ratio to
the plain one-device ``jax.jit`` step that accumulates the gradient over the same M micro-batches with a
``lax.scan`` and applies the same optax update (the *pipeline overhead*), the ratio to the unchunked plain
step (one gradient over the whole batch), XLA temporary bytes per device, and compile time at M and at
``--compile_m2`` micro-batches (must stay nearly flat: the executor scans over ticks).  Two timings: the
*overhead* alternates the runners step by step (robust to the machine drifting), the *consecutive* one runs
each ``--block`` steps in a row (as training does; ``bench.block_medians``); both are ratios within a round.
"""

from __future__ import annotations

import os
import sys

from jaxpipe.cli import common as cli
from absl import app, flags

from experiments import with_device_count

flags.DEFINE_string(
    "schedules",
    "gpipe,1f1b,1f1b_pytree,interleaved_1f1b,zb_h1,zb_v,dualpipe_v,chimera,pipedream,pipedream_2bw,spectrain,"
    "pipeoptim,cdp_v1,cdp_v2,wpipe,avgpipe,cdp_dp_v1,cdp_dp_v2",
    "comma-separated schedules to benchmark (spectrain runs with SGD-momentum and is compared "
    "with a plain step using that optimizer when --optimizer has no momentum). Variants: "
    "1f1b_pytree (the activation as a pytree of two halves), zb_h1_recompute (ZB-H1 with "
    "options={'w_from': 'recompute'}: W back-propagates through the stage again)",
)
flags.DEFINE_integer("stages", 4, "pipeline stages D (CPU-emulated devices)")
flags.DEFINE_integer("microbatches", 8, "micro-batches M per step")
flags.DEFINE_integer("layers", 8, "MLP layers h = tanh(h @ W) in total (split evenly over stages)")
flags.DEFINE_integer("width", 1024, "hidden width (W is width x width)")
flags.DEFINE_integer("batch", 512, "global batch size")
flags.DEFINE_integer("steps", 7, "timed steps per configuration (median reported)")
flags.DEFINE_integer(
    "block",
    5,
    "also time each runner this many steps in a row (consecutive steps, as in "
    "training), --block_rounds times; 0 = skip. Reported as the 'consecutive' overhead",
)
flags.DEFINE_integer("block_rounds", 3, "rounds of the consecutive-steps timing")
flags.DEFINE_integer("compile_m2", 64, "second micro-batch count for the compile-time check (0 = skip)")
flags.DEFINE_string("optimizer", "adamw", "optax optimizer applied by both the plain and the pipelined step")
flags.DEFINE_string("json_out", "", "optional path: write the table as JSON")
flags.DEFINE_boolean(
    "keep_freed_memory",
    True,
    "time with glibc keeping freed memory (jaxpipe.host_memory, what a "
    "Pipeline on CPU devices does by default): no per-step mapping and page-faulting of XLA CPU's "
    "large buffers; false: glibc's defaults",
)
flags.DEFINE_boolean("child", False, "internal: this process measures one device-count group")
FLAGS = flags.FLAGS


def devices_needed(name: str, stages: int) -> int:
    """Devices the schedule's mesh uses: avgpipe runs 2 pipelines of ``stages``; all others ``stages``."""
    return 2 * stages if name == "avgpipe" else stages


def spawn_group(module: str, names, n: int, json_out: str = "") -> None:
    """Run ``python -m module --child --schedules=names`` in a process emulating exactly ``n`` devices,
    with this process's other flags."""
    import subprocess

    env = dict(os.environ, XLA_FLAGS=with_device_count(os.environ.get("XLA_FLAGS", ""), n))
    args = [a for a in sys.argv[1:] if not a.startswith(("--schedules", "--json_out", "--child"))]
    cmd = (
        [sys.executable, "-m", module, "--child", f"--schedules={','.join(names)}"]
        + ([f"--json_out={json_out}"] if json_out else [])
        + args
    )
    subprocess.run(cmd, env=env, check=True)


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.3f}x"


def groups_by_devices(names):
    """Schedules grouped by the devices their meshes use (each group runs in its own process)."""
    groups = {}
    for name in names:
        groups.setdefault(devices_needed(name, FLAGS.stages), []).append(name)
    return dict(sorted(groups.items()))


def run_groups(argv) -> None:
    """One child process per device count, each emulating exactly the devices its meshes use (emulating
    more slows the plain one-device baseline: the emulated devices share the cores' thread pools), each
    timing its own plain steps; the rows are printed together."""
    import json
    import tempfile

    groups = groups_by_devices(FLAGS.schedules.split(","))
    rows = []
    for n, names in groups.items():
        with tempfile.NamedTemporaryFile(suffix=".json") as fh:
            spawn_group("experiments.throughput", names, n, fh.name)
            out = json.load(open(fh.name))
            rows += [dict(r, devices=n, plain_ms=out["plain_ms"]) for r in out["rows"]]
    if len(groups) > 1:
        print("\nall groups (each ratio against the plain steps timed in its own process):")
        print(
            "| schedule | devices emulated | step ms | compared with | overhead | consecutive | / unchunked "
            "| "
            "XLA temp MiB/device |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['schedule']} | {r['devices']} | {r['step_s'] * 1e3:.1f} | {r['baseline']} | "
                f"{r['overhead']:.3f}x | "
                f"{_x(r['consecutive'])} | {r['vs_unchunked']:.3f}x | {r['temp_bytes'] / 2**20:.1f} |"
            )
    for r in rows:
        if "vs_predicting" in r:
            print(
                f"{r['schedule']}: {r['vs_predicting']:.3f}x the plain micro-steps that make its weight "
                "predictions"
            )
        if "vs_sync_dp" in r:
            print(f"{r['schedule']}: {r['vs_sync_dp']:.3f}x synchronous DP on the same devices")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)


def benchmark_setup(timing: str):
    """``(optimizer, model, batch)`` of the flags (the benchmark MLP and a random batch), after printing what
    runs where; ``timing`` ends the line."""
    import jax
    import jax.numpy as jnp
    import jaxpipe as jp
    from jaxpipe import host_memory
    from jaxpipe.bench import make_tanh_mlp

    host_memory.choose(FLAGS.keep_freed_memory)
    opt = jp.optim.by_name(FLAGS.optimizer, 1e-3)
    model = make_tanh_mlp(FLAGS.stages, FLAGS.layers // FLAGS.stages, FLAGS.width)
    key = jax.random.key(1)
    batch = {
        "x": jax.random.normal(key, (FLAGS.batch, FLAGS.width), jnp.float32),
        "y": jnp.zeros((FLAGS.batch, FLAGS.width), jnp.float32),
    }
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} x{len(jax.devices())}, "
        f"MLP {FLAGS.layers} x {FLAGS.width}^2 tanh, batch {FLAGS.batch}, D={FLAGS.stages}, "
        f"M={FLAGS.microbatches}, optimizer {FLAGS.optimizer}; {host_memory.describe()}; {timing}",
        flush=True,
    )
    return opt, model, batch


def build_runners(names, model, batch, opt):
    """Every runner the rows of ``names`` need, with the plain steps each is compared with: a namespace of
    ``runners`` (name -> closure running one step), ``infos`` (one per schedule), ``base_of`` (schedule ->
    its plain runner), ``model_of``, ``opts`` (schedules run with another optimizer), ``variant_opts`` and
    ``predicting`` (schedule -> the plain step making its weight predictions)."""
    import types
    import jaxpipe as jp
    from experiments.bench import (
        cyclic_runner,
        pipeline_runner,
        plain_predicting_runner,
        plain_runner,
        sync_dp_runner,
    )
    from jaxpipe.bench import make_tanh_mlp
    from jaxpipe.optim.policies import pipeoptim_distance, spectrain_distances

    runners = {
        "accum": plain_runner(model, batch, FLAGS.microbatches, opt),
        "unchunked": plain_runner(model, batch, 1, opt),
    }
    infos = []
    opts, base_of, model_of, variant_opts, predicting = {}, {}, {}, {}, {}
    base_name = lambda n: {"1f1b_pytree": "1f1b", "zb_h1_recompute": "zb_h1"}.get(n, n)
    for name in names:
        o, m, devices = opt, model, 0
        if name in jp.schedules.METHODS and jp.schedules.method(name).stages_per_device({"virtual": 2}) == 2:
            # two model chunks per device: the same layers cut into 2D stages, the same plain step math
            v = 2
            if FLAGS.layers % (v * FLAGS.stages):
                raise app.UsageError(f"{name} needs --layers divisible by 2 x --stages")
            m = make_tanh_mlp(v * FLAGS.stages, FLAGS.layers // (v * FLAGS.stages), FLAGS.width)
            devices = FLAGS.stages
            runners.setdefault("accum_v2", plain_runner(m, batch, FLAGS.microbatches, opt))
            base_of[name] = "accum_v2"
        if name == "1f1b_pytree":  # 1f1b with the activation sent as a pair of halves (same math)
            m = make_tanh_mlp(FLAGS.stages, FLAGS.layers // FLAGS.stages, FLAGS.width, pytree=True)
        model_of[name] = (m, devices)
        if name == "zb_h1_recompute":
            variant_opts[name] = {"w_from": "recompute"}
        if name in ("pipedream", "pipeoptim", "spectrain"):
            # updates after every micro-batch: the plain step doing the same work runs M (gradient, update)
            # micro-steps
            oname = "momentum" if name == "spectrain" and FLAGS.optimizer != "momentum" else FLAGS.optimizer
            key_ = f"micro_{oname}"
            runners.setdefault(
                key_,
                plain_runner(
                    model, batch, FLAGS.microbatches, jp.optim.by_name(oname, 1e-3), per_microbatch=True
                ),
            )
            base_of[name] = key_
            if name != "pipedream":
                # and the same micro-steps with the method's own weight predictions (one device, no pipeline):
                # the work prediction adds, which the pipeline cannot remove
                dist = (
                    spectrain_distances(FLAGS.stages)
                    if name == "spectrain"
                    else (pipeoptim_distance(FLAGS.stages), None)
                )
                predicting[name] = f"{key_}_predicting_{name}"
                runners.setdefault(
                    predicting[name],
                    plain_predicting_runner(
                        model, batch, FLAGS.microbatches, jp.optim.by_name(oname, 1e-3), *dist
                    ),
                )
        if name == "avgpipe":  # one plain accumulating step per pipeline's share of the batch
            runners.setdefault("accum_shares2", plain_runner(model, batch, FLAGS.microbatches, opt, parts=2))
            base_of[name] = "accum_shares2"
        if name == "spectrain" and FLAGS.optimizer != "momentum":
            o = jp.optim.by_name("momentum", 1e-3)  # SpecTrain needs a momentum buffer
            opts[name] = "momentum"
        if name.startswith("cdp_dp_"):
            # Cyclic Data Parallelism, DP form: D workers, one micro-batch each: the plain step to compare
            # with accumulates D micro-batches
            runners.setdefault("accum_D", plain_runner(model, batch, FLAGS.stages, opt))
            # and the synchronous DP step it replaces, on the same emulated devices (printed below the table)
            runners.setdefault("sync_dp", sync_dp_runner(model, batch, FLAGS.stages, opt))
            base_of[name] = "accum_D"
            run, info = cyclic_runner(name[len("cdp_dp_") :], model, batch, o)
            runners[name] = run
            infos.append(info)
            continue
        pipes = 2 if name == "avgpipe" else 1  # two parallel pipelines, the batch split between them
        run, info = pipeline_runner(
            base_name(name),
            m,
            batch,
            FLAGS.microbatches,
            o,
            devices=devices,
            pipes=pipes,
            options=variant_opts.get(name),
        )
        runners[name] = run
        infos.append({**info, "schedule": name})
    return types.SimpleNamespace(
        runners=runners,
        infos=infos,
        base_of=base_of,
        model_of=model_of,
        opts=opts,
        variant_opts=variant_opts,
        predicting=predicting,
        base_name=base_name,
    )


def main(argv):
    if not FLAGS.child and "jax" not in sys.modules:
        return run_groups(argv)
    import json
    import jaxpipe as jp
    import statistics
    from experiments.bench import block_medians, compile_time, interleaved_medians, median_ratio

    if FLAGS.layers % FLAGS.stages:
        raise app.UsageError(f"--layers={FLAGS.layers} must be a multiple of --stages={FLAGS.stages}")
    opt, model, batch = benchmark_setup(f"{FLAGS.steps} interleaved rounds")
    r = build_runners(FLAGS.schedules.split(","), model, batch, opt)
    runners, infos, base_of, model_of = r.runners, r.infos, r.base_of, r.model_of
    opts, variant_opts, predicting, base_name = r.opts, r.variant_opts, r.predicting, r.base_name
    times = interleaved_medians(runners, FLAGS.steps)
    blocks = block_medians(runners, FLAGS.block_rounds, FLAGS.block) if FLAGS.block else None
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"plain one-device step: accumulating over M={FLAGS.microbatches}: {med['accum'] * 1e3:.1f} ms, "
        f"unchunked: {med['unchunked'] * 1e3:.1f} ms",
        flush=True,
    )
    rows = []
    for info in infos:
        name = info["schedule"]
        o = jp.optim.by_name(opts.get(name, FLAGS.optimizer), 1e-3)
        m, devices = model_of[name]
        m2 = (
            compile_time(base_name(name), m, batch, FLAGS.compile_m2, o, devices, variant_opts.get(name))
            if FLAGS.compile_m2 and name not in ("avgpipe",) and not name.startswith("cdp_dp_")
            else None
        )
        base = base_of.get(name, "accum_momentum" if name in opts else "accum")
        if name in opts:
            info = {**info, "schedule": f"{name} (momentum)"}
        rows.append(
            {
                **info,
                "baseline": base,
                "baseline_ms": med[base] * 1e3,
                "step_s": med[name],
                "overhead": median_ratio(times[name], times[base]),
                "consecutive": median_ratio(blocks[name], blocks[base]) if blocks else None,
                "vs_unchunked": median_ratio(times[name], times["unchunked"]),
                "compile_s_m2": m2,
            }
        )
    m2_hdr = f"compile s M={FLAGS.compile_m2}" if FLAGS.compile_m2 else "compile s M2 (skipped)"
    hdr = (
        "| schedule | step ms | plain step it is compared with (ms) | overhead | consecutive | / unchunked "
        "plain "
        f"| sim. lockstep bubble "
        "| XLA temp MiB/device | state+batch MiB/device | weight versions | compile s "
        f"M={FLAGS.microbatches} | {m2_hdr} |"
    )
    print("\n" + hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        m2 = "-" if r["compile_s_m2"] is None else f"{r['compile_s_m2']:.2f}"
        print(
            f"| {r['schedule']} | {r['step_s'] * 1e3:.1f} | {r['baseline']} ({r['baseline_ms']:.0f}) | "
            f"{r['overhead']:.3f}x | "
            f"{_x(r['consecutive'])} | {r['vs_unchunked']:.3f}x | "
            f"{r['lockstep_bubble']:.3f} | {r['temp_bytes'] / 2**20:.1f} | "
            f"{r['state_bytes'] / 2**20:.1f} | {r['weight_versions']} | {r['compile_s']:.2f} | {m2} |"
        )
    print(
        "(overhead: median over rounds of the per-round ratio; the plain and pipelined steps alternate step "
        "by "
        "step. consecutive: the same ratio over --block steps in a row of each runner, as training runs "
        "them. Plain "
        "steps: accum = gradient accumulated over the M micro-batches, one update; micro_<opt> = M "
        "(gradient, "
        "update) micro-steps; accum_v2 = the same layers cut into 2D stages; accum_D = D micro-batches; "
        "accum_shares2 = one accumulating step per pipeline's half of the batch; unchunked = one gradient)"
    )
    for r in rows:
        name = r["schedule"].split(" ")[0]
        if name in predicting:
            k = predicting[name]
            r["vs_predicting"] = median_ratio(times[name], times[k])
            r["vs_predicting_consecutive"] = median_ratio(blocks[name], blocks[k]) if blocks else None
            print(
                f"{r['schedule']}: the plain micro-steps with its own weight predictions ({k}) take "
                f"{med[k] * 1e3:.1f} ms = {median_ratio(times[k], times[r['baseline']]):.3f}x "
                f"{r['baseline']}; "
                f"the pipelined step is {r['vs_predicting']:.3f}x of that "
                f"({_x(r['vs_predicting_consecutive'])} in consecutive steps)"
            )
    if "sync_dp" in times:
        print(
            f"\nsynchronous DP on the same {FLAGS.stages} emulated devices (per-device gradient, psum, "
            "replicated "
            f"{FLAGS.optimizer}): {med['sync_dp'] * 1e3:.1f} ms = "
            f"{median_ratio(times['sync_dp'], times['accum_D']):.3f}x accum_D "
            f"({_x(median_ratio(blocks['sync_dp'], blocks['accum_D']) if blocks else None)} in consecutive "
            "steps) "
            f"-- the floor a DP form pays here"
        )
        for r in rows:
            if r["schedule"].startswith("cdp_dp_"):
                r["vs_sync_dp"] = median_ratio(times[r["schedule"]], times["sync_dp"])
                print(f"  {r['schedule']}: {r['vs_sync_dp']:.3f}x synchronous DP")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as fh:
            json.dump(
                {"plain_ms": {k: med[k] * 1e3 for k in ("accum", "unchunked")}, "rows": rows}, fh, indent=1
            )


if __name__ == "__main__":
    cli.run(main)
