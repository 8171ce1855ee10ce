"""AvgPipe's profiling-based choice of (M, N) (Xu et al. §5.2) on the CPU mesh, with predicted vs measured.

    python -m experiments.tune_avgpipe                         # tanh MLP, 2 stages, 8 CPU-emulated devices
    python -m experiments.tune_avgpipe --memory_limit=40       # MiB per device

1. Profiles ONE setting (``--profile_m``, ``--profile_n``): its step time, the host's CPU utilisation while
   it runs (the analogue of the paper's GPU utilisation curve: CPU-emulated devices share the host's cores;
   the paper profiles a large M and a small N so that the devices are not saturated),
   per-device computation from micro-benchmarks at that setting's micro-batch size with that many devices
   busy, communication from a ``ppermute`` alpha/beta fit, and XLA's model / data bytes per device.
2. Predicts step time (eqs. 1-7) and memory (eq. 8) of every (M, N) in ``--ms`` x ``--ns`` that fits the
   devices, and picks the highest predicted throughput under ``--memory_limit``.
3. Builds and times every one of those settings (advance = M - 1, AFAB, the case the paper predicts) and
   prints predicted vs measured time and memory, and whether the choice was the measured best.
Writes ``--out`` (JSON) and ``--markdown`` (default ``runs/tune_avgpipe.md``; the table in ``docs/`` is the
recorded run: pass ``--markdown=docs/tune_avgpipe.md`` to replace it).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, NamedTuple

from jaxpipe.cli import common as cli
from absl import flags

from experiments import emulate_cpu_devices


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_integer("devices", 8, "CPU-emulated devices")
    flags.DEFINE_integer("stages", 2, "pipeline stages D")
    flags.DEFINE_integer("layers", 4, "tanh-MLP layers (cut evenly into stages)")
    flags.DEFINE_integer("width", 512, "MLP width")
    flags.DEFINE_integer("batch", 64, "batch per pipeline (each step trains N batches)")
    flags.DEFINE_integer("profile_m", 8, "micro-batches in the profiled setting")
    flags.DEFINE_integer("profile_n", 1, "parallel pipelines in the profiled setting")
    flags.DEFINE_string("ms", "1,2,4,8", "micro-batch counts M to consider")
    flags.DEFINE_string("ns", "1,2,4", "parallel pipeline counts N to consider")
    flags.DEFINE_float("memory_limit", 0.0, "MiB per device (0: no limit)")
    flags.DEFINE_integer("steps", 5, "timed steps per setting (median)")
    flags.DEFINE_boolean(
        "shared",
        False,
        "the paper's setting: the N pipelines share the same D devices "
        "(options={'shared': N}, eq. 8's n*/n memory terms) instead of N x D devices on the pipe axis",
    )
    flags.DEFINE_string("out", "runs/tune_avgpipe.json", "JSON output")
    flags.DEFINE_string(
        "markdown",
        "runs/tune_avgpipe.md",
        "Markdown table output ('' to skip; the recorded table is docs/tune_avgpipe.md)",
    )


FLAGS = flags.FLAGS


def main(argv):
    del argv
    if "jax" not in sys.modules:
        emulate_cpu_devices(FLAGS.devices)
    import jax
    import optax
    from tqdm import tqdm

    from jaxpipe.bench import make_tanh_mlp
    from jaxpipe.tune.avgpipe_model import choose

    D, B, P = FLAGS.stages, FLAGS.batch, FLAGS.devices
    model = make_tanh_mlp(D, FLAGS.layers // D, FLAGS.width)
    opt = optax.adam(1e-3)
    m0, n0 = FLAGS.profile_m, FLAGS.profile_n
    print(
        f"jax {jax.__version__}, {P} CPU-emulated devices on {os.cpu_count() or 1} cores; tanh MLP "
        f"{FLAGS.layers}x{FLAGS.width}^2 in {D} stages, batch {B} per pipeline, Adam; profiling "
        f"(M={m0}, N={n0})",
        flush=True,
    )
    prof = _run_setting(model, opt, m0, n0, FLAGS.steps)
    found = _profiled(model, prof)
    ms = [int(v) for v in FLAGS.ms.split(",")]
    ns = [int(v) for v in FLAGS.ns.split(",")]
    settings = [(m, n) for n in ns for m in ms if (D if FLAGS.shared else n * D) <= P and B % m == 0]
    limit = FLAGS.memory_limit * 2**20 if FLAGS.memory_limit > 0 else None
    best, preds = choose(found.profile, settings, limit, batch_per_pipe=B)
    rows = []
    for q in tqdm(preds, desc="measuring every setting"):
        r = prof if (q.m, q.n) == (m0, n0) else _run_setting(model, opt, q.m, q.n, FLAGS.steps)
        rows.append(_row(found.profile, q, r, profiled=(q.m, q.n) == (m0, n0)))
    fit = [r for r in rows if limit is None or r["meas_mem"] <= limit]
    meas_best = max(fit, key=lambda r: r["meas_tput"], default=None)
    table, summary = _table(rows), _summary(rows, best, meas_best)
    print(table + "\n" + summary)
    _write(prof, found, rows, best, meas_best, table, summary)


class Profiled(NamedTuple):
    """The profiled setting read into AvgPipe's model: its profile (the executor's per-tick cost
    calibrated on it), what eqs. 1-7 alone predict for it, one micro-batch's compute per device and one
    message's time."""

    profile: Any
    raw_s: float
    per_mb_s: float
    msg_s: float


