"""Benchmark helpers shared by the runners: the plain steps of the other methods, the pipeline and DP runners,
and the timing rounds (timings are ratios measured in one process).  The benchmark model and the plain
one-device step every ratio is measured against are :mod:`jaxpipe.bench`."""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

import jaxpipe as jp
from jaxpipe.axes import DATA
from jaxpipe.bench import plain_train_step
from jaxpipe.model import PipelineModel


def plain_predicting_step(
    model: PipelineModel,
    opt: optax.GradientTransformation,
    num_microbatches: int,
    fwd_distance: Callable[[int], int],
    bwd_distance: Optional[Callable[[int], int]] = None,
):
    """One-device step doing a predicting method's own work without a pipeline: M (gradient, update)
    micro-steps in a ``lax.scan`` where stage ``s``'s forward reads ``w_s + fwd_distance(s) u_s`` and its
    backward ``w_s + bwd_distance(s) u_s`` (``u_s``: the stage's last update; distance 0 or ``None``: ``w_s``
    itself, no axpy), through the executor's own ``StageOps`` -- the weight predictions SpecTrain and
    PipeOptim add to the plain micro-steps, which a pipeline cannot make cheaper."""
    from jaxpipe.runtime.stage import StageOps

    D, M = model.num_stages, num_microbatches

    def read(w, u, s, dist):
        ws = jax.tree.map(lambda a: a[s], w)
        d = 0 if dist is None else dist(s)
        return ws if d == 0 else jax.tree.map(lambda a, b: a + d * b[s], ws, u)

    def one(c, mb):
        params, opt_state, u, loss = c
        (w, pre_p, post_p) = params
        x = jax.eval_shape(model.pre, pre_p, mb)
        ops, _ = StageOps.build(
            model, jax.tree.map(lambda a: a[0], w), jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), x), mb
        )
        h, stash = None, []
        for s in range(D):
            h, res, head = ops.forward(
                read(w, u[0], s, fwd_distance), h, mb, pre_p, post_p, s == 0, s == D - 1
            )
            stash.append(res)
        l, _, g_post, dy = head
        dws = [None] * D
        for s in reversed(range(D)):
            dws[s], dy = ops.backward(read(w, u[0], s, bwd_distance), stash[s], dy)
        g = (jax.tree.map(lambda *a: jnp.stack(a), *dws), ops.pre_grad(pre_p, mb, dy), g_post)
        upd, opt_state = opt.update(g, opt_state, params)
        return (optax.apply_updates(params, upd), opt_state, upd, loss + l / M), None

    def step(params, opt_state, u, batch):
        mbs = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        params, opt_state, u, loss = jax.lax.scan(one, (params, opt_state, u, jnp.zeros(())), mbs)[0]
        return params, opt_state, u, loss

    return jax.jit(step, donate_argnums=(0, 1, 2))


def plain_predicting_runner(
    model: PipelineModel, batch, num_microbatches: int, opt, fwd_distance, bwd_distance=None
) -> Callable[[], object]:
    """A closure running :func:`plain_predicting_step` on one device."""
    dev = jax.devices()[0]
    fn = plain_predicting_step(model, opt, num_microbatches, fwd_distance, bwd_distance)
    b = jax.device_put(batch, dev)
    params = jax.device_put(jax.tree.map(lambda a: jnp.array(a, copy=True), model.params), dev)
    st = {"p": params, "o": jax.jit(opt.init)(params), "u": jax.tree.map(jnp.zeros_like, params)}

    def run():
        st["p"], st["o"], st["u"], loss = fn(st["p"], st["o"], st["u"], b)
        return loss

    return run


def plain_runner(
    model: PipelineModel, batch, num_microbatches: int, opt, per_microbatch: bool = False, parts: int = 1
) -> Callable[[], object]:
    """A closure running the plain one-device step (accumulating over ``num_microbatches``; 1 = unchunked;
    see :func:`plain_train_step` for ``per_microbatch`` and ``parts``)."""
    dev = jax.devices()[0]
    fn = plain_train_step(model, opt, num_microbatches, per_microbatch, parts)
    b = jax.device_put(batch, dev)
    params = jax.device_put(model.params, dev, may_alias=False)
    st = {"p": params, "o": jax.jit(opt.init)(params)}

    def run():
        st["p"], st["o"], loss = fn(st["p"], st["o"], b)
        return loss

    return run


