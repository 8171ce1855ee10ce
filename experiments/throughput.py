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

import functools
import os
import sys
from typing import NamedTuple, Optional

from jaxpipe.cli import common as cli
from absl import app, flags

from experiments import with_device_count


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
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
    flags.DEFINE_string(
        "optimizer", "adamw", "optax optimizer applied by both the plain and the pipelined step"
    )
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


#: the rows that run a built-in schedule under another name (a variant's options or model)
VARIANT_OF = {"1f1b_pytree": "1f1b", "zb_h1_recompute": "zb_h1"}


def base_name(name: str) -> str:
    """The built-in schedule a row ``name`` runs."""
    return VARIANT_OF.get(name, name)


class Runners:
    """Every runner the rows need, with the plain steps each is compared with (:func:`build_runners`).

    Attributes:
        runners: name -> a closure running one step (the rows' and the plain steps').
        infos: one dict per row (the pipeline's figures: bubble, temp, weight versions, ...).
        base_of: row -> the plain runner it is compared with (default ``"accum"``).
        model_of: row -> ``(model, devices)`` it runs (devices 0: every stage its own).
        opts: row -> the optimizer it runs with where not ``--optimizer``.
        variant_opts: row -> its schedule options.
        predicting: row -> the plain runner making its weight predictions."""

    def __init__(self, model, batch, opt):
        from experiments.bench import plain_runner

        self.model, self.batch, self.opt = model, batch, opt
        self.runners = {
            "accum": plain_runner(model, batch, FLAGS.microbatches, opt),
            "unchunked": plain_runner(model, batch, 1, opt),
        }
        self.infos = []
        self.opts, self.base_of, self.model_of, self.variant_opts, self.predicting = {}, {}, {}, {}, {}

    def add(self, name: str) -> None:
        """Row ``name``'s runner and the plain steps it is compared with."""
        import jaxpipe as jp
        from jaxpipe.bench import make_tanh_mlp

        opt, model, devices = self.opt, self.model, 0
        if name in jp.schedules.METHODS and jp.schedules.method(name).stages_per_device({"virtual": 2}) == 2:
            model, devices = self._two_chunks(name), FLAGS.stages
        if name == "1f1b_pytree":  # 1f1b with the activation sent as a pair of halves (same math)
            model = make_tanh_mlp(FLAGS.stages, FLAGS.layers // FLAGS.stages, FLAGS.width, pytree=True)
        self.model_of[name] = (model, devices)
        if name == "zb_h1_recompute":
            self.variant_opts[name] = {"w_from": "recompute"}
        if name in ("pipedream", "pipeoptim", "spectrain"):
            self._micro_steps(name)
        if name == "avgpipe":  # one plain accumulating step per pipeline's share of the batch
            self._plain("accum_shares2", FLAGS.microbatches, parts=2)
            self.base_of[name] = "accum_shares2"
        if name == "spectrain" and FLAGS.optimizer != "momentum":
            opt = jp.optim.by_name("momentum", 1e-3)  # SpecTrain needs a momentum buffer
            self.opts[name] = "momentum"
        if name.startswith("cdp_dp_"):
            self._cyclic(name, opt)
            return
        from experiments.bench import pipeline_runner

        pipes = 2 if name == "avgpipe" else 1  # two parallel pipelines, the batch split between them
        run, info = pipeline_runner(
            base_name(name),
            model,
            self.batch,
            FLAGS.microbatches,
            opt,
            devices=devices,
            pipes=pipes,
            options=self.variant_opts.get(name),
        )
        self.runners[name] = run
        self.infos.append({**info, "schedule": name})

    def _plain(self, key: str, microbatches: int, model=None, opt=None, **kw) -> None:
        from experiments.bench import plain_runner

        model = self.model if model is None else model
        opt = self.opt if opt is None else opt
        if key not in self.runners:
            self.runners[key] = plain_runner(model, self.batch, microbatches, opt, **kw)

    def _two_chunks(self, name: str):
        """Two model chunks a device: the same layers cut into 2D stages, compared with the same plain step
        math on that cut (``accum_v2``)."""
        from jaxpipe.bench import make_tanh_mlp

        v = 2
        if FLAGS.layers % (v * FLAGS.stages):
            raise app.UsageError(f"{name} needs --layers divisible by 2 x --stages")
        model = make_tanh_mlp(v * FLAGS.stages, FLAGS.layers // (v * FLAGS.stages), FLAGS.width)
        self._plain("accum_v2", FLAGS.microbatches, model=model)
        self.base_of[name] = "accum_v2"
        return model

    def _micro_steps(self, name: str) -> None:
        """A method that updates after every micro-batch: the plain step doing the same work runs M
        (gradient, update) micro-steps; and (SpecTrain, PipeOptim) the same micro-steps with the method's own
        weight predictions on one device -- the work prediction adds, which the pipeline cannot remove."""
        import jaxpipe as jp
        from experiments.bench import plain_predicting_runner
        from jaxpipe.optim.policies import pipeoptim_distance, spectrain_distances

        oname = "momentum" if name == "spectrain" and FLAGS.optimizer != "momentum" else FLAGS.optimizer
        key = f"micro_{oname}"
        opt = jp.optim.by_name(oname, 1e-3)
        self._plain(key, FLAGS.microbatches, opt=opt, per_microbatch=True)
        self.base_of[name] = key
        if name == "pipedream":
            return
        dist = (
            spectrain_distances(FLAGS.stages)
            if name == "spectrain"
            else (pipeoptim_distance(FLAGS.stages), None)
        )
        self.predicting[name] = f"{key}_predicting_{name}"
        if self.predicting[name] not in self.runners:
            self.runners[self.predicting[name]] = plain_predicting_runner(
                self.model, self.batch, FLAGS.microbatches, opt, *dist
            )

    def _cyclic(self, name: str, opt) -> None:
        """Cyclic Data Parallelism, DP form: D workers, one micro-batch each, compared with the plain step
        accumulating D micro-batches (``accum_D``) and with the synchronous DP step it replaces on the same
        emulated devices (``sync_dp``, printed below the table)."""
        from experiments.bench import cyclic_runner, sync_dp_runner

        self._plain("accum_D", FLAGS.stages)
        if "sync_dp" not in self.runners:
            self.runners["sync_dp"] = sync_dp_runner(self.model, self.batch, FLAGS.stages, self.opt)
        self.base_of[name] = "accum_D"
        run, info = cyclic_runner(name[len("cdp_dp_") :], self.model, self.batch, opt)
        self.runners[name] = run
        self.infos.append(info)


def build_runners(names, model, batch, opt) -> Runners:
    """Every runner the rows of ``names`` need, with the plain steps each is compared with."""
    built = Runners(model, batch, opt)
    for name in names:
        built.add(name)
    return built


class _Timed(NamedTuple):
    """The runners' times: every round's (``rounds``), in blocks of consecutive steps (``blocks``, or None),
    and the medians (``median``), by runner name."""

    rounds: dict
    blocks: Optional[dict]
    median: dict


def main(argv):
    if not FLAGS.child and "jax" not in sys.modules:
        return run_groups(argv)
    import statistics
    from experiments.bench import block_medians, interleaved_medians

    if FLAGS.layers % FLAGS.stages:
        raise app.UsageError(f"--layers={FLAGS.layers} must be a multiple of --stages={FLAGS.stages}")
    opt, model, batch = benchmark_setup(f"{FLAGS.steps} interleaved rounds")
    built = build_runners(FLAGS.schedules.split(","), model, batch, opt)
    rounds = interleaved_medians(built.runners, FLAGS.steps)
    blocks = block_medians(built.runners, FLAGS.block_rounds, FLAGS.block) if FLAGS.block else None
    timed = _Timed(rounds, blocks, {k: statistics.median(v) for k, v in rounds.items()})
    print(
        f"plain one-device step: accumulating over M={FLAGS.microbatches}: "
        f"{timed.median['accum'] * 1e3:.1f} ms, unchunked: {timed.median['unchunked'] * 1e3:.1f} ms",
        flush=True,
    )
    rows = [_row(built, info, timed, batch) for info in built.infos]
    _print_table(rows)
    _print_against_predictions(rows, built, timed)
    _print_against_sync_dp(rows, timed)
    if FLAGS.json_out:
        import json

        with open(FLAGS.json_out, "w") as fh:
            plain_ms = {k: timed.median[k] * 1e3 for k in ("accum", "unchunked")}
            json.dump({"plain_ms": plain_ms, "rows": rows}, fh, indent=1)


def _row(built: Runners, info: dict, timed: _Timed, batch) -> dict:
    """One schedule's row: its pipeline's figures, its step against the plain step it is compared with,
    and its compile time at ``--compile_m2`` micro-batches (where asked)."""
    import jaxpipe as jp
    from experiments.bench import compile_time, median_ratio

    name = info["schedule"]
    opt = jp.optim.by_name(built.opts.get(name, FLAGS.optimizer), 1e-3)
    model, devices = built.model_of[name]
    m2 = (
        compile_time(
            base_name(name), model, batch, FLAGS.compile_m2, opt, devices, built.variant_opts.get(name)
        )
        if FLAGS.compile_m2 and name not in ("avgpipe",) and not name.startswith("cdp_dp_")
        else None
    )
    base = built.base_of.get(name, "accum_momentum" if name in built.opts else "accum")
    if name in built.opts:
        info = {**info, "schedule": f"{name} (momentum)"}
    rounds, blocks = timed.rounds, timed.blocks
    return {
        **info,
        "baseline": base,
        "baseline_ms": timed.median[base] * 1e3,
        "step_s": timed.median[name],
        "overhead": median_ratio(rounds[name], rounds[base]),
        "consecutive": median_ratio(blocks[name], blocks[base]) if blocks else None,
        "vs_unchunked": median_ratio(rounds[name], rounds["unchunked"]),
        "compile_s_m2": m2,
    }


def _print_table(rows) -> None:
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


def _print_against_predictions(rows, built: Runners, timed: _Timed) -> None:
    """SpecTrain's and PipeOptim's step against the plain micro-steps making the same weight predictions
    (into each row: ``vs_predicting``, ``vs_predicting_consecutive``)."""
    from experiments.bench import median_ratio

    rounds, blocks, med = timed.rounds, timed.blocks, timed.median
    for r in rows:
        name = r["schedule"].split(" ")[0]
        if name in built.predicting:
            k = built.predicting[name]
            r["vs_predicting"] = median_ratio(rounds[name], rounds[k])
            r["vs_predicting_consecutive"] = median_ratio(blocks[name], blocks[k]) if blocks else None
            print(
                f"{r['schedule']}: the plain micro-steps with its own weight predictions ({k}) take "
                f"{med[k] * 1e3:.1f} ms = {median_ratio(rounds[k], rounds[r['baseline']]):.3f}x "
                f"{r['baseline']}; "
                f"the pipelined step is {r['vs_predicting']:.3f}x of that "
                f"({_x(r['vs_predicting_consecutive'])} in consecutive steps)"
            )


def _print_against_sync_dp(rows, timed: _Timed) -> None:
    """The synchronous DP step on the same devices, and each CDP row against it (into the row:
    ``vs_sync_dp``)."""
    from experiments.bench import median_ratio

    rounds, blocks, med = timed.rounds, timed.blocks, timed.median
    if "sync_dp" not in rounds:
        return
    print(
        f"\nsynchronous DP on the same {FLAGS.stages} emulated devices (per-device gradient, psum, "
        "replicated "
        f"{FLAGS.optimizer}): {med['sync_dp'] * 1e3:.1f} ms = "
        f"{median_ratio(rounds['sync_dp'], rounds['accum_D']):.3f}x accum_D "
        f"({_x(median_ratio(blocks['sync_dp'], blocks['accum_D']) if blocks else None)} in consecutive "
        "steps) "
        f"-- the floor a DP form pays here"
    )
    for r in rows:
        if r["schedule"].startswith("cdp_dp_"):
            r["vs_sync_dp"] = median_ratio(rounds[r["schedule"]], rounds["sync_dp"])
            print(f"  {r['schedule']}: {r['vs_sync_dp']:.3f}x synchronous DP")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
