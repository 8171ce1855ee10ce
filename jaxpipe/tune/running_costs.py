"""One stage's op costs and a tick's cost, measured on the running backend for the schedule it runs.

A flushing schedule's lane plan runs in lockstep: a tick lasts as long as its slowest device's actions, and
ends in one exchange that every device waits for (:mod:`jaxpipe.schedules.lanes`).  Which placement is
faster, and where zero-bubble's ticks go (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3:
the schedules are built from profiled F, B and W times), depend on what F, B and W cost on this backend and
on what one tick's exchange costs: on the two-process CPU testbed a tick cost about 3 ms against a 10 ms
forward, so a plan of 49 ticks lost to one of 21 at nearly the same lockstep makespan.  ``Pipeline``
measures them at its first step (``op_costs=None``, :func:`measured`), on every device of the pipeline at
once, as its ticks run them:

* F, B, W: :func:`jaxpipe.tune.microbench.op_costs` of one model stage (stage 0's weights) on one
  micro-batch of the step's shapes (ones; integer inputs zeros), the least of a few calls: a whole
  schedule's B is the whole backward; a split one's B the input gradient alone and its W the weight
  products alone, from the per-layer output gradients a B kept, as the executor's W lane runs them
  (:mod:`jaxpipe.runtime.wsplit`).  Priced as the whole backward less its input part instead, W came out
  at 0.8x what it costs run alone where the sums are added in place and 1.7x where they are not (one core,
  the testbed's stage at 64 rows: 4.3 and 9.5 against 5.5 ms, 2026-12-08), and the difference of two
  timings moved with the machine.  A stage whose W recomputes the backward (no frontier) keeps that
  difference, and where the two timings' noise hides it (a stage of microseconds) W timed alone, no
  dearer than the whole backward: a W of zero would tell the zero-bubble planner that it is free;
* the tick: loops of 4 and of 16 ticks, each ended by one ``ppermute`` around the stage ring -- uneven
  ticks (one device in turn running the stage twice, the others once) and even ones (every device twice)
  -- against the same loops without the exchange, every device running the stage twice; the dearer
  difference per tick (the short loop subtracted from the long one, so that a call's own start cancels) is
  what a tick's exchange and its rendezvous add beyond the slowest device's actions (the latency, the
  bytes, and the wake-up of a device that waited).

F, B and W are kept per (model, backend), a tick's price per (backend, devices, message), in
:class:`~jaxpipe.tune.measure_cache.MeasureCache` (a second run measures nothing) and in the process itself
(a multi-process job keeps no file: its pipelines are placed for one tick price, not each for its own probe);
in a multi-process job process 0's measurement is sent to every process, so that every process builds the
same program.
"""

from __future__ import annotations

import functools
import json
import time
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..schedules.lanes import lockstep_step as predicted_step  # the step every plan is ranked by

#: ``Pipeline(op_costs=...)``'s default where none is given: ``"measure"`` (at the first step) or ``"unit"``
#: (rank at unit costs, measure nothing): the environment's ``$JAXPIPE_OP_COSTS``, if set
ENV = "JAXPIPE_OP_COSTS"


class RunningCosts(NamedTuple):
    """Seconds on the running backend, every pipeline device busy at once.

    Attributes:
        forward: one model stage's forward on one micro-batch.
        backward: its backward (a split schedule: the input-gradient part alone).
        weight: a split schedule's weight-gradient part (0 otherwise).
        tick: what one tick's exchange adds to a tick (0 on one device).
    """

    forward: float
    backward: float
    weight: float
    tick: float

    def op_costs(self) -> tuple:
        """``(f, b, w, exchange)`` as ``Pipeline(op_costs=...)`` and the lane plans take them."""
        return (self.forward, self.backward, self.weight, self.tick)

    def describe(self) -> str:
        ms = lambda v: f"{v * 1e3:.3g} ms"
        return (
            f"F {ms(self.forward)}, B {ms(self.backward)}, W {ms(self.weight)}, a tick's exchange "
            f"{ms(self.tick)}"
        )


