"""Every synchronous schedule on a real two-device pipeline, beside the lockstep model's prediction.

Two processes (``jax.distributed``, Gloo collectives), one CPU device each, each pinned to its own core, are a
real pipeline: the devices run side by side and wait for each other's messages, so a bubble costs real time
(emulated devices sharing cores show none).  The model: an MLP of ``--layers`` ``tanh(h @ W)`` layers, W
``--width``², batch ``--batch``, SGD -- the two-process testbed the benchmarks page describes.

    python -m experiments.two_devices                                  # M = 4 and 8, every schedule
    python -m experiments.two_devices --microbatches=4 --schedules=1f1b,zb_h1,zb_h1:lanes

A schedule may carry its placement (``zb_h1:lanes``; default ``auto``, what ``Pipeline`` runs).  With
``--op_costs=10,10,16`` every pipeline gets those op costs (ZB-H1 then runs ticks chosen for them);
``zb_h1/unit`` keeps the unit-time order beside it.  Steps are
timed in turns (A B C A B C ...) so that a slow phase of the machine hits every schedule alike; the median of
``--rounds`` rounds of 3 steps is reported.  The prediction is :func:`jaxpipe.tune.lockstep.predict_devices`
of the same plan, from costs measured on this machine: the ops from the plain step of the same work (in
``--op_costs``' ratios), the link (an exchange between the two processes inside a compiled loop: latency and
bytes/s), and one calibrated cost, a step's own (``jaxpipe.tune.lockstep.calibrate_step``: the mean over
1F1B's runs of what its measured step holds beyond its predicted ticks; ``--fit_scale`` fits the ops' scale
too), so 1F1B's prediction equals its measurement on average; every other schedule's is a prediction.  Beside
it, ``own/1f1b``: the ratio to 1F1B that the pipeline itself predicted at the op costs it measured at its
first step (:func:`jaxpipe.tune.running_costs.predicted_against_1f1b`: what it places its plan and warns
by), and ``meas/own``: the measured ratio over it.  Needs a quiet machine with two cores.
"""

from __future__ import annotations

import functools
import json
import statistics
import os
import subprocess
import tempfile
import sys
from typing import Any, NamedTuple

from jaxpipe.cli import common as cli
from absl import app, flags


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    _testbed_flags()
    _prediction_flags()
    _process_flags()


def _testbed_flags() -> None:
    """What runs: the schedules, the model, the rounds."""
    flags.DEFINE_string(
        "schedules",
        "1f1b,gpipe,zb_h1,zb_v,dualpipe_v,interleaved_1f1b,chimera",
        "comma-separated schedules, each optionally name:placement; a name ending in .csv is a schedule file "
        "in PyTorch's CSV format ({M} in it: the micro-batch count), e.g. tests/data/torch_zbv_d2_m{M}.csv",
    )
    flags.DEFINE_string("microbatches", "4,8", "comma-separated M values")
    flags.DEFINE_integer("layers", 8, "tanh layers in the model")
    flags.DEFINE_integer("width", 1024, "layer width")
    flags.DEFINE_integer("batch", 256, "rows per step")
    flags.DEFINE_integer("rounds", 9, "timing rounds (3 steps each, schedules in turns)")
    flags.DEFINE_integer("port", 12419, "coordinator port on 127.0.0.1")
    flags.DEFINE_string("json", "", "also write the results to this file")