def sync_dp_runner(model: PipelineModel, batch, workers: int, opt) -> Callable[[], object]:
    """A closure running synchronous data parallelism on ``workers`` devices of this process: each device's
    gradient of its ``batch / workers`` rows, one ``psum``, the optimizer replicated (the textbook
    ``shard_map`` DP step) -- what Cyclic Data Parallelism replaces, on the same emulated devices."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxpipe import make_mesh

    mesh = make_mesh(data=workers)

    def step(params, opt_state, b):
        loss, g = jax.value_and_grad(model.loss)(params, b)
        g, loss = jax.lax.pmean((g, loss), DATA)
        u, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P(DATA)), out_specs=(P(), P(), P()), check_vma=False
        ),
        donate_argnums=(0, 1),
    )
    rep = NamedSharding(mesh, P())
    b = jax.device_put(batch, NamedSharding(mesh, P(DATA)))
    # a copy of our own: the step donates its inputs, and a replicated device_put may alias device 0's shard
    params = jax.device_put(jax.tree.map(lambda a: jnp.array(a, copy=True), model.params), rep)
    st = {"p": params, "o": jax.device_put(jax.jit(opt.init)(params), rep)}

    def run():
        st["p"], st["o"], loss = fn(st["p"], st["o"], b)
        return loss

    return run


def pipeline_runner(
    name: str,
    model: PipelineModel,
    batch,
    num_microbatches: int,
    opt,
    data: int = 1,
    devices: int = 0,
    pipes: int = 1,
    options=None,
):
    """``(run, info)``: a closure running ``Pipeline.step`` and its compile time, memory and simulation.
    ``devices``: the mesh's stage size (default: one device per model stage; interleaved uses fewer).
    ``options``: the schedule's options (default: none; a tunable advance, AvgPipe's, timed at 0)."""
    from jaxpipe import Pipeline, make_mesh, schedules

    pipe = Pipeline(
        model,
        schedule=name,
        num_microbatches=num_microbatches,
        optimizer=opt,
        mesh=make_mesh(stages=devices or model.num_stages, data=data, pipes=pipes),
        # a method with a tunable advance (AvgPipe) is timed at 0, without Algorithm 1's search
        options=options
        if options is not None
        else ({"advance": 0} if "advance" in schedules.method(name).options else None),
    )
    state = pipe.init()
    t0 = time.perf_counter()
    compiled = pipe.lower("step", state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    split = pipe.schedule.has_w()  # zero-bubble: B and W each half of a backward
    rep = pipe.schedule.simulate(f=1.0, b=2.0, w=1.0 if split else None)
    # asynchronous schedules never flush: in steady state the alternating timeline holds one F or one B per
    # device per tick, so its only lockstep loss is a tick costing max(f, b): 1 - (f + b) / (2 max(f, b));
    # the lanes timeline (F and B lanes every tick) loses nothing in steady state
    periodic = getattr(pipe.schedule, "periodic", None)
    lanes = periodic is not None and periodic.two_lanes
    lock_bubble = (0.0 if lanes else 1.0 - 3.0 / 4.0) if pipe.is_async else rep.lockstep_bubble_ratio
    b = pipe.shard_batch(batch)
    st = {"s": state}

    def run():
        st["s"], metrics = pipe.step(st["s"], b)
        return metrics["loss"]

    return run, {
        "schedule": name,
        "compile_s": compile_s,
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
        "state_bytes": int(getattr(mem, "argument_size_in_bytes", -1)),
        "weight_versions": rep.weight_versions,
        "lockstep_bubble": lock_bubble,
        "bubble": rep.bubble_ratio,
    }


def interleaved_medians(
    runners: Dict[str, Callable[[], object]], rounds: int, warmup: int = 2
) -> Dict[str, list]:
    """Time every runner once per round, in turn, for ``rounds`` rounds; returns the per-round times.

    Interleaving makes the ratios robust to the machine's speed drifting during the run (a shared CPU):
    a ratio is taken within a round, then the median over rounds is reported.
    """
    for run in runners.values():
        for _ in range(warmup):
            jax.block_until_ready(run())
    times = {k: [] for k in runners}
    for _ in range(rounds):
        for k, run in runners.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[k].append(time.perf_counter() - t0)
    return times


def block_medians(runners: Dict[str, Callable[[], object]], rounds: int, block: int = 5) -> Dict[str, list]:
    """Time each runner ``block`` steps in a row (after one untimed step), runner after runner, for ``rounds``
    rounds; returns each round's median per runner.  Consecutive steps of one program are what training runs;
    :func:`interleaved_medians` switches program at every step, which costs the pipelined steps more (their
    buffers and threads are cold after another program ran: SpecTrain 1.23x round-robin against 1.08-1.16x
    in blocks, BUILD_NOTES).  Ratios are taken within a round, as there."""
    times = {k: [] for k in runners}
    for _ in range(rounds):
        for k, run in runners.items():
            jax.block_until_ready(run())
            ts = []
            for _ in range(block):
                t0 = time.perf_counter()
                jax.block_until_ready(run())
                ts.append(time.perf_counter() - t0)
            times[k].append(statistics.median(ts))
    return times


def median_ratio(a, b) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def ratio_spread(a, b) -> Tuple[float, float]:
    """``(median, spread)`` of the per-round ratios ``a[i] / b[i]``: ``spread`` is half their interquartile
    range (the ratio is ``median +- spread`` for the middle half of the rounds)."""
    r = sorted(x / y for x, y in zip(a, b))
    if len(r) < 4:
        return statistics.median(r), (r[-1] - r[0]) / 2
    q = statistics.quantiles(r, n=4)
    return statistics.median(r), (q[2] - q[0]) / 2


#: a ratio whose spread is above this fraction of it, or a machine this loaded, is reported as unreliable
NOISY = 0.05


#: the share of the run's CPU time the hypervisor gave other guests (steal) above which its timings are
#: reported as unreliable (a shared VM's neighbours slow each round by another amount)
STOLEN = 0.02


def reliability(
    spreads: Dict[str, Tuple[float, float]], load: Optional[float] = None, steal: Optional[float] = None
) -> List[str]:
    """Warnings for a benchmark's ratios (``{name: (ratio, spread)}``): those whose spread exceeds
    :data:`NOISY` of the ratio, a machine that was busy (``load``: the 1-minute load average per usable
    core before the run, :func:`machine_load`), and a hypervisor that took its cores' time during the run
    (``steal``: the share, :meth:`MachineWatch.steal`)."""
    out = [
        f"{k}: {r:.3f}x +- {s:.3f} varies by {s / r:.0%} between rounds (over {NOISY:.0%}): do not read its "
        f"last digits; rerun on a quiet machine or with more rounds"
        for k, (r, s) in spreads.items()
        if r and s / r > NOISY
    ]
    if load is not None and load > 0.25:
        out.append(
            f"the machine was busy before this run (load {load:.2f} per core): ratios here may not repeat"
        )
    if steal is not None and steal > STOLEN:
        out.append(
            f"the hypervisor gave {steal:.1%} of the run's CPU time to other guests (steal, over "
            f"{STOLEN:.0%}): each round was slowed by another amount, so ratios here may not repeat; rerun "
            "when the machine's steal is lower (the 8th number of /proc/stat's cpu line)"
        )
    return out


def machine_load() -> Optional[float]:
    """The 1-minute load average per usable core (None where the OS does not say)."""
    try:
        import os

        return os.getloadavg()[0] / max(len(os.sched_getaffinity(0)), 1)
    except (OSError, AttributeError):
        return None


class CpuTicks(NamedTuple):
    """Ticks of CPU time since boot on the cores counted (``/proc/stat``): all of them, and those the
    hypervisor gave other guests while this machine's CPU waited (steal)."""

    total: int
    steal: int


