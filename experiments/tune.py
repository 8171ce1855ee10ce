"""Performance model and configuration search (Chimera §3.4) on the running backend.

    python -m experiments.tune                              # tanh MLP, 8 CPU-emulated devices, batch 64
    python -m experiments.tune --model=gpt --devices=8 --batch=64 --validate=8

1. Measures, with micro-benchmarks on this backend: one layer's forward and backward (and zero-bubble's
   B and W) per micro-batch size, with n devices busy at once; ``ppermute`` and all-reduce alpha/beta; the
   optimizer update.  2. Calibrates the executor's fixed costs (per tick, per step, per tick and extra chunk,
   per step and extra data-parallel replica) on four configurations (three 1F1B, one Chimera).  3. Predicts
   the step time of every (W, D, B, N, schedule) that fits ``--memory_mib`` and prints the best ones.
   4. Builds and times ``--validate`` configurations (the calibration one excluded) and prints predicted vs
   measured step time and the error; writes everything to ``--out`` as JSON.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import NamedTuple

from jaxpipe.cli import common as cli
from absl import app, flags

from experiments import emulate_cpu_devices


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_enum("model", "mlp", ["mlp", "gpt"], "tanh MLP (layers x width^2) or the reference GPT")
    flags.DEFINE_integer("devices", 8, "devices P = W x D (CPU-emulated)")
    flags.DEFINE_integer("batch", 64, "global mini-batch size")
    flags.DEFINE_integer("layers", 8, "layers (MLP) or transformer blocks (GPT); stages cut them evenly")
    flags.DEFINE_integer("width", 1024, "MLP width / GPT d_model")
    flags.DEFINE_string("schedules", "gpipe,1f1b,chimera,interleaved_1f1b,zb_h1", "schedules to consider")
    flags.DEFINE_string("micro_batch_sizes", "2,4,8,16", "micro-batch sizes B to consider")
    flags.DEFINE_float("memory_mib", 1e9, "memory budget per device (MiB)")
    flags.DEFINE_integer("validate", 7, "configurations to build and time against the prediction")
    flags.DEFINE_integer("top", 10, "best predicted configurations to print")
    flags.DEFINE_string("out", "runs/tune.json", "JSON output path")


FLAGS = flags.FLAGS


def main(argv):
    del argv
    if "jax" not in sys.modules:
        emulate_cpu_devices(FLAGS.devices)
    import jax

    from jaxpipe.tune import enumerate_candidates

    P = FLAGS.devices
    if len(jax.devices()) < P:
        raise app.UsageError(f"--devices={P} but {len(jax.devices())} are visible")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} x{P}; {FLAGS.model} {FLAGS.layers} layers, "
        f"width {FLAGS.width}, batch {FLAGS.batch}",
        flush=True,
    )
    bench = _Bench()
    names = FLAGS.schedules.split(",")
    cands = [
        c
        for c in enumerate_candidates(P, FLAGS.batch, FLAGS.layers, names, micro_batch_sizes=bench.Bs)
        if c.D > 1
    ]
    cal = _calibrate(bench, cands)
    rows = _ranked(bench, cands, cal)
    _validate(bench, rows, cal)
    _write(FLAGS.out, bench, cal, rows)


class Calibration(NamedTuple):
    """The executor's fixed costs fitted on ``configs`` (seconds): per device-op, per step, per tick and
    extra chunk, per step and extra data-parallel replica; ``equations``: each run's (ops or ticks, what
    its measured step held beyond the prediction, the measured step)."""

    op: float
    step: float
    chunk: float
    dp: float
    configs: list
    equations: list


class _Bench:
    """The model, its batches, and the costs measured on this backend: one layer's ops per micro-batch
    size with n devices busy, ``ppermute`` and all-reduce alpha/beta, the optimizer update (each kept)."""

    def __init__(self):
        import time

        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from tqdm import tqdm

        from jaxpipe.tune import microbench as mb

        self.P, self.L, self.batch = FLAGS.devices, FLAGS.layers, FLAGS.batch
        self.opt = optax.adamw(1e-3)
        one = self.make_model(self.L)  # one layer per stage: the unit the costs scale from
        w1 = jax.tree.map(lambda a: a[0], one.stage_params)
        self.Bs = [int(b) for b in FLAGS.micro_batch_sizes.split(",")]
        t0 = time.perf_counter()
        self.costs_of = {}
        for B in tqdm(self.Bs, desc="micro-benchmarks (per micro-batch size)"):
            x = jax.eval_shape(one.pre, one.pre_params, jax.tree.map(lambda a: a[:B], self.make_batch(B)))
            x = jnp.ones(x.shape, x.dtype) * 0.1
            P = self.P
            ops = mb.op_costs(one.stage_fn, w1, x, P, busy=sorted({1, 2, P // 2, P}), split=False)
            ops_split = mb.op_costs(one.stage_fn, w1, x, P, busy=sorted({1, P}), split=True)
            self.costs_of[B] = (
                {k: v for k, v in ops.items()},
                {"B": ops_split["B"], "W": ops_split["W"]},
                int(np.prod(x.shape)) * x.dtype.itemsize,
            )
        self.layer_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w1))
        # fit alpha/beta over the sizes the step really moves: activations up to whole stages' weights
        # (Chimera's replica exchange) and gradients (the data-parallel all-reduce); on CPU the cost per byte
        # of a 16 MB collective is not what a 1 MB one suggests
        self.big = max(1 << 20, int(self.layer_bytes * self.L // 2))
        act_max = max(self.costs_of[B][2] for B in self.Bs)
        self.pa, self.pb = mb.p2p_alpha_beta(
            self.P, sizes=tuple(sorted({1 << 12, max(act_max, 1 << 14), self.big // 4, self.big})), reps=4
        )
        self._allreduce, self._update = {}, {}
        self.aa, self.ab = self.allreduce_for(self.P)
        print(
            f"measured in {time.perf_counter() - t0:.0f} s: p2p alpha {self.pa * 1e6:.1f} us beta "
            f"{self.pb * 1e9:.3f} ns/B; all-reduce alpha {self.aa * 1e6:.1f} us beta "
            f"{self.ab * 1e9:.3f} ns/B",
            flush=True,
        )
        for B in self.Bs:
            print(
                f"  B={B}: one layer F {[f'{t * 1e3:.2f}' for t in self.costs_of[B][0]['F']]} ms, "
                f"B {[f'{t * 1e3:.2f}' for t in self.costs_of[B][0]['B']]} ms (n = 1..{self.P} busy devices)"
            )

    def make_model(self, stages):
        import jaxpipe as jp
        from jaxpipe.bench import make_tanh_mlp

        L = FLAGS.layers
        if FLAGS.model == "mlp":
            return make_tanh_mlp(stages, L // stages, FLAGS.width)
        return jp.models.gpt(
            stages, vocab=64, d_model=FLAGS.width, heads=4, seq_len=32, blocks_per_stage=L // stages
        )

    def make_batch(self, n):
        import jax.numpy as jnp
        import numpy as np

        r = np.random.default_rng(0)
        if FLAGS.model == "mlp":
            return {
                "x": jnp.asarray(r.normal(size=(n, FLAGS.width)), jnp.float32),
                "y": jnp.zeros((n, FLAGS.width), jnp.float32),
            }
        t = r.integers(0, 64, (n, 33)).astype(np.int32)
        return {"x": jnp.asarray(t[:, :-1]), "y": jnp.asarray(t[:, 1:])}

    def allreduce_for(self, W):
        from jaxpipe.tune import microbench as mb

        if W not in self._allreduce:
            self._allreduce[W] = mb.allreduce_alpha_beta(
                self.P, sizes=tuple(sorted({1 << 16, self.big // 4, self.big})), reps=4, group=W
            )
        return self._allreduce[W]

    def update_for(self, D, W):
        """The optimizer update on the model's stage-stacked parameters sharded over 'stage' (one copy per
        stage whatever the schedule: Chimera's replicas are gathered from it), replicated over 'data'."""
        import jax

        import jaxpipe as jp
        from jaxpipe.tune import microbench as mb

        if (D, W) not in self._update:
            m = self.make_model(D)
            self._update[(D, W)] = mb.update_time(
                self.opt, m.stage_params, jp.make_mesh(stages=D, data=W), jax.sharding.PartitionSpec("stage")
            )
        return self._update[(D, W)]

    def costs_for(self, c):
        """``(schedule, Costs, activation bytes, stage gradient bytes)`` of candidate ``c``."""
        from jaxpipe.tune.perf_model import Costs

        ops, split_ops, act = self.costs_of[c.B]
        per = self.L // c.model_stages
        op = {"F": [t * per for t in ops["F"]], "B": [t * per for t in ops["B"]]}
        if c.schedule == "zb_h1":
            op["B"] = [t * per for t in split_ops["B"]]
            op["W"] = [t * per for t in split_ops["W"]]
        a_w, b_w = self.allreduce_for(c.W) if c.W > 1 else (0.0, 0.0)
        costs = Costs(
            op=op,
            p2p_alpha=self.pa,
            p2p_beta=self.pb,
            ar_alpha=a_w,
            ar_beta=b_w,
            update=self.update_for(c.D, c.W),
        )
        return c.build(), costs, act, self.layer_bytes * per

    def predicted(self, c, op_overhead=0.0, step_overhead=0.0, chunk_overhead=0.0, dp_overhead=0.0):
        from jaxpipe.tune import predict

        s, co, act, gbytes = self.costs_for(c)
        co.overhead = step_overhead + dp_overhead * (c.W - 1)
        replicas = c.W  # Chimera's two replicas are summed by the ppermute exchange (the layout term)
        return predict(
            s,
            co,
            act,
            gbytes,
            replicas,
            width=c.W,
            op_overhead=op_overhead,
            chunk_tick_overhead=chunk_overhead,
        )

    def measure_step(self, c):
        """The median of 9 timed steps of candidate ``c`` (after 2 untimed)."""
        import statistics
        import time

        import jax

        import jaxpipe as jp

        pipe = jp.Pipeline(
            self.make_model(c.model_stages),
            schedule=c.schedule,
            num_microbatches=c.N,
            optimizer=self.opt,
            mesh=jp.make_mesh(stages=c.D, data=c.W),
        )
        state = pipe.init()
        b = pipe.shard_batch(self.make_batch(self.batch))
        for _ in range(2):
            state, m = pipe.step(state, b)
        jax.block_until_ready(m["loss"])
        ts = []
        for _ in range(9):
            t = time.perf_counter()
            state, m = pipe.step(state, b)
            jax.block_until_ready(m["loss"])
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)