def _prediction_flags() -> None:
    """What the lockstep prediction is made from."""
    flags.DEFINE_bool(
        "measure_ops",
        False,
        "predict from one layer's F, B, B-input and W measured on this machine "
        "(jaxpipe.tune.microbench.layer_costs; on a noisy VM they move by 2x between runs) instead of "
        "from the plain step with b = 2 f and a split backward's parts f each, as the papers count",
    )
    flags.DEFINE_bool(
        "ops_alone",
        False,
        "with --measure_ops: time the ops on process 0 while the other waits (the "
        "default times them on both processes at once, as a pipeline's ticks run them: the two cores share "
        "the L3 cache and the memory bus, and ops timed alone priced the many small ops of the two-chunk "
        "plans 10-20% low)",
    )
    flags.DEFINE_string(
        "profile",
        "",
        "after the timed rounds, trace 3 steps of every pipeline on both processes "
        "with jax.profiler into this folder (p<process>_<M>_<schedule>/)",
    )
    flags.DEFINE_string(
        "op_costs",
        "",
        "f,b,w[,x]: one stage's forward, its backward's input part, its weight part "
        "(and a tick's exchange x) "
        "(any one unit, e.g. 10,10,16 ms as profiled here), given to every Pipeline (op_costs=): "
        "placement='auto' ranks at them and zb_h1 and zb_v choose their ticks for them "
        "(jaxpipe.schedules.zb_costed); 'zb_h1/unit' (or zb_v/unit) in --schedules runs the unit-time order "
        "beside it, "
        "and the prediction takes the same ratios",
    )
    flags.DEFINE_bool(
        "fit_scale",
        False,
        "calibrate the ops' scale from 1F1B's runs at two micro-batch counts too, "
        "not only a step's own cost (jaxpipe.tune.lockstep.calibrate_step)",
    )


def _process_flags() -> None:
    """How the two processes run: their link's thread, the peer's service, the sketch, the stage form."""
    flags.DEFINE_enum(
        "link_thread",
        "idle",
        ["idle", "shared"],
        "idle: each process's Gloo I/O thread runs at SCHED_IDLE, so it gets the process's core only while "
        "the device's compute waits (a device's link does not run on its compute core); shared: as Gloo "
        "starts it -- its busy poll takes the core from the compute for up to a scheduler slice an "
        "exchange (1-3 ms at 128-256 KiB on this VM)",
    )
    flags.DEFINE_bool(
        "serve",
        False,
        "internal (experiments.peer): a worker builds its pipelines, then times one round of them for each "
        "'round' line on its standard input, answering a JSON line (process 0: {'M,schedule': seconds})",
    )
    flags.DEFINE_bool(
        "sketch",
        False,
        "also time the interleaved sketch (experiments.sketch_interleaved: one shard_map, two lanes a tick) "
        "at V = 2 and V = 1 (its own two-lane 1F1B), as runs sketch_interleaved and sketch_1f1b: the ratio a "
        "two-chunk schedule is held to",
    )
    flags.DEFINE_enum(
        "stage_form",
        "scan",
        ["scan", "apart"],
        "how a stage holds its layers, in the pipelines and the plain step alike: one stacked array run by a "
        "lax.scan, or a tuple of one array per layer (as PyTorch's peer holds them; jaxpipe.bench.layers_fn)",
    )
    flags.DEFINE_integer(
        "worker", -1, "internal: this process's index (the launcher sets it; -2: the one-core costs)"
    )


FLAGS = flags.FLAGS
CHUNKED = ("interleaved_1f1b", "zb_v", "dualpipe_v")