def cpu_ticks(cores=None, stat: str = "/proc/stat") -> Optional[CpuTicks]:
    """:class:`CpuTicks` summed over ``cores`` (CPU numbers; None: the whole machine), or None where the OS
    keeps no such file (not Linux).  The fields after ``cpuN``: user, nice, system, idle, iowait, irq,
    softirq, steal (guest time is inside user's)."""
    try:
        with open(stat) as fh:
            lines = [ln.split() for ln in fh if ln.startswith("cpu")]
    except OSError:
        return None
    wanted = ["cpu"] if cores is None else [f"cpu{c}" for c in cores]
    rows = [[int(v) for v in ln[1:9]] for ln in lines if ln[0] in wanted and len(ln) >= 9]
    if not rows:
        return None
    return CpuTicks(sum(sum(r) for r in rows), sum(r[7] for r in rows))


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name and which of the vector extensions that decide a matrix product's speed it
    has (AVX2, AVX-512, AMX): which library's CPU step is faster changed with them between two VMs
    (docs/benchmarks.md, "Beside PyTorch").  ``"unknown CPU"`` where the OS does not say."""
    try:
        with open(cpuinfo) as fh:
            text = fh.read()
    except OSError:
        return "unknown CPU"
    info = dict((k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in text.splitlines()) if v)
    flags = set(info.get("flags", "").split())
    kinds = [
        name
        for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("amx_tile", "AMX"))
        if flag in flags
    ]
    return f"{info.get('model name', 'unknown CPU')} ({', '.join(kinds) or 'no AVX2'})"


class MachineWatch:
    """The machine around a benchmark run: its load before (:func:`machine_load`) and the hypervisor's steal
    during it, on the cores the run may use.  Create it before the run's own work; read :meth:`steal` and
    :meth:`summary` after it."""

    def __init__(self, cores=None):
        import os

        if cores is None and hasattr(os, "sched_getaffinity"):  # else (macOS): the whole machine
            cores = sorted(os.sched_getaffinity(0))
        self.cores = None if cores is None else list(cores)
        self.load = machine_load()
        self._start = cpu_ticks(self.cores)

    def steal(self) -> Optional[float]:
        """The share of the cores' time stolen since the watch began (None: not measurable here)."""
        now = cpu_ticks(self.cores)
        if self._start is None or now is None or now.total <= self._start.total:
            return None
        return (now.steal - self._start.steal) / (now.total - self._start.total)

    def summary(self) -> str:
        """One line for the run's log: the load before and the steal during."""
        load = "unknown" if self.load is None else f"{self.load:.2f} per core"
        steal = self.steal()
        stolen = "not measurable here" if steal is None else f"{steal:.1%}"
        cores = "all" if self.cores is None else self.cores
        during = f"CPU steal during it {stolen} (cores: {cores})"
        return f"machine: {cpu_model()}; load {load} before the run; {during}"

    def warnings(self, spreads: Dict[str, Tuple[float, float]]) -> List[str]:
        """:func:`reliability`'s warnings with this watch's load and steal."""
        return reliability(spreads, self.load, self.steal())