def _calibrate(bench: _Bench, cands) -> Calibration:
    """The executor's fixed cost per device-op (a device's F, B or W: its conditional, slot reads and writes,
    its part in the tick's collective-permutes) and per step, from two 1F1B runs without data parallelism --
    the most and the fewest ticks per step -- by solving two equations (W = 1: the data-parallel all-reduce is
    modelled from its own micro-benchmark, not absorbed here).  A cost per tick fitted the same way was
    measured twice as wrong (BUILD_NOTES, "Choosing a configuration").  A third run, of a two-chunk schedule
    (Chimera), gives the extra per-tick cost of a second chunk; a fourth, of 1F1B with the widest data
    parallelism, the per-step cost of data parallelism that the all-reduce and update micro-benchmarks do
    not see (per extra replica)."""
    f1 = [c for c in cands if c.schedule == "1f1b"]
    if not f1:
        P, L = FLAGS.devices, FLAGS.layers
        raise app.UsageError(
            f"the calibration runs 1F1B, and no 1F1B configuration fits --devices={P}, "
            f"--layers={L}, --batch={FLAGS.batch} with --schedules={FLAGS.schedules}: add 1f1b to "
            f"--schedules, or give as many layers as devices (e.g. --layers={P})"
        )
    # the fewest data-parallel replicas there are (W = 1 unless the layers are fewer than the devices)
    w_min = min(c.W for c in f1)
    ones = sorted((c for c in f1 if c.W == w_min), key=lambda c: c.build().num_ticks)
    configs = [ones[-1], ones[0]]
    eq = []
    for c in configs:
        t_meas = bench.measure_step(c)
        eq.append((sum(len(a) for a in c.build().actions), t_meas - bench.predicted(c)["lockstep"], t_meas))
    (n1, r1, _), (n2, r2, _) = eq
    op_oh = max(0.0, (r1 - r2) / (n1 - n2)) if n1 != n2 else max(0.0, r1 / n1)
    # the intercept may be negative: the micro-benchmarked ops and update can exceed what a step pays
    step_oh = r2 - op_oh * n2
    chunk_oh = dp_oh = 0.0
    chims = sorted(
        (c for c in cands if c.schedule == "chimera" and c.W == 1), key=lambda c: c.build().num_ticks
    )
    if chims:
        cc = chims[-1]
        t_cc = bench.measure_step(cc)
        rest = t_cc - bench.predicted(cc, op_oh, step_oh)["lockstep"]
        chunk_oh = max(0.0, rest / cc.build().num_ticks)
        configs.append(cc)
        eq.append((cc.build().num_ticks, rest, t_cc))
    wides = sorted(
        (c for c in cands if c.schedule == "1f1b" and c.W > 1), key=lambda c: (-c.W, c.build().num_ticks)
    )
    if wides:
        cw = wides[0]
        t_cw = bench.measure_step(cw)
        rest = t_cw - bench.predicted(cw, op_oh, step_oh)["lockstep"]
        dp_oh = max(0.0, rest / (cw.W - 1))
        configs.append(cw)
        eq.append((cw.build().num_ticks, rest, t_cw))
    print(
        f"calibration on {', '.join(f'{c.label()} ({e[2] * 1e3:.1f} ms)' for c, e in zip(configs, eq))}: "
        f"{op_oh * 1e6:.0f} us per device-op, {chunk_oh * 1e6:.0f} us per tick per extra chunk, "
        f"{step_oh * 1e3:.2f} ms per step, {dp_oh * 1e3:.2f} ms per step per extra data-parallel replica",
        flush=True,
    )
    return Calibration(op_oh, step_oh, chunk_oh, dp_oh, configs, eq)