def _batch(n: int):
    import jax.numpy as jnp
    import numpy as np

    r = np.random.default_rng(0)
    return {
        "x": jnp.asarray(r.normal(size=(n * FLAGS.batch, FLAGS.width)), jnp.float32),
        "y": jnp.zeros((n * FLAGS.batch, FLAGS.width), jnp.float32),
    }


def _run_setting(model, opt, m: int, n: int, steps: int) -> dict:
    """The setting (M = ``m``, N = ``n``): the memory of its 1F1B program (eq. 8 scales activations with
    the micro-batch size, 1F1B's case) and the median step and CPU utilisation of AFAB (the case eqs. 1-7
    predict; advance forward propagation approaches it)."""
    import statistics
    import time

    import jax

    import jaxpipe as jp

    D = FLAGS.stages
    mesh = jp.make_mesh(stages=D) if FLAGS.shared else jp.make_mesh(pipes=n, stages=D)
    shared = {"shared": n} if FLAGS.shared else {}

    def pipeline(advance):
        return jp.Pipeline(
            model,
            schedule="avgpipe",
            num_microbatches=m,
            optimizer=opt,
            mesh=mesh,
            options={"advance": advance, **shared},
        )

    pipe = pipeline(0)
    state, batch = pipe.init(), _batch(n)
    ma = pipe.lower("step", state, batch).compile().memory_analysis()
    pipe = pipeline(m - 1)
    for _ in range(2):
        state, met = pipe.step(state, batch)
    jax.block_until_ready(met["loss"])
    walls, cpus = [], []
    for _ in range(steps):
        c0, t0 = os.times(), time.perf_counter()
        state, met = pipe.step(state, batch)
        jax.block_until_ready(met["loss"])
        t1, c1 = time.perf_counter(), os.times()
        walls.append(t1 - t0)
        cpus.append((c1.user - c0.user) + (c1.system - c0.system))
    wall = statistics.median(walls)
    cores = os.cpu_count() or 1
    util = min(1.0, statistics.median([c / (w * cores) for c, w in zip(cpus, walls)]))
    return {
        "m": m,
        "n": n,
        "step_s": wall,
        "util": util,
        "args_bytes": int(ma.argument_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
    }


def _profiled(model, prof: dict) -> Profiled:
    """AvgPipe's profile of the measured setting ``prof``: per-device computation from micro-benchmarks at
    its micro-batch size with that many devices busy, communication from a ``ppermute`` alpha/beta fit,
    XLA's model and data bytes per device; the executor's per-tick cost calibrated on its measured step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpipe.bench import make_tanh_mlp
    from jaxpipe.runtime.residuals import residual_mask
    from jaxpipe.tune import microbench as mb
    from jaxpipe.tune.avgpipe_model import AvgPipeProfile, calibrate_tick_overhead, predict

    D, B = FLAGS.stages, FLAGS.batch
    m0, n0 = prof["m"], prof["n"]
    one = make_tanh_mlp(FLAGS.layers, 1, FLAGS.width)
    w1 = jax.tree.map(lambda a: a[0], one.stage_params)
    x = jnp.ones((B // m0, FLAGS.width), jnp.float32) * 0.1
    busy = D if FLAGS.shared else n0 * D
    ops = mb.op_costs(one.stage_fn, w1, x, busy, busy=[busy])
    per_mb = (ops["F"][-1] + ops["B"][-1]) * (FLAGS.layers // D)
    act_bytes = int(np.prod(x.shape)) * 4
    pa, pb = mb.p2p_alpha_beta(D, sizes=(1 << 12, max(act_bytes, 1 << 14), 1 << 20), reps=4)
    msg = pa + pb * act_bytes
    t_gpu = [m0 * per_mb / n0] * D  # per batch, amortised over N
    t_comm = [m0 * msg * ((k < D - 1) + (k > 0)) for k in range(D)]
    # data bytes: the stashed residuals of the micro-batches 1F1B holds on device k (D - k of them) plus
    # the message buffers; the rest of XLA's bytes is the model's (parameters, optimizer, reference, grads)
    w_stage = jax.tree.map(lambda a: a[0], model.stage_params)
    _, res = residual_mask(model.stage_fn, w_stage, x)
    per_mb_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in res) + 3 * act_bytes
    f_dat = [min(D - k, m0) * per_mb_bytes for k in range(D)]
    total = prof["args_bytes"] + prof["temp_bytes"]
    profile = AvgPipeProfile(
        m0,
        n0,
        t_gpu,
        [prof["util"]] * D,
        t_comm,
        [total - f for f in f_dat],
        f_dat,
        shared_compute=True,
        shared_memory=FLAGS.shared,
    )
    raw = predict(profile, m0, n0).step
    profile.tick_overhead = calibrate_tick_overhead(profile, prof["step_s"])
    print(
        f"profile: step {prof['step_s'] * 1e3:.1f} ms, CPU utilisation {prof['util']:.2f}, compute "
        f"{per_mb * 1e3:.2f} ms per micro-batch and device, message {msg * 1e6:.0f} us; eqs. 1-7 alone give "
        f"{raw * 1e3:.1f} ms on it: executor cost {profile.tick_overhead * 1e3:.2f} ms per tick",
        flush=True,
    )
    return Profiled(profile, raw, per_mb, msg)


def _row(profile, q, r: dict, profiled: bool) -> dict:
    """One setting's predicted (``q``) and measured (``r``) step, memory and throughput."""
    import dataclasses

    from jaxpipe.tune.avgpipe_model import predict

    B = FLAGS.batch
    mem = r["args_bytes"] + r["temp_bytes"]
    return {
        "m": q.m,
        "n": q.n,
        "pred_step_s": q.step,
        "pred_eqs_only_s": predict(dataclasses.replace(profile, tick_overhead=0.0), q.m, q.n).step,
        "meas_step_s": r["step_s"],
        "time_err": q.step / r["step_s"] - 1,
        "pred_mem": q.memory,
        "meas_mem": mem,
        "mem_err": q.memory / mem - 1,
        "pred_tput": q.n * B / q.step,
        "meas_tput": q.n * B / r["step_s"],
        "profiled": profiled,
    }


def _table(rows: list) -> str:
    lines = [
        "| M | N | predicted step (ms) | measured (ms) | error | predicted MiB/device | measured MiB | "
        "error | samples/s measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['m']} | {r['n']}{' (profiled)' if r['profiled'] else ''} | {r['pred_step_s'] * 1e3:.1f} | "
            f"{r['meas_step_s'] * 1e3:.1f} | {r['time_err'] * 100:+.0f}% | {r['pred_mem'] / 2**20:.1f} | "
            f"{r['meas_mem'] / 2**20:.1f} | {r['mem_err'] * 100:+.0f}% | {r['meas_tput']:.0f} |"
        )
    return "\n".join(lines)


def _summary(rows: list, best, meas_best) -> str:
    import numpy as np

    others = [r for r in rows if not r["profiled"]]
    mean_t = float(np.mean([abs(r["time_err"]) for r in others])) if others else float("nan")
    mean_m = float(np.mean([abs(r["mem_err"]) for r in others])) if others else float("nan")
    return (
        f"Held-out settings: mean |time error| {mean_t * 100:.0f}%, max "
        f"{max(abs(r['time_err']) for r in others) * 100:.0f}%; mean |memory error| {mean_m * 100:.0f}%. "
        f"Chosen (predicted best under the limit): "
        f"{None if best is None else (best.m, best.n)}; measured best: "
        f"{None if meas_best is None else (meas_best['m'], meas_best['n'])}."
    )


def _write(prof: dict, found: Profiled, rows: list, best, meas_best, table: str, summary: str) -> None:
    """``--out`` (JSON) and ``--markdown`` (the table with the command and the setting)."""
    import json

    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(
            {
                "profile": {
                    **prof,
                    "per_mb_s": found.per_mb_s,
                    "msg_s": found.msg_s,
                    "tick_overhead_s": found.profile.tick_overhead,
                },
                "rows": rows,
                "chosen": None if best is None else [best.m, best.n],
                "measured_best": None if meas_best is None else [meas_best["m"], meas_best["n"]],
            },
            f,
            indent=1,
        )
    if not FLAGS.markdown:
        return
    os.makedirs(os.path.dirname(FLAGS.markdown) or ".", exist_ok=True)
    shown = (
        f"--shared --devices={FLAGS.devices} " if FLAGS.shared else ""
    ) + f"--memory_limit={FLAGS.memory_limit:g}"
    where = "sharing devices" if FLAGS.shared else "on their own devices"
    with open(FLAGS.markdown, "w") as f:
        f.write(
            f"# AvgPipe tuning (§5.2), pipelines {where}: predicted vs measured\n\n`python -m "
            "experiments.tune_avgpipe "
            f"{shown}`: tanh MLP {FLAGS.layers}x{FLAGS.width}², {FLAGS.stages} stages, "
            f"batch {FLAGS.batch} per pipeline, Adam, {FLAGS.devices} CPU-emulated devices on "
            f"{os.cpu_count() or 1} cores; profiled (M={prof['m']}, N={prof['n']}); predictions add the "
            "executor's per-tick cost calibrated on the profiled run "
            f"({found.profile.tick_overhead * 1e3:.2f} ms/tick; eqs. 1-7 alone gave "
            f"{found.raw_s * 1e3:.1f} ms there vs {prof['step_s'] * 1e3:.1f} measured).\n\n"
            f"{table}\n\n{summary}\n"
        )


if __name__ == "__main__":
    define_flags()
    cli.run(main)