def compile_time(
    name: str, model: PipelineModel, batch, num_microbatches: int, opt, devices: int = 0, options=None
) -> float:
    return pipeline_runner(name, model, batch, num_microbatches, opt, devices=devices, options=options)[1][
        "compile_s"
    ]


def cyclic_runner(rule: str, model: PipelineModel, batch, opt):
    """``(run, info)`` for Cyclic Data Parallelism's DP form: N = model stages workers on 'data', one
    micro-batch of ``batch / N`` rows each per step (the plain step to compare with accumulates N)."""
    from jaxpipe import CyclicDataParallel, make_mesh

    N = model.num_stages
    cdp = CyclicDataParallel(model, opt, rule=rule, mesh=make_mesh(data=N))
    b = jax.device_put(batch, jax.sharding.NamedSharding(cdp.mesh, jax.sharding.PartitionSpec(DATA)))
    state = cdp.init()
    state = state._replace(carry=cdp._empty_carry(b)[0])
    t0 = time.perf_counter()
    compiled = cdp._program(b).lower(state, b, jax.numpy.asarray(True)).compile()
    compile_s = time.perf_counter() - t0
    st = {"s": state}
    mem = compiled.memory_analysis()

    def run():
        st["s"], metrics = cdp.step(st["s"], batch)
        return metrics["loss"]

    return run, {
        "schedule": f"cdp_dp_{rule}",
        "compile_s": compile_s,
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
        "state_bytes": int(getattr(mem, "argument_size_in_bytes", -1)),
        "weight_versions": [2] * N,
        "lockstep_bubble": 0.0,
        "bubble": 0.0,
    }


def round_steps(runs, rounds: int, settle: int = 1):
    """``{key: [seconds of a step, per round]}``: every run's 3 steps in turn, ``rounds`` times (``runs``:
    ``{key: [step(state) -> state, state]}``, the states advanced in place) -- a slow phase of the machine
    touches every run alike.  Each run's timed steps follow ``settle`` untimed ones of its own: the first
    step after another program's ran slow (on the two-process testbed GPipe, whose program at M = 8 is
    1F1B's to the byte, measured 0.93-0.95x 1F1B, which each round timed first, after the plain steps)."""
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, entry in runs.items():
            step, s = entry
            for _ in range(settle):
                s = step(s)
            jax.block_until_ready(s)
            t0 = time.perf_counter()
            for _ in range(3):
                s = step(s)
            jax.block_until_ready(s)
            times[k].append((time.perf_counter() - t0) / 3)
            entry[1] = s
    return {k: [float(t) for t in v] for k, v in times.items()}


#: the loops :func:`loop_seconds` times (``experiments.loop_overhead``'s columns)
LOOPS = ("bare pipe.step loop", "jp.train, overlapped", "jp.train, read one by one")


def loop_seconds(pipe, batch, steps: int) -> dict:
    """Seconds a step of ``pipe`` on ``batch`` in each of :data:`LOOPS`: the bare loop waits once after
    ``steps`` steps; ``jp.train``'s is its steady step (its first step left out), no evaluation, no
    checkpoint."""

    def bare() -> float:
        state = pipe.init()
        state, metrics = pipe.step(state, batch)
        jax.block_until_ready(metrics)
        started = time.perf_counter()
        for _ in range(steps):
            state, metrics = pipe.step(state, batch)
        jax.block_until_ready((state, metrics))
        return (time.perf_counter() - started) / steps

    def trained(overlap: bool) -> float:
        quiet = dict(progress=False, tensorboard="false", eval_every=0, exit_on_stop=False)
        with tempfile.TemporaryDirectory() as out:
            batches = itertools.repeat(batch)
            result = jp.train(pipe, batches, steps=steps + 1, out_dir=out, overlap_steps=overlap, **quiet)
        return result.summary["steady_step_s"]  # (the first step, compiled or not, left out)

    return {LOOPS[0]: bare(), LOOPS[1]: trained(True), LOOPS[2]: trained(False)}