def _ranked(bench: _Bench, cands, cal: Calibration) -> list:
    """Every candidate that fits ``--memory_mib``, predicted at the calibrated costs, fastest first (the
    best ``--top`` printed)."""
    from jaxpipe.tune import memory_estimate

    rows = []
    for c in cands:
        _, _, act, gbytes = bench.costs_for(c)
        mem = memory_estimate(c, gbytes, act * 3, message_bytes=act) / 2**20
        if mem > FLAGS.memory_mib:
            continue
        p = bench.predicted(c, cal.op, cal.step, cal.chunk, cal.dp)
        rows.append({"config": c.label(), "candidate": c, "memory_mib": mem, **p})
    rows.sort(key=lambda r: r["lockstep"])
    print(f"\n{len(rows)} configurations fit {FLAGS.memory_mib:g} MiB; best predicted:")
    print("| config | predicted ms (lockstep) | paper eq.(1) ms | C_f | C_b | ticks | est. MiB/device |")
    print("|---|---|---|---|---|---|---|")
    for r in rows[: FLAGS.top]:
        print(
            f"| {r['config']} | {r['lockstep'] * 1e3:.1f} | {r['paper'] * 1e3:.1f} | {r['C_f']} | "
            f"{r['C_b']} | {r['ticks']} | {r['memory_mib']:.1f} |"
        )
    return rows


