"""Is ``jp.configure``'s choice the fastest that fits, measured on a real two-device pipeline? (issue #53 item 4)

Two processes (``jax.distributed``, Gloo collectives), one CPU device each, each pinned to its own core: the
testbed of ``experiments.two_devices``, where a bubble costs real time.  For each model, both processes run
``jp.configure`` over the two devices (every stage x data split, ``--schedules``, ``--microbatches``, residuals
``all`` / ``inputs``; its timings are process 0's, broadcast, so both build the same programs), then build and
time *every* candidate that fits, in turns (A B C A B C ...), the median of ``--rounds`` rounds of 3 steps.
``configure(measure=--measure)`` makes its final choice by timing a few candidates (the predicted fastest two
and the predicted fastest of each stage count and residual policy).  Two budgets: no limit, and one just below the defaults' need (1F1B, M = 4, ``residuals="all"``, two stages),
where the choice must be a configuration that fits -- it is then trained for a step.

    python -m experiments.configure_truth                      # the three models, about 25 minutes
    python -m experiments.configure_truth --models=gpt_head --rounds=7

Models: ``mlp`` (8 ``tanh(h @ W)`` layers, W 512², batch 128), ``gpt`` (4 blocks, d 128, vocabulary 64, T 64,
batch 16), ``gpt_head`` (the same with a vocabulary of 8192: the head costs about five blocks) and
``gpt_tensor`` (the ``gpt`` with its MLP split Megatron-style over a ``tensor`` axis: the two devices can also
be one stage of tensor=2, its collectives over the link).  Printed per
model and budget: the candidates with predicted step, bubble, memory (predicted; XLA's where compiled),
measured step, the pick and the fastest measured; ``--json`` writes them.  Needs a quiet machine with two cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from experiments import cli
from absl import flags

flags.DEFINE_string("models", "mlp,gpt,gpt_head", "comma-separated: mlp, gpt, gpt_head, gpt_tensor")
flags.DEFINE_string("schedules", "1f1b,gpipe,zb_h1", "the schedules configure considers")
flags.DEFINE_string("microbatches", "2,4", "the micro-batch counts configure considers")
flags.DEFINE_integer("rounds", 5, "timing rounds (3 steps of every candidate each, in turns)")
flags.DEFINE_integer("measure", 6, "configure(measure=k): its final choice among k candidates timed (0: predicted only)")
flags.DEFINE_integer("port", 12431, "coordinator port on 127.0.0.1")
flags.DEFINE_string("json", "", "also write the results to this file")
flags.DEFINE_integer("worker", -1, "internal: this process's index (the launcher sets it)")
FLAGS = flags.FLAGS

DEFAULT = ("1f1b", 2, 1, 4, "all")      # schedule, stages, data, M, residuals: Pipeline's defaults on 2 devices


def setup(name: str):
    """``(make_model(n), batch)`` of the model ``name``."""
    import jax.numpy as jnp
    import numpy as np
    import jaxpipe as jp
    r = np.random.default_rng(0)
    if name == "mlp":
        L, W, B = 8, 512, 128
        Ws = np.asarray(r.normal(size=(L, W, W)) / np.sqrt(W), np.float32)
        from jax import lax

        def make(n):
            layers = lambda ws, h: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]
            return jp.PipelineModel(stage_fn=lambda p, h: layers(p["w"], h),
                                    stage_params={"w": jnp.asarray(Ws.reshape(n, L // n, W, W))},
                                    pre=lambda p, b: b["x"], pre_params=jnp.zeros(()),
                                    post_loss=lambda p, h, b: jnp.mean((h - b["y"]) ** 2), post_params=jnp.zeros(()))
        return make, {"x": r.normal(size=(B, W)).astype(np.float32), "y": r.normal(size=(B, W)).astype(np.float32)}
    vocab = {"gpt": 64, "gpt_head": 8192, "gpt_tensor": 64}[name]
    axes = {"tensor": "tensor"} if name == "gpt_tensor" else {}
    T, B, blocks = 64, 16, 4
    tok = r.integers(0, vocab, (B, T + 1)).astype(np.int32)
    # a model of blocks (cut=...), so that configure can also balance the cut (jaxpipe.tune.configure_cut)
    make = lambda n: jp.models.gpt(n, vocab=vocab, d_model=128, heads=4, seq_len=T, cut=[blocks // n] * n, **axes)
    return make, {"x": tok[:, :-1], "y": tok[:, 1:]}


def _row(c, measured=None):
    return {"label": c.label(), "key": [c.schedule, c.stages, c.data, c.microbatches, c.residuals, c.fsdp, c.tensor],
            "step_s": c.step_s, "bubble": c.bubble, "memory": c.memory, "compiled": c.compiled_memory,
            "dropped": c.dropped, "measured_s": measured, "configure_measured_s": c.measured_s}


def one_model(name: str):
    """configure, every fitting candidate timed, and the tight budget's choice trained for a step."""
    import jax
    import numpy as np
    import optax
    import jaxpipe as jp
    make, batch = setup(name)
    opt = optax.adamw(1e-3)
    t0 = time.perf_counter()
    conf = jp.configure(make, batch, opt, devices=2, memory_budget=float("inf"),
                        schedules=tuple(FLAGS.schedules.split(",")),
                        microbatches=tuple(int(m) for m in FLAGS.microbatches.split(",")),
                        residuals=("all", "inputs"), cache=None, verbose=False, measure=FLAGS.measure)
    decide_s = time.perf_counter() - t0
    default = next(c for c in conf.candidates
                   if (c.schedule, c.stages, c.data, c.microbatches, c.residuals) == DEFAULT and c.cut is None)
    # each budget's choice first (a budget's own balanced cut is a candidate of its own), then every candidate
    # that fits any of them timed
    choices = []
    for budget in (float("inf"), default.memory - 1):
        try:
            choices.append((budget, conf.within(budget, measure=FLAGS.measure)))
        except jp.ConfigError as e:
            choices.append((budget, e))
    fits = {}
    for got in [conf] + [g for _, g in choices if not isinstance(g, Exception)]:
        fits.update({c.label(): c for c in got.candidates if not c.dropped})
    runs = {}
    for label, c in fits.items():
        pipe = jp.Pipeline(conf.model(c), optimizer=opt, **c.pipeline_kwargs())
        b = pipe.shard_batch(batch)
        s = pipe.init()
        for _ in range(2):
            s = pipe.step(s, b)[0]
        runs[label] = [lambda s, pipe=pipe, b=b: pipe.step(s, b)[0], s]
    from jaxpipe.bench import round_steps
    per_round = round_steps(runs, FLAGS.rounds)
    measured = {k: float(np.median(v)) for k, v in per_round.items()}
    del runs
    out = {"model": name, "decide_s": decide_s, "budgets": []}
    for budget, got in choices:
        if isinstance(got, Exception):
            out["budgets"].append({"budget": budget, "refused": str(got)})
            continue
        rows = [_row(c, measured.get(c.label()) if not c.dropped else None) for c in got.candidates]
        entry = {"budget": budget, "pick": got.best.label(), "rows": rows, "cut_note": got.cut_note,
                 "predicted_pick": min((c for c in got.candidates if not c.dropped), key=lambda c: c.step_s).label()}
        if budget != float("inf"):         # the defaults do not fit: the pick must, and must train
            pipe = jp.Pipeline(got.model(), optimizer=opt, **got.best.pipeline_kwargs())
            st, metrics = pipe.step(pipe.init(), pipe.shard_batch(batch))
            entry["trained_loss"] = float(jax.device_get(metrics["loss"]))
            entry["default_memory"] = default.memory
        out["budgets"].append(entry)
    return out