def _model(jp, jnp, Ws, stages):
    from jaxpipe.bench import held_as, layers_fn

    layers = layers_fn(FLAGS.stage_form)
    L, W = Ws.shape[0], Ws.shape[1]
    return jp.PipelineModel(
        stage_fn=lambda p, h: layers(p["w"], h),
        stage_params={"w": held_as(FLAGS.stage_form, Ws.reshape(stages, L // stages, W, W))},
        pre=lambda p, b: b["x"],
        pre_params=jnp.zeros(()),
        post_loss=lambda p, h, b: jnp.mean((h - b["y"]) ** 2),
        post_params=jnp.zeros(()),
    )


def _link(pid, sizes):
    """``[(bytes, seconds)]``: one exchange between the two processes *inside* a compiled loop (as the
    executor's run), for messages of ``sizes`` float32 elements: loops of 5 and of 25 exchanges, the
    difference over the 20 extra exchanges (:func:`jaxpipe.tune.microbench.per_iteration`; a separately
    jitted ppermute also pays a call's dispatch on both processes, 1-3 ms here: a step's fixed cost, not a
    tick's)."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxpipe.tune.microbench import per_iteration

    mesh = jax.make_mesh((2,), ("stage",))

    def loop(n):
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("stage")), np.ones((n,), np.float32))

        def make(k):
            body = lambda a: lax.fori_loop(0, k, lambda i, a: lax.ppermute(a, "stage", [(0, 1), (1, 0)]), a)
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage")))
            return lambda: f(x)

        return make

    # every size twice, the cheaper kept: the first loops also pay the link's warm-up
    per = [per_iteration({n: loop(n) for n in sizes}, (5, 25), calls=5) for _ in range(2)]
    return [(4.0 * n, min(p[n] for p in per)) for n in sizes]


def _thread_cpu():
    """``{thread id: (CPU ticks, name)}`` of this process's threads."""
    import glob

    out = {}
    for t in glob.glob("/proc/self/task/*"):
        try:
            st = open(t + "/stat").read().rsplit(")", 1)[1].split()
            out[int(t.rsplit("/", 1)[1])] = (int(st[11]) + int(st[12]), open(t + "/comm").read().strip())
        except (OSError, IndexError, ValueError):
            pass
    return out


def _idle_link_thread():
    """Demote Gloo's TCP I/O thread to SCHED_IDLE; returns ``[thread id, its CPU share during exchanges]``.

    Gloo's loop thread polls epoll and, while a message waits for its receive to be posted, finds it ready
    again at once: on a process pinned to one core it holds the core the device's compute needs until the
    scheduler preempts it.  Measured (`/tmp`-style probe, 25 exchanges in a compiled loop, pinned): 128 KiB
    1.1-2.8 ms an exchange, 256 KiB 2.8 ms; with that thread at SCHED_IDLE 0.23 and 0.39 ms; unpinned 0.11 and
    0.16 ms.  The thread is the one that used the most CPU (not the main thread, not XLA's ``tf_`` pool)
    while only exchanges ran."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("stage",))
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("stage")), np.ones((1 << 15,), np.float32)
    )
    loop = lambda a: lax.fori_loop(0, 25, lambda i, a: lax.ppermute(a, "stage", [(0, 1), (1, 0)]), a)
    f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P("stage"), out_specs=P("stage")))
    jax.block_until_ready(f(x))
    before = _thread_cpu()
    for _ in range(20):
        jax.block_until_ready(f(x))
    after = _thread_cpu()
    used = {
        t: c - before.get(t, (0, ""))[0]
        for t, (c, name) in after.items()
        if t != os.getpid() and not name.startswith("tf_")
    }
    tid = max(used, key=used.get)
    total = sum(c - before.get(t, (0, ""))[0] for t, (c, _) in after.items()) or 1
    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    return [tid, used[tid] / total]


def _own_schedule(jp, name: str, M: int):
    """The schedule a ``.csv`` entry names (``{M}`` in it stands for the micro-batch count): PyTorch's CSV
    format, read by :func:`jaxpipe.schedules.from_csv`; None for a built-in name."""
    if not name.endswith(".csv"):
        return None
    return jp.schedules.from_csv(name.format(M=M))


class _Built(NamedTuple):
    """A pipeline as its first step left it: the schedule's name, the placement and op costs chosen, the
    replica seconds its prediction adds (Chimera) and the one-stage costs it priced 1F1B at (or None)."""

    name: str
    placement: str
    op_costs: Any
    layout: float
    one_stage: Any


def worker(pid: int):
    jax, idled = _join(pid)
    import jax.numpy as jnp
    import numpy as np

    L, W, B = FLAGS.layers, FLAGS.width, FLAGS.batch
    r = np.random.default_rng(0)
    Ws = jnp.asarray(r.normal(size=(L, W, W)) / np.sqrt(W), jnp.float32)
    x, y = (np.asarray(r.normal(size=(B, W)), np.float32) for _ in range(2))
    runs, built = _pipelines(Ws, x, y)
    if FLAGS.sketch:
        runs.update(_sketch_runs(Ws, x, y, sorted({k[0] for k in runs})))
    plains = {M: _plain_step(Ws, x, y, M) for M in {k[0] for k in runs}} if pid == 0 else {}
    for M, fn in plains.items():  # process 0 alone, on its core, in the same rounds (the other waits)
        runs[(M, "plain")] = [fn, jax.block_until_ready(fn(fn(Ws)))]  # compiled and warm
    if FLAGS.serve:
        return _serve(pid, runs, built)
    costs = _measured_layer_costs(pid, runs, Ws, x)
    # the sizes the steps move: a small message, a micro-batch's activation, the stage's weights (Chimera's
    # replica)
    acts = {FLAGS.batch // M * W for M in {k[0] for k in runs}}
    link = _link(pid, sorted({16, *acts, L // 2 * W * W}))
    from experiments.bench import round_steps

    per_round = round_steps(runs, FLAGS.rounds)
    got = {k: float(np.median(v)) for k, v in per_round.items()}
    if FLAGS.profile:
        _profile(pid, {k: v for k, v in runs.items() if k[1] != "plain"})
    if pid == 0:
        steps = [[M, spec, *built[(M, spec)][1:], t] for (M, spec), t in got.items() if (M, spec) in built]
        result = {
            "link": link,
            "idled": idled,
            "plain": {M: got[(M, "plain")] for M in plains},
            "costs": costs,
            "steps": steps,
            "rounds": {f"{M},{spec}": v for (M, spec), v in per_round.items()},
        }
        print(json.dumps(result), flush=True)


def _join(pid: int):
    """``(jax, idled)``: this process joined to the other over Gloo, one CPU device each, the link's thread
    idled where asked (``--link_thread``)."""
    # the caller's XLA flags (an experiment's), then one device a process (the last of a flag wins)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    ).strip()
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{FLAGS.port}", num_processes=2, process_id=pid)
    # before any pipeline: each prices a tick at its first step (and the process keeps that price), which
    # with Gloo's thread still polling on the compute's core came out 3-10x what the timed steps pay
    idled = _idle_link_thread() if FLAGS.link_thread == "idle" else None
    return jax, idled


def _pipelines(Ws, x, y):
    """``(runs, built)``: every ``--schedules`` x ``--microbatches`` pipeline built, stepped twice (its
    first step measures its costs and places its plan), as ``{(M, spec): [step, state]}`` and
    ``{(M, spec): _Built}``."""
    import jax.numpy as jnp
    import optax

    import jaxpipe as jp
    from jaxpipe.tune import running_costs

    runs, built = {}, {}
    for M in [int(m) for m in FLAGS.microbatches.split(",")]:
        for spec in FLAGS.schedules.split(","):
            name, _, placement = spec.partition(":")
            unit = name.endswith("/unit")
            name = name.removesuffix("/unit")
            own = _own_schedule(jp, name, M)  # a CSV file of actions (PyTorch's own order, or yours)
            stages = own.num_model_stages if own else 4 if name in CHUNKED else 2
            pipe = jp.Pipeline(
                _model(jp, jnp, Ws, stages),
                schedule=own or name,
                num_microbatches=M,
                optimizer=optax.sgd(1e-3),
                mesh=jp.make_mesh(stages=2),
                placement=placement or "auto",
                op_costs=None if unit or own else _op_costs(),
                options={"virtual": 2} if name == "interleaved_1f1b" else None,
            )
            b = pipe.shard_batch({"x": x, "y": y})
            s = pipe.init()
            for _ in range(2):
                s = pipe.step(s, b)[0]
            runs[(M, spec)] = [lambda s, pipe=pipe, b=b: pipe.step(s, b)[0], s]
            # as chosen at the first step; what the pipeline adds for Chimera's replicas (kept from its first
            # step; every process), and 1F1B's one-stage costs it warned against where a device holds two
            built[(M, spec)] = _Built(
                name,
                pipe.placement,
                pipe.op_costs,
                running_costs.layout_seconds(pipe.model, pipe.schedule),
                _one_stage_costs(pipe, {"x": x, "y": y}, M),
            )
    return runs, built


def _measured_layer_costs(pid: int, runs, Ws, x) -> dict:
    """One layer's F, B, B's input part and W on this core, per stage size and micro-batch (``--measure_ops``;
    a W that costs more than a forward narrows ZB's gain).  Timed on both processes at once (process 0's
    reported), as the ticks run them, or on process 0 alone (``--ops_alone``; the other waits in the link's
    first exchange)."""
    if not FLAGS.measure_ops or (pid != 0 and FLAGS.ops_alone):
        return {}
    from jax.experimental import multihost_utils

    if not FLAGS.ops_alone:
        multihost_utils.sync_global_devices("layer costs")
    L, B = FLAGS.layers, FLAGS.batch
    costs = {
        f"{M},{per}": _layer_costs(Ws[:per], x[: B // M], per)
        for M in sorted({k[0] for k in runs})
        for per in sorted({L // (4 if k[1].partition(":")[0] in CHUNKED else 2) for k in runs})
    }
    return costs if pid == 0 else {}


#: the sketch's runs (``--sketch``): name -> model chunks a device
SKETCH = {"sketch_1f1b": 1, "sketch_interleaved": 2}


def _sketch_runs(Ws, x, y, microbatches):
    """``{(M, name): [step, output]}`` of the interleaved sketch and its two-lane 1F1B (:data:`SKETCH`) on the
    same model and batch, compiled and warm; a step ignores its state (the sketch computes the gradient only,
    as the papers' schedules are compared)."""
    import jax
    from experiments.sketch_interleaved import sketch_step

    runs = {}
    for M in microbatches:
        for name, chunks in SKETCH.items():
            step, args, _ = sketch_step(Ws, x, y, 2, M, chunks)
            runs[(M, name)] = [
                lambda _, step=step, args=args: step(*args),
                jax.block_until_ready(step(*args)),
            ]
    return runs


def _serve(pid, runs, built):
    """Time one round of every run (:func:`experiments.bench.round_steps`) for each ``round`` line on standard
    input, answering a JSON line each (process 0 ``{"M,schedule": seconds of a step}``, process 1 ``{}``),
    until ``quit``: :mod:`experiments.peer` alternates these rounds with PyTorch's.  The first line says
    ``ready`` and, on process 0, each pipeline's placement and the op costs it was placed for
    (``{"plans": {"M,schedule": [placement, op_costs]}}``)."""
    from experiments.bench import round_steps

    plans = {f"{M},{spec}": [b.placement, b.op_costs] for (M, spec), b in built.items()} if pid == 0 else {}
    print(json.dumps({"ready": True, **({"plans": plans} if plans else {})}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        got = round_steps(runs, 1)
        print(
            json.dumps({f"{M},{spec}": v[0] for (M, spec), v in got.items()} if pid == 0 else {}), flush=True
        )


def _profile(pid, runs):
    """3 steps of each run traced by ``jax.profiler`` into ``--profile``/p<pid>_<M>_<schedule>."""
    import jax

    for (M, spec), entry in runs.items():
        jax.profiler.start_trace(
            os.path.join(FLAGS.profile, f"p{pid}_{M}_{spec.replace(':', '-').replace('/', '-')}")
        )
        for _ in range(3):
            entry[1] = entry[0](entry[1])
        jax.block_until_ready(entry[1])
        jax.profiler.stop_trace()


def _layer_costs(ws, xb, per):
    """``[f, b, b_input, w]`` seconds per layer of a stage of ``per`` layers on one micro-batch ``xb``, on
    this core, as the executor runs them (:func:`jaxpipe.tune.stage_bench.stashed_stage_costs`: residuals
    through a stash, W from B's frontier added into the sums in place)."""
    import jax.numpy as jnp
    import jaxpipe as jp
    from jaxpipe.tune.stage_bench import stashed_stage_costs

    xb = jnp.asarray(xb)
    from jaxpipe.bench import held_as

    params = {"w": held_as(FLAGS.stage_form, ws)}
    c = stashed_stage_costs(_model(jp, jnp, ws, 1), params, xb, {"x": xb, "y": xb}, split=True)
    return [c[k] / per for k in ("F", "B", "B_input", "W")]


def _plain_step(Ws, x, y, M):
    """The plain one-device jitted step of the same work: M micro-batches' gradients summed, one SGD
    update."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax

    opt = optax.sgd(1e-3)
    B, W = x.shape

    from jaxpipe.bench import held_as, layers_fn

    layers = layers_fn(FLAGS.stage_form)

    def loss(ws, xb, yb):
        return jnp.mean((layers(ws, xb) - yb) ** 2)

    @jax.jit
    def step(ws):
        xs, ys = jnp.asarray(x).reshape(M, B // M, W), jnp.asarray(y).reshape(M, B // M, W)
        zero = jax.tree.map(jnp.zeros_like, ws)
        g = lax.scan(
            lambda acc, a: (jax.tree.map(jnp.add, acc, jax.grad(loss)(ws, *a)), None), zero, (xs, ys)
        )[0]
        g = jax.tree.map(lambda t: t / M, g)
        return optax.apply_updates(ws, opt.update(g, opt.init(ws), ws)[0])

    return lambda ws: step(ws if isinstance(ws, tuple) else held_as(FLAGS.stage_form, ws))


def main(argv):
    del argv
    if FLAGS.worker >= 0:
        return worker(FLAGS.worker)
    args = [a for a in sys.argv[1:] if not a.startswith("--worker")]
    from experiments.bench import MachineWatch

    watch = MachineWatch()  # before this run's own work, on both workers' cores
    from jaxpipe import host_memory  # each worker's glibc keeps freed memory from its start (host_memory)

    env = (
        dict(os.environ)
        if os.environ.get(host_memory.OPT_OUT, "1") == "0"
        else {**os.environ, **host_memory.KEEP_FREED_ENV}
    )
    logs = {p: tempfile.TemporaryFile("w+") for p in (0, 1)}
    procs = [
        subprocess.Popen(
            [
                "taskset",
                "-c",
                str(p),
                sys.executable,
                "-m",
                "experiments.two_devices",
                *args,
                f"--worker={p}",
            ],
            stdout=subprocess.PIPE,
            stderr=logs[p],
            text=True,
            env=env,
        )
        for p in (1, 0)
    ]
    out = procs[1].communicate()[0]
    procs[0].wait()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        for p in (0, 1):  # what each worker said before it stopped
            logs[p].seek(0)
            print(f"--- worker {p}, the end of its output:\n{logs[p].read()[-3000:]}", file=sys.stderr)
        raise SystemExit(
            "experiments.two_devices: the workers reported nothing (is port "
            f"{FLAGS.port} free, and are there two cores?)"
        )
    report({**json.loads(lines[-1]), "load": watch.load, "steal": watch.steal(), "machine": watch.summary()})


def _one_stage_costs(pipe, batch, M: int):
    """The one-stage op costs ``pipe`` predicted 1F1B at, where its own were timed over a device's several
    stages (Chimera's replica: :func:`jaxpipe.tune.running_costs.held_copies`); None otherwise (its own)."""
    from jaxpipe.tune import running_costs

    if pipe.op_costs is None or running_costs.held_copies(pipe.schedule) == 1 or _op_costs():
        return None
    mb = running_costs.microbatch_like(batch, M)
    return running_costs.measured(pipe.model, mb, 2, pipe.schedule.has_w()).op_costs()


def _op_costs():
    """``--op_costs`` as (f, b, w[, exchange]), or None."""
    if not FLAGS.op_costs:
        return None
    from jaxpipe.schedules.lanes import check_costs
    from jaxpipe.schedules import ScheduleError

    try:
        return check_costs(FLAGS.op_costs.split(","), "--op_costs")
    except ScheduleError as e:
        raise app.UsageError(str(e)) from None


class _Row(NamedTuple):
    """One measured schedule beside the model's parts (:func:`jaxpipe.tune.predict_devices`)."""

    M: int
    spec: str
    placement: str
    measured: float  # seconds a step
    plain: float  # the plain step's seconds, same rounds
    parts: dict


def report(res):
    """The measured steps beside the model's: a layer's forward f from the plain step measured in the same
    rounds (its work is M x layers x (f + b) with b = 2 f, a split backward's input and weight parts f each,
    as the papers count, or in ``--op_costs``' ratios), the link measured, and a step's own cost calibrated
    from 1F1B's measured steps (module docstring)."""
    from jaxpipe.tune import Link, calibrate_step

    table = tuple((float(n), float(t)) for n, t in res["link"])
    (n0, t0), (n1, t1) = table[0], table[-1]
    link = Link(t0, (t1 - t0) / max(n1 - n0, 1.0), table)
    rows = [_modelled(res, link, *entry) for entry in res["steps"]]
    ref = [(row.parts, row.measured) for row in rows if row.spec == "1f1b"]
    scale, fixed = (
        calibrate_step([p for p, _ in ref], [t for _, t in ref], fit_scale=FLAGS.fit_scale)
        if ref
        else (1.0, 0.0)
    )
    _print_costs(res, table, len(ref), scale, fixed)
    pred = {(r.M, r.spec): r.parts["step"] + (scale - 1) * r.parts["compute"] + fixed for r in rows}
    spreads = _print_rows(res, rows, pred)
    _print_sketch(res, sorted({row.M for row in rows}), spreads)
    from experiments.bench import reliability

    if res.get("machine"):
        print(res["machine"])
    for w in reliability(spreads, res.get("load"), res.get("steal")):
        print("warning: " + w)
    if FLAGS.json:
        out = [_json_row(row, pred[(row.M, row.spec)]) for row in rows]
        with open(FLAGS.json, "w") as fh:
            json.dump(
                {
                    "link": res["link"],
                    "link_thread": FLAGS.link_thread,
                    "scale": scale,
                    "fixed_s": fixed,
                    "rows": out,
                },
                fh,
                indent=1,
            )


def _json_row(row: _Row, predicted: float) -> dict:
    return {
        "M": row.M,
        "schedule": row.spec,
        "placement": row.placement,
        "measured_s": row.measured,
        "plain_s": row.plain,
        "predicted_s": predicted,
        "parts": row.parts,
    }


def _model_layer_costs(res, M: int, per: float, plain: float, given):
    """One layer's costs: measured where taken; else ``--op_costs``' ratios; else the papers' count (b = 2
    f, a split backward's parts f each; the plain step's work is M x layers x (f + b_in + w))."""
    from jaxpipe.tune import LayerCosts

    measured = res.get("costs", {}).get(f"{M},{int(per)}")
    if measured:
        return LayerCosts(*measured)
    fo, bo, wo = (given or (1.0, 1.0, 1.0))[:3]
    f = plain * fo / (M * FLAGS.layers * (fo + bo + wo))
    return LayerCosts(f, f * (bo + wo) / fo, f * bo / fo, f * wo / fo)


def _modelled(res, link, M, spec, placement, chosen_for, layout, one_stage, t) -> _Row:
    """One measured step (a ``res["steps"]`` entry) with the model's parts for it, and the ratio to 1F1B that
    the pipeline itself predicted at the costs it measured (``own_x_1f1b``)."""
    import jaxpipe as jp
    from jaxpipe.tune import predict_devices
    from jaxpipe.tune.running_costs import predicted_against_1f1b

    given = _op_costs()
    name = spec.partition(":")[0]
    unit = name.endswith("/unit")
    name = name.removesuffix("/unit")
    extra = {"virtual": 2} if name == "interleaved_1f1b" else {}
    if name in ("zb_h1", "zb_v") and chosen_for and not unit:
        extra["costs"] = tuple(chosen_for)  # the plan the pipeline ran: its ticks for these costs
    if chosen_for and not given:
        print(
            f"M={M} {spec}: placed {placement} for op costs measured at its first step: "
            + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in zip(("F", "B", "W", "tick"), chosen_for))
            + (f"; replicas {layout * 1e3:.3g} ms a step" if layout else "")
        )
    s = _own_schedule(jp, name, M) or jp.schedules.build(name, 2, M, **extra)
    plain = res["plain"][str(M)]
    per = FLAGS.layers / s.num_model_stages
    act = (FLAGS.batch // M) * FLAGS.width * 4
    # a tick's price as the pipeline measured it, less the one message it holds (priced by the link)
    priced = bool(chosen_for) and len(chosen_for) > 3
    meet = max(chosen_for[3] - link(act), 0.0) if priced else 0.0
    lc = _model_layer_costs(res, M, per, plain, given)
    weights = per * FLAGS.width * FLAGS.width * 4
    parts = predict_devices(s, lc, per, 0.0, link, act, weights, placement=placement, rendezvous=meet)
    if priced:  # what Pipeline itself predicted, at the costs it measured
        ref = tuple(one_stage) if one_stage else None  # 1F1B's stage where a device holds two
        mine, theirs, _ = predicted_against_1f1b(s, placement, tuple(chosen_for), layout, ref)
        parts["own_x_1f1b"] = mine / theirs
    return _Row(M, spec, placement, t, plain, parts)


def _print_costs(res, table, runs: int, scale: float, fixed: float) -> None:
    """The layer costs measured, the link, the calibration from 1F1B's runs, and the link thread."""
    for key, (f, b, b_in, w) in sorted(res.get("costs", {}).items()):
        M, per = key.split(",")
        print(
            f"one layer, M={M} ({per} a stage): f {f * 1e3:.2f} ms, b {b / f:.2f} f, B's input part "
            f"{b_in / f:.2f} f, "
            f"W {w / f:.2f} f"
        )
    print(
        "link (one exchange in a compiled loop): "
        + ", ".join(f"{n / 2**20:.3g} MiB {t * 1e3:.2f} ms" for n, t in table)
        + f"; from 1f1b's "
        f"{runs} run(s): ops x {scale:.3f}, {fixed * 1e3:.1f} ms a step"
    )
    idled = res.get("idled")
    print(
        "link thread: "
        + (
            f"Gloo's I/O thread at SCHED_IDLE (it used {idled[1]:.0%} of the core while only exchanges ran)"
            if idled
            else "shared (as Gloo starts it; --link_thread=idle demotes it)"
        )
    )


def _print_rows(res, rows, pred) -> dict:
    """The table of measured against predicted steps; each schedule's ratio to 1F1B and its spread (median
    and IQR/2 of the rounds' ratios) by name, for the reliability warnings."""
    from experiments.bench import ratio_spread

    print(
        f"{'M':>2} {'schedule':22s} {'placement':9s} {'measured':>9s} {'x plain':>8s} "
        f"{'x 1f1b (+- IQR/2)':>17s} "
        f"{'predicted':>10s} {'meas/pred':>9s} {'pred/1f1b':>9s} {'own/1f1b':>8s} {'meas/own':>8s}"
    )
    base = {row.M: row.measured for row in rows if row.spec == "1f1b"}
    rounds, spreads = res.get("rounds", {}), {}
    for M, spec, placement, t, plain, parts in rows:
        p = pred[(M, spec)]
        own, ref = rounds.get(f"{M},{spec}"), rounds.get(f"{M},1f1b")
        r, sp = ratio_spread(own, ref) if own and ref else (t / base[M] if M in base else float("nan"), 0.0)
        if spec != "1f1b":
            spreads[f"M={M} {spec} / 1f1b"] = (r, sp)
        own_x = parts.get("own_x_1f1b", float("nan"))
        print(
            f"{M:>2} {spec:22s} {placement:9s} {t * 1e3:7.1f}ms {t / plain:8.3f} {r:9.3f} +- {sp:.3f} "
            f"{p * 1e3:8.1f}ms {t / p:9.3f} {p / pred.get((M, '1f1b'), float('nan')):9.3f} "
            f"{own_x:8.3f} {r / own_x:8.3f}"
        )
    return spreads


def _print_sketch(res, Ms, spreads: dict) -> None:
    """The sketch's interleaved against its two-lane 1F1B, where it ran (``--sketch``)."""
    from experiments.bench import ratio_spread

    rounds = res.get("rounds", {})
    for M in Ms:
        own, ref = rounds.get(f"{M},sketch_interleaved"), rounds.get(f"{M},sketch_1f1b")
        if own and ref:
            r, sp = ratio_spread(own, ref)
            spreads[f"M={M} sketch"] = (r, sp)
            print(
                f"{M:>2} the sketch (experiments.sketch_interleaved): interleaved x its two-lane 1F1B "
                f"{r:.3f} +- {sp:.3f} ({statistics.median(own) * 1e3:.1f} against "
                f"{statistics.median(ref) * 1e3:.1f} ms)"
            )


if __name__ == "__main__":
    define_flags()
    cli.run(main)