def _validate(bench: _Bench, rows: list, cal: Calibration) -> None:
    """Builds and times the best ``--validate`` configurations, one per (schedule, W, D) and none of the
    calibration's, and prints each prediction's error (``measured`` added to its row)."""
    import numpy as np
    from tqdm import tqdm

    pick, seen = [], set()
    for r in rows:
        c = r["candidate"]
        key = (c.schedule, c.W, c.D)
        if c not in cal.configs and key not in seen:
            pick.append(r)
            seen.add(key)
    pick = pick[: FLAGS.validate]
    print(f"\nvalidation: predicted vs measured (median of 5 steps), {len(pick)} configurations", flush=True)
    print("| config | predicted ms | measured ms | error |")
    print("|---|---|---|---|")
    errs = []
    for r in tqdm(pick, desc="timing configurations", leave=False):
        meas = bench.measure_step(r["candidate"])
        err = (r["lockstep"] - meas) / meas
        errs.append(abs(err))
        r["measured"] = meas
        print(f"| {r['config']} | {r['lockstep'] * 1e3:.1f} | {meas * 1e3:.1f} | {err:+.1%} |", flush=True)
    print(f"mean |error| {np.mean(errs):.1%}, max {np.max(errs):.1%} (target <= 15%)")
    best = min(pick, key=lambda r: r["measured"])
    print(f"predicted best: {rows[0]['config']}; measured best among validated: {best['config']}")


def _write(path: str, bench: _Bench, cal: Calibration, rows: list) -> None:
    import json

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(
            {
                "op_overhead_s": cal.op,
                "step_overhead_s": cal.step,
                "chunk_tick_overhead_s": cal.chunk,
                "dp_step_overhead_s": cal.dp,
                "calibration": [c.label() for c in cal.configs],
                "calibration_measured_s": [e[2] for e in cal.equations],
                "p2p": [bench.pa, bench.pb],
                "allreduce": [bench.aa, bench.ab],
                "rows": [{k: v for k, v in r.items() if k != "candidate"} for r in rows],
            },
            fh,
            indent=1,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