def worker(pid: int):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{FLAGS.port}", num_processes=2, process_id=pid)
    from jaxpipe import host_memory
    host_memory.choose(True)
    for name in FLAGS.models.split(","):
        res = one_model(name)
        if pid == 0:
            print(json.dumps(res), flush=True)


def report(results) -> None:
    for res in results:
        print(f"\n## {res['model']} (configure decided in {res['decide_s']:.0f} s on the testbed)")
        for b in res["budgets"]:
            lim = "no limit" if b["budget"] == float("inf") else f"{b['budget'] / 2**20:.2f} MiB a device"
            if "refused" in b:
                print(f"\n{lim}: refused: {b['refused']}")
                continue
            fit = [r for r in b["rows"] if not r["dropped"] and r["measured_s"]]
            best = min(fit, key=lambda r: r["measured_s"])
            pick = next(r for r in b["rows"] if r["label"] == b["pick"])
            pred = next(r for r in b["rows"] if r["label"] == b["predicted_pick"])
            print(f"\n{lim}: predicted fastest {pred['label']} measured {pred['measured_s'] * 1e3:.1f} ms "
                  f"({pred['measured_s'] / best['measured_s']:.3f}x the fastest)")
            print(f"{lim}: pick {b['pick']} measured {pick['measured_s'] * 1e3:.1f} ms; fastest measured "
                  f"{best['label']} {best['measured_s'] * 1e3:.1f} ms: pick / fastest = "
                  f"{pick['measured_s'] / best['measured_s']:.3f}"
                  + (f"; defaults need {b['default_memory'] / 2**20:.2f} MiB; the pick trained a step "
                     f"(loss {b['trained_loss']:.3f})" if "trained_loss" in b else ""))
            if b.get("cut_note"):
                print(f"{lim}: cut: {b['cut_note']}")
            print("| candidate | predicted | timed by configure | measured | bubble | memory (pred.) | compiled | note |")
            print("|---|---|---|---|---|---|---|---|")
            for r in sorted(b["rows"], key=lambda r: (bool(r["dropped"]), r["measured_s"] or 1e9)):
                comp = f"{r['compiled'] / 2**20:.2f} MiB" if r["compiled"] else ""
                meas = f"{r['measured_s'] * 1e3:.1f} ms" if r["measured_s"] else ""
                note = r["dropped"] or ("**pick**" if r["label"] == b["pick"] else "")
                conf_t = f"{r['configure_measured_s'] * 1e3:.1f} ms" if r.get("configure_measured_s") else ""
                print(f"| {r['label']} | {r['step_s'] * 1e3:.1f} ms | {conf_t} | {meas} | {r['bubble']:.0%} | "
                      f"{r['memory'] / 2**20:.2f} MiB | {comp} | {note} |")


def main(argv):
    del argv
    if FLAGS.worker >= 0:
        return worker(FLAGS.worker)
    args = [a for a in sys.argv[1:] if not a.startswith("--worker")]
    from jaxpipe.bench import machine_load
    load = machine_load()
    procs = [subprocess.Popen(["taskset", "-c", str(p), sys.executable, "-m", "experiments.configure_truth", *args,
                               f"--worker={p}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for p in (1, 0)]
    out = procs[1].communicate()[0]
    procs[0].wait()
    results = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    if not results:
        raise SystemExit(f"experiments.configure_truth: the workers reported nothing (is port {FLAGS.port} free, "
                         f"and are there two cores?)")
    print(f"machine load before: {load}")
    report(results)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"load": load, "results": results}, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