def microbatch_like(batch, per: int):
    """A micro-batch of ``batch``'s shapes and dtypes (its leading axis over ``per``): ones, integer inputs
    zeros (a valid id).  Only shapes are read: no value leaves the devices."""

    def one(a):
        shape = (int(np.shape(a)[0]) // per,) + tuple(np.shape(a)[1:])
        dtype = np.dtype(a.dtype)
        return np.zeros(shape, dtype) if np.issubdtype(dtype, np.integer) else np.ones(shape, dtype)

    return jax.tree.map(one, batch)


def _stage_op(model, mb):
    """``(stage_fn(w, x), w, x)``: model stage 0's weights and its input on ``mb``, as host arrays."""
    w = jax.tree.map(lambda a: np.asarray(a[0]), model.stage_params)
    x = np.asarray(jax.jit(model.pre)(model.pre_params, mb))
    ctx = model.example_context(mb) if model.context else None
    return (lambda w, h: model.apply_stage(w, h, ctx)), w, x


#: the tick-price probe's loops: every device runs the stage twice, then the ring exchange (``"even"``), or
#: not (``"alone"``); one device in turn twice, the others once, then the exchange (``"uneven"``)
TICK_LOOPS = ("even", "uneven", "alone")


def tick_loops(stage_fn, w, x, devices: int) -> dict:
    """The tick-price probe's loops (:data:`TICK_LOOPS`) over ``devices`` devices (at least 2), as
    :func:`~jaxpipe.tune.microbench.per_iteration` takes them: ``{kind: n -> thunk}``, the thunk a call of
    the compiled loop of ``n`` ticks, each loop length compiled once however often it is built."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    ring = [(i, (i + 1) % devices) for i in range(devices)]

    @functools.cache  # each loop compiled once, timed in every repeat
    def program(kind: str, n: int):
        def body(w, h):
            me = lax.axis_index("x")
            twice = lambda h: stage_fn(w, stage_fn(w, h).astype(h.dtype)).astype(h.dtype)
            once = lambda h: stage_fn(w, h).astype(h.dtype)

            def one(i, h):
                if kind == "alone":
                    return twice(h)
                work = lax.cond(i % devices == me, twice, once, h) if kind == "uneven" else twice(h)
                return lax.ppermute(work, "x", ring)

            return jnp.sum(lax.fori_loop(0, n, one, h))[None]

        specs = jax.tree.map(lambda _: P(), (w, x))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=False))

    args = jax.device_put((w, x), NamedSharding(mesh, P()))

    def loop(kind: str):
        def make(n: int):
            fn = program(kind, n)
            return lambda: fn(*args)

        return make

    return {kind: loop(kind) for kind in TICK_LOOPS}


def exchange_price(per_tick: dict) -> float:
    """What a tick's exchange adds, from seconds a tick of each of :data:`TICK_LOOPS`: the dearer of the
    uneven and the even loop's, less the loop without exchanges (:func:`_tick_cost`)."""
    return max(per_tick["uneven"], per_tick["even"], per_tick["alone"]) - per_tick["alone"]


#: seconds the tick-price probe may take: as many repeats as fit at its first repeat's time (its compiles
#: included; :func:`tick_repeats`), at least one.  Five repeats of a 2048-wide MLP stage of four layers at 64
#: rows took 73-77 s of a first step on two emulated CPU devices
TICK_PROBE_BUDGET_S = 20.0
#: the tick-price probe's repeats where time allows (the median of five: one price is a small difference of
#: large times)
MOST_REPEATS = 5


def _runs_that_fit(run_s: float, budget_s: float, least: int, most: int) -> int:
    """How many runs of ``run_s`` seconds fit in ``budget_s``, at least ``least`` and at most ``most``."""
    return max(least, min(most, int(budget_s // max(run_s, 1e-9))))


def tick_repeats(first_repeat_s: float, budget_s: float = TICK_PROBE_BUDGET_S) -> int:
    """How many repeats of the tick-price probe fit in ``budget_s``, the first of them having taken
    ``first_repeat_s``: at most :data:`MOST_REPEATS`, at least the one already run."""
    return _runs_that_fit(first_repeat_s, budget_s, 1, MOST_REPEATS)


def _process_0s(values: np.ndarray) -> np.ndarray:
    """``values`` as process 0 has them, in a multi-process job (the probes hold collectives, and every
    process must place its plans alike: each takes process 0's measurements)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def _tick_cost(
    stage_fn, w, x, devices: int, ticks=(4, 16), calls: int = 3, budget_s: float = TICK_PROBE_BUDGET_S
) -> float:
    """Seconds a tick's exchange adds to the slowest device's actions (the lockstep model's tick: the
    slowest device's actions, then the exchange): loops of ``ticks[0]`` and ``ticks[1]`` ticks of
    :data:`TICK_LOOPS`, each one's exchange priced against ``"alone"``, and the dearer of the two kept
    (:func:`exchange_price`).

    * uneven ticks, because a plan's are: a device that finished early waits in the exchange and must wake
      for it, which ticks of equal work never show (on the two-process testbed they priced a tick at
      0.13-0.47 ms, where DualPipeV's and ZB-V's ordered plans ran 0.7 ms a tick past the model's
      prediction at that price);
    * even ticks too, because the uneven loop's busier device shares the memory bus with a device that
      idles half the tick, and runs its two stages faster than ``"alone"`` does: at 64-row micro-batches
      that alone priced a tick at zero.

    Each loop length's time (:func:`~jaxpipe.tune.microbench.per_iteration`: what a call pays once -- its
    dispatch, the wait for the other processes to enter it -- cancels); the median of up to five such
    prices, as many as ``budget_s`` allows (:func:`tick_repeats`): one is a small difference of large
    times (one testbed run priced a tick at 0.0118 ms; ``experiments.tick_price`` repeats the probe in one
    process pair)."""
    from .microbench import per_iteration

    if devices < 2:
        return 0.0
    loops = tick_loops(stage_fn, w, x, devices)
    price = lambda: exchange_price(per_iteration(loops, ticks, calls))
    started = time.perf_counter()
    prices = [price()]
    repeats = int(_process_0s(np.int32(tick_repeats(time.perf_counter() - started, budget_s))))
    prices += [price() for _ in range(repeats - 1)]
    return float(np.median(prices))


def tick_price(model, mb, devices: int) -> float:
    """Seconds a tick's exchange adds on ``devices`` devices (:class:`RunningCosts`' ``tick``), with model
    stage 0's forward on the micro-batch ``mb`` as the tick's work: the message's bytes and the rendezvous."""
    return _tick_cost(*_stage_op(model, mb), devices)


def _ops(stage_fn, w, x, devices: int, split: bool, copies: int = 1, at_frontier: bool = False) -> tuple:
    """``(F, B, W)`` of one stage (module docstring), its ops cycling through ``copies`` copies of its
    weights (:func:`held_copies`); ``at_frontier``: the executor's W reads the frontier its B kept
    (:func:`_reads_frontier`), so W is timed alone, else priced as what the whole backward adds."""
    from .microbench import op_costs

    def timed(**kw):
        return op_costs(stage_fn, w, x, devices, [devices], best=True, copies=copies, **kw)

    # at_frontier is the same on every process (the model's structure): the probes hold collectives, and a
    # process that skipped one where another ran it deadlocked a two-process job
    at_frontier = split and at_frontier
    ops = timed(kinds=["F"] if at_frontier else [])
    if not split:
        return (ops["F"][-1], ops["B"][-1], 0.0)
    f, b_in = ops["F"][-1], timed(split=True, kinds=["B"])["B"][-1]
    alone = timed(split=True, kinds=["W"])["W"][-1]  # timed whatever this process's timings say
    if at_frontier:  # the weight products alone, from the frontier B kept, as the W lane runs them
        return (f, b_in, alone)
    whole = ops["B"][-1]
    if whole > b_in:  # W recomputes: what the whole backward costs beyond its input part
        return (f, b_in, whole - b_in)
    return (f, b_in, min(alone, whole))  # the timings' noise hides W: timed alone, an upper bound


def _reads_frontier(model, mb, w, x) -> bool:
    """Whether the executor's W of ``model``'s stage reads the output gradients its B kept, as the executor
    decides it (:func:`~jaxpipe.runtime.wsplit.stage_splits`: not where a residual policy recomputes)."""
    from ..runtime import wsplit

    return wsplit.stage_splits(model, w, x, mb)


def measure(model, mb, devices: int, split: bool, copies: int = 1) -> RunningCosts:
    """:class:`RunningCosts` of ``model`` (as the executor holds it: padded) on the micro-batch ``mb``, with
    ``devices`` devices busy at once (module docstring), each holding ``copies`` stages, measured now."""
    stage_fn, w, x = _stage_op(model, mb)
    ops = _ops(stage_fn, w, x, devices, split, copies, split and _reads_frontier(model, mb, w, x))
    return RunningCosts(*ops, _tick_cost(stage_fn, w, x, devices))


def held_copies(s) -> int:
    """How many model stages' weights a device of ``s`` holds at once for one model stage's op costs to
    stand for it: 1, or Chimera's chunks where its layout holds replicas (a device's own stage and the
    replica of another, each with its own gradient sum: twice the memory its ops stream).  Chunks of a
    finer cut (interleaved 1F1B, ZB-V, DualPipeV) hold what 1F1B's one stage holds, and are timed as one."""
    from ..schedules.layout import exchange_perms

    away = [pairs for pairs in exchange_perms(s) or () if pairs is not None]
    return 1 + len(away)


def copy_switch_rate(s) -> float:
    """The share of a device's consecutive actions in ``s`` that run another model stage than the action
    before: the busiest device's, 0 for a schedule of one stage a device.  A device of several held stages
    (:func:`held_copies`) streams the other stage's weights and sums again only where it switches."""
    rates = [
        sum(a.stage != b.stage for a, b in zip(acts, acts[1:])) / (len(acts) - 1)
        for acts in s.actions
        if len(acts) > 1
    ]
    return max(rates, default=0.0)


def held_stage_costs(one: RunningCosts, over_copies: RunningCosts, rate: float) -> RunningCosts:
    """A device's op costs where it holds several stages: one stage's (``one``) plus ``rate`` of what
    cycling through the copies added (``over_copies``, timed switching at every op; ``rate``:
    :func:`copy_switch_rate`).  On the two-process testbed (Chimera, D = 2, which switches on 8 of its
    15 consecutive actions) one stage's costs predicted Chimera 7% fast at M = 4 and 8, the costs timed
    over two copies 3-9% slow (BUILD_NOTES.md, "The executor")."""
    blend = lambda a, b: a + rate * (b - a)
    return RunningCosts(
        blend(one.forward, over_copies.forward),
        blend(one.backward, over_copies.backward),
        blend(one.weight, over_copies.weight),
        one.tick,
    )


#: this process's measurements by their cache keys.  A multi-process job keeps no cache file
#: (:func:`~jaxpipe.tune.measure_cache.default_path`): without these, each of its pipelines measured
#: again, and on the two-process testbed one run's pipelines priced a tick anywhere from 0.04 to 1.9 ms and
#: placed their plans by those prices.  Every process builds its pipelines in the same order, so each finds
#: the same entries (process 0's values).
_MEASURED: dict = {}


def forget_measured() -> None:
    """Drop this process's measurements (:data:`_MEASURED`): the next pipeline measures again, unless the
    cache file holds them."""
    _MEASURED.clear()


def _kept(store, key, measure):
    """``key``'s values: this process's, else the cache file's, else ``measure()``'s -- in a multi-process
    job process 0's, sent to every process."""
    name = json.dumps(key, default=str)
    if name not in _MEASURED:
        got = _process_0s(np.asarray(store.get(key, lambda: [float(v) for v in measure()]), np.float64))
        _MEASURED[name] = tuple(float(v) for v in got)
    return _MEASURED[name]


def measured(
    model, mb, devices: int, split: bool, cache: Optional[str] = "default", copies: int = 1
) -> RunningCosts:
    """:func:`measure`'s costs, each measured once per process and kept in the measurements cache (``cache``:
    a path, ``"default"`` or None), the same on every process of a multi-process job (process 0's).  F, B
    and W are kept per (model, backend, devices, split); a tick's price per (backend, devices, message): the
    exchange and the rendezvous, whichever model's stage runs between them (the stage's own time cancels
    against the loop without exchanges), so that every pipeline whose ticks send the same activation is
    placed for one price.  ``copies``: the stages a device holds (:func:`held_copies`), kept apart from
    the one-stage costs."""
    from .measure_cache import MeasureCache, backend_key, default_path, model_key, shapes_key

    store = MeasureCache(default_path() if cache == "default" else cache)
    stage_fn, w, x = _stage_op(model, mb)
    backend = backend_key()
    ops = _kept(
        store,
        ["op_costs_w_at_frontier", backend, model_key(model, mb), devices, bool(split)]
        + ([copies] if copies > 1 else []),
        lambda: _ops(stage_fn, w, x, devices, split, copies, split and _reads_frontier(model, mb, w, x)),
    )
    key = ["tick_price_uneven", backend, devices, shapes_key(x)]  # (uneven: not an earlier probe's price)
    (tick,) = _kept(store, key, lambda: [_tick_cost(stage_fn, w, x, devices)])
    return RunningCosts(*ops, tick)


#: plans whose predicted steps lie within this share of each other are timed, not ranked
#: (:func:`timed_placement`): the lockstep model's error.  On the two-process testbed the ordered plans ran
#: 1.00-1.15x the ratio to 1F1B their pipeline predicted and the lanes plans 0.94-1.06x, and DualPipeV at
#: M = 8, its plans predicted 4% apart, went to the ordered one at 1.04-1.11x 1F1B where lanes ran 1.00-1.05x
TIME_WITHIN = 0.10


#: seconds the timing of two close plans may take after each plan's first call (:func:`plan_timing_rounds`)
PLAN_TIMING_BUDGET_S = 5.0
#: rounds (one call of each plan, in turns) the timing of two close plans runs: at least, at most.  On the
#: two-process testbed (DualPipeV and ZB-V at D = 2, M = 4 and 8, plans whose steps differ by 4-7%) the
#: least of 3 calls ranked a plan's 170-ms step program 0.94-1.12x the other's in repeats of one process
#: pair, and put DualPipeV at M = 8 in its ordered plan in two runs of four (1.11-1.15x 1F1B, where its
#: lanes ran 1.03-1.07x); the least of 27 ranked all three as their steady steps do
PLAN_TIMING_ROUNDS = (3, 15)


def plan_timing_rounds(round_s: float, budget_s: float = PLAN_TIMING_BUDGET_S) -> int:
    """How many rounds of the two plans' calls fit ``budget_s``, a round taking ``round_s`` (each plan's
    first call, its compile excluded), within :data:`PLAN_TIMING_ROUNDS`: process 0's count on every process
    of a multi-process job (every call holds collectives)."""
    return int(_process_0s(np.int32(_runs_that_fit(round_s, budget_s, *PLAN_TIMING_ROUNDS))))


def plans_too_close(s, costs) -> bool:
    """Whether ``s``'s ordered and lanes plans are predicted within :data:`TIME_WITHIN` of each other at
    ``costs`` (``(f, b, w, tick)``), but not equal: too close for the model to rank.  Plans of which one
    holds more than twice the other's stash slots are ranked by the model (timing would trade memory for
    noise)."""
    if s.D < 2 or (s.has_pairs() and not s.options.get("double_batch")):  # (Chimera's pairs: lanes only)
        return False
    ordered, lanes = (round(predicted_step(s, p, costs), 9) for p in ("ordered", "lanes"))
    if ordered == lanes:  # a tie is no close call: the plan with fewer stash slots wins it
        return False
    slots = sorted(s.plan(p).stash_capacity for p in ("ordered", "lanes"))
    # nor a plan that holds more than twice the other's activations (GPipe's ordered plan: M, its lanes D + 1)
    return slots[1] <= 2 * slots[0] and abs(ordered / lanes - 1.0) < TIME_WITHIN


def timed_placement(model, mb, s, time_plans, cache: Optional[str] = "default") -> str:
    """The faster of ``s``'s ordered and lanes plans as timed: ``time_plans()`` gives the seconds of each
    plan's program (ordered's, lanes'), run on this backend.  Kept in the measurements cache per (model,
    backend, schedule, plans) and in the process, the same on every process of a multi-process job (process
    0's times), as :func:`measured` keeps the op costs."""
    from .measure_cache import MeasureCache, backend_key, default_path, model_key

    store = MeasureCache(default_path() if cache == "default" else cache)
    plans = [s.plan(p).num_ticks for p in ("ordered", "lanes")]
    key = ["plan_times", backend_key(), model_key(model, mb), s.name, s.D, s.num_microbatches, plans]
    ordered, lanes = _kept(store, key, time_plans)
    return "ordered" if ordered < lanes else "lanes"


def layout_seconds(model, s, cache: Optional[str] = "default") -> float:
    """Seconds a step of ``s`` spends on Chimera's stage replicas outside its ticks: each chunk held away
    from its owner fetched, its gradient sums zeroed, sent home and added
    (:func:`~jaxpipe.tune.microbench.replica_exchange_seconds`, measured on this backend at a stage's bytes
    and kept as the op costs are); 0 where the schedule moves no stage."""
    from ..schedules.layout import exchange_perms
    from .measure_cache import MeasureCache, backend_key, default_path
    from .memory import tree_bytes
    from .microbench import replica_exchange_seconds

    away = [pairs for pairs in exchange_perms(s) or () if pairs is not None]
    if not away:
        return 0.0
    stage_bytes = float(tree_bytes(model.stage_params) / model.num_stages)
    store = MeasureCache(default_path() if cache == "default" else cache)
    per_chunk = {
        str(pairs): _kept(
            store,
            ["replica_exchange", backend_key(), s.D, pairs, round(stage_bytes)],
            lambda pairs=pairs: [replica_exchange_seconds(s.D, pairs, stage_bytes)],
        )[0]
        for pairs in away
    }
    return sum(per_chunk[str(pairs)] for pairs in away)


def predicted_against_1f1b(
    s, placement: str, costs, layout: float = 0.0, ref_costs=None
) -> Tuple[float, float, str]:
    """``(s's step, 1F1B's step, 1F1B's placement)`` predicted at ``costs`` (one model stage's ``(f, b, w,
    tick)``; 1F1B's stage holds ``num_model_stages / D`` of them) on the same devices and micro-batches: the
    lockstep steps ``Pipeline`` places plans by, ``s``'s with ``layout`` seconds added (Chimera's replicas
    moved: :func:`layout_seconds`).  ``ref_costs``: 1F1B's stage's, where ``costs`` were timed over several
    stages held (:func:`held_copies`; default ``costs``)."""
    from ..schedules import build
    from ..schedules.lanes import fastest_placement

    f, b, w, tick = costs if ref_costs is None else ref_costs
    k = s.num_model_stages / s.D
    ref = build("1f1b", num_stages=s.D, num_microbatches=s.num_microbatches)
    ref_stage = (k * f, k * (b + w), 0.0, tick)  # 1F1B's stage: k model stages, its backward whole
    ref_placement = fastest_placement(ref, ref_stage)
    mine = predicted_step(s, placement, costs) + layout
    return mine, predicted_step(ref, ref_placement, ref_stage), ref_placement


def against_1f1b(s, placement: str, costs, layout: float = 0.0, ref_costs=None) -> Optional[str]:
    """A warning's text where ``s``'s plan is predicted slower than 1F1B's on the same devices and
    micro-batches at ``costs`` (one model stage's; 1F1B's stage holds ``num_model_stages / D`` of them; and
    ``layout`` and ``ref_costs``: :func:`predicted_against_1f1b`) by more than 1%, else None (1F1B itself:
    never)."""
    from ..schedules import build

    if s.D < 2:
        return None
    mine, theirs, ref_placement = predicted_against_1f1b(s, placement, costs, layout, ref_costs)
    ref = build("1f1b", num_stages=s.D, num_microbatches=s.num_microbatches)
    if mine <= theirs * 1.01:
        return None
    ticks = s.plan(placement).num_ticks, ref.plan(ref_placement).num_ticks
    return (
        f"jaxpipe: schedule {s.name!r} is predicted {mine / theirs:.2f}x 1F1B's step on this backend "
        f"({mine * 1e3:.3g} ms against {theirs * 1e3:.3g} ms at D = {s.D}, M = {s.num_microbatches}; its "
        f"{placement} plan runs {ticks[0]} ticks, 1F1B's {ticks[1]}); "
        f"at {RunningCosts(*costs).describe()}. schedule='1f1b' is predicted faster here"
    )
