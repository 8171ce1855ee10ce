"""The one executor: every method -- GPipe, 1F1B, interleaved 1F1B, ZB-H1, Chimera, AvgPipe, PipeDream,
PipeDream-2BW, SpecTrain, PipeOptim, CDP (both forms) and WPipe -- runs here, from the schedule IR as data.

One ``shard_map`` program per call, a ``lax.scan`` over lockstep ticks, read from a stream of the IR
(:class:`jaxpipe.schedules.periodic.Periodic`, read as a call table): on device ``d`` the F of stream unit
``i`` runs at tick ``period * i + offset_F[d]`` and its B at ``period * i + offset_B[d]`` (the no-flush 1F1B
family: PipeOptim Fig. 1(d)-(e), or F and B lanes in every tick), or at per-unit offsets of a call (Cyclic DP:
a worker's F down its N stages and B back up; a flushing schedule: its lane plan as a stream of one call).  A
unit is a micro-batch on one of the device's model chunks (:meth:`Periodic.unit_table`: WPipe's V units carry
G0's forward of batch p + 1 and G0's backward of batch p); chunk ``c`` of device ``d`` holds the model stage
of the stream's stage table (``c D + d``, or Chimera's mirrored pipelines).  Every capacity comes from
replaying the stream (:meth:`Periodic.buffers`).  Data replicas may run the stream late (``replica_delay``)
and reduce along a ring (below: Cyclic DP's DP form); AvgPipe's pipelines each train their own weights
(``replicas``).

Messages.  A periodic stream consumes every message the tick after it was sent (a register per direction;
a wrap-around buffer between chunks, indexed like the ring of micro-batches).  A stream of one call made from
a lane plan (``periodic.plan``) routes in the plan's slots instead: messages in both directions, kept or
waiting where the plan says, residuals in its stash slots; its lanes may include Chimera's paired forward (F2:
one doubled forward) and ZB's W (the weight gradient from the frontier B kept).

Nothing flushes between calls: the train state carries the stashed residuals, the messages on the wire, the
last stage's dL/dy, the recent micro-batches and, per chunk, each stage's weights, optimizer state and policy
state.  ``step`` feeds M micro-batches and runs ``period * U`` ticks (U units per call); ``drain`` runs calls
without feeding until everything in flight is finished.  Which weights an op reads and when updates land come
from the chunk's weight policy (``jaxpipe.optim.policies``; a flushing schedule's: ``gradient``, which sums
and returns): the executor never asks a method's name.  A tick is an F lane and a B lane (and F2/W where the
plan has them), each a predicate ``lax.cond`` around a switch over small outputs (nothing weight-sized passes
through a multi-way conditional: XLA copies such pass-throughs); the update runs in a conditional of its own
per chunk (a sum-only policy adds inside the backward's); accumulating policies land between scans, at the
tick the timeline allows (:func:`landing_points`), or in the ticks where some stage lands
(:func:`landing_segments`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..axes import AXES, DATA, DP_AXES, PIPE, STAGE, manual
from .buffers import full
from .inflight import own_buffers
from .lanes_forward import double_at, forward_at
from .program import Program, describe
from .stage import StageOps
from .ticks import TickState, scan_phases
from .front_pack import placed_in_stash
from .wsplit import split_backward

ALL = AXES


def make_stream_program(
    model,
    policy,
    opt,
    D: int,
    M: int,
    mesh,
    mb_example,
    nan_bubbles: bool = False,
    periodic=None,
    seed: int = 0,
    apc: bool = False,
    broadcast: str = "direct",
    replicas: bool = False,
    w_from: str = "frontier",
    eager_reduce: bool = False,
):
    """``fn(params, opt_state, policy_state, carry, counters, batch, feed) -> (same..., metrics)``: the
    ``shard_map`` program that runs one call of the stream ``periodic`` (:func:`.program.describe` says how).

    ``policy``: a :class:`~jaxpipe.optim.policies.WeightPolicy`, or a tuple of one per chunk; ``params``,
    ``opt_state`` and ``policy_state`` are then tuples over chunks, each ``(w [D..], pre [D..], post [D..])``
    per stage (pre/post: each stage's copy; stage 0's pre and the last stage's post are the trained ones).
    ``feed`` (traced bool): whether ``batch``'s M micro-batches enter the pipeline; ``drain`` calls the same
    program with ``feed=False`` (the batch is then written to ring slots no micro-batch in flight uses).
    ``counters = (t, base, n_fed)`` int32 scalars: tick since the last (re)start, global index of the first
    micro-batch since then, micro-batches fed since then.  ``mb_example``: one micro-batch per data replica.
    ``apc``: activations and gradients travel compressed (WPipe appendix A.3, :mod:`.apc`).  ``w_from`` (a
    stream with a W lane: ZB's ``"frontier"`` or ``"recompute"``) and ``eager_reduce`` (Chimera §3.2) are the
    schedule's choices, passed by the runner.

    Ring reduction (policies declaring ``reduction="ring"``: Cyclic DP's workers on ``data``, ``D = 1``, every
    stage a chunk of the worker): replica ``r`` runs the stream ``r * replica_delay`` ticks late; a backward
    adds the previous worker's partial sum of its chunk and sends the sum on (one ``ppermute`` per tick); the
    last worker's sum is complete: it updates the stage (``apply_sum``) and sends it to the others
    (``broadcast``: ``"direct"`` or ``"balanced"``, :func:`.collectives.balanced_broadcast`), which land it
    the next tick.  No collective runs inside a conditional, and none but point-to-point ones in the scan.
    ``params``, ``opt_state`` and ``policy_state`` are then one replica per worker (leading axis over data and
    stage) with the worker's chunks stacked (``[K, ...]``): the lanes slice their chunk inside their branches,
    a stage lands by dynamic-update-slice (:func:`.ring.land_stacked`).
    """
    prog = describe(
        model,
        policy,
        D,
        M,
        mesh,
        mb_example,
        periodic=periodic,
        nan_bubbles=nan_bubbles,
        seed=seed,
        apc=apc,
        broadcast=broadcast,
        replicas=replicas,
        w_from=w_from,
        eager_reduce=eager_reduce,
    )

    def body(params, opt_state, pstate, carry, counters, batch, feed):
        trace, state = open_trace(prog, params, opt_state, pstate, carry, counters, batch, feed)
        return run_call(prog, trace, state)

    def fn(params, opt_state, pstate, carry, counters, batch, feed):
        in_specs, out_specs = _call_specs(prog, replicas, params, opt_state, pstate, carry, counters, batch)
        return jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **manual(mesh)
        )(params, opt_state, pstate, carry, counters, batch, feed)

    fn.counting = prog.counting  # (sum, count) losses: the gradient policy divides by the counts itself
    return fn, prog.x_aval


def _call_specs(prog, replicas: bool, params, opt_state, pstate, carry, counters, batch):
    """``(in_specs, out_specs)`` of a stream call's ``shard_map``: a ring's workers each hold a replica of
    their own (one per data index), AvgPipe's pipelines one per pipe index, otherwise stage s's at index s;
    the carry one per device; the batch over the data axes; the metrics per pipeline where there are
    replicas."""
    own = prog.reduction.own_spec(prog)
    stage = lambda tree: jax.tree.map(lambda _: own, tree)
    dev = lambda tree: jax.tree.map(lambda _: P(ALL), tree)
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)
    held = (stage(params), stage(opt_state), stage(pstate), dev(carry), rep(counters))
    in_specs = held + (jax.tree.map(lambda _: P(DP_AXES), batch), P())
    return in_specs, held + ((P(PIPE) if replicas else P(), P(), P(), P()),)


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """One trace of the program on one device: its traced values, made once by :func:`open_trace` and read by
    the tick functions beside the :class:`~.program.Program`."""

    t0: Any  # tick since the last (re)start
    base: Any  # global index of the first micro-batch since then
    n_fed: Any  # micro-batches fed by the end of this call
    me: Any  # this device's stage index
    replica: Any  # this device's data replica (pipe-major)
    sop: StageOps  # the stage's forward and backward
    wsp: Any  # ZB's split backward at the frontier (None: W recomputes)
    wfuse: Any  # the same split for a summing policy's whole B, its W added in place (or None)
    fplace: Any  # where the frontier lives in the stash slot (front_pack; None: slots of its own)
    mb_of: Callable  # micro-batch g of the call (or of the ring of recent ones)
    ctab: Any  # the stream's call table
    unit_tab: Any  # its unit table
    s_off: Any  # per chunk, its first stash slot
    s_cap: Any  # per chunk, its stash slots
    ring_f: Any  # the forward and backward rings of devices (ppermute pairs)
    ring_b: Any
    variants: Any = None  # per chunk, the forward of each compiled position (lanes_forward.forward_at)
    doubles: Any = None  # per chunk, Chimera's doubled forward of each position (paired streams)
    #: the messages a tick's lanes posted, moved in the tick's one exchange (``route.exchange``; filled and
    #: emptied while one tick is traced)
    outbox: list = dataclasses.field(default_factory=list)


def open_trace(prog: Program, params, opt_state, pstate, carry, counters, batch, feed):
    """This device's :class:`Trace` and its state ``(chunk_params, opt_states, policy_states, carry)`` (chunks
    as tuples): the stage analysed, the call's micro-batches placed, the split backward prepared."""
    sq = lambda tree: jax.tree.map(lambda leaf: leaf[0], tree)
    chunk_params, opt_states, policy_states, carry = sq(params), sq(opt_state), sq(pstate), sq(carry)
    if not prog.chunked:
        chunk_params, opt_states, policy_states = (chunk_params,), (opt_states,), (policy_states,)
    t0, base, n_fed = counters
    me = lax.axis_index(STAGE)
    replica = lax.axis_index(PIPE) * prog.mesh.shape[DATA] + lax.axis_index(DATA)
    first_w = prog.reduction.per_chunk(prog, None, chunk_params, ())[0][0][0]  # chunk 0's stage weights
    sop, avals = StageOps.build(
        prog.model, first_w, full(prog.x_aval, 0), jax.tree.map(lambda leaf: leaf[0], carry.ring)
    )
    if not prog.direct and len(avals) != len(carry.stash):
        raise RuntimeError(
            f"stage_fn's pullback stashes {len(avals)} residuals inside the program but "
            f"{len(carry.stash)} were allocated; stage_fn must trace the same way every time"
        )
    wsp, wfuse = _split_backwards(prog, sop, chunk_params, avals)
    places, carry = _frontier_places(prog, wsp, avals, carry)
    mb_of, carry = prog.routing.micro_batches(prog, base, n_fed, batch, carry)
    trace = Trace(
        t0=t0,
        base=base,
        n_fed=n_fed + prog.M * feed.astype(jnp.int32),
        me=me,
        replica=replica,
        sop=sop,
        wsp=wsp,
        wfuse=wfuse,
        fplace=places,
        mb_of=mb_of,
        ctab=jnp.asarray(prog.periodic.call_table(prog.M)),
        unit_tab=jnp.asarray(prog.unit_table),
        s_off=jnp.asarray(prog.stash_offsets[:-1], jnp.int32),
        s_cap=jnp.asarray(prog.stash_slots, jnp.int32),
        ring_f=[(d, (d + 1) % prog.D) for d in range(prog.D)],
        ring_b=[(d, (d - 1) % prog.D) for d in range(prog.D)],
    )
    variants, doubles = _stage_variants(prog, trace)
    trace = dataclasses.replace(trace, variants=variants, doubles=doubles)
    return trace, (chunk_params, opt_states, policy_states, carry)


def _split_backwards(prog: Program, sop, chunk_params, avals):
    """``(wsp, wfuse)``: the split backward W's lane reads from B's frontier (``prog.w_frontier``), or a
    summing policy's B in the same two parts, W's added into the sums in place (``lanes_backward.bwd``) where
    the stage scans its layers; None where neither applies (elsewhere the fused backward: nothing to gain).
    Chunk 0's first entry is read only where one applies: a ring policy's chunks hold no such entry."""
    split = lambda: split_backward(
        sop.backward, chunk_params[0][0], full(avals, 0), full(prog.x_aval, 0), avals
    )
    if prog.w_frontier:  # None where the stage cannot be split: W recomputes
        return split(), None
    if prog.split or not all(p.add_leaf is not None and p.sums is not None for p in prog.policies):
        return None, None
    wfuse = split()
    return None, (wfuse if wfuse is not None and wfuse.in_place else None)


def _frontier_places(prog: Program, wsp, avals, carry):
    """``(places, carry)``: where ZB's frontier lies in the residuals of its own stash slot that only B
    read (``front_pack``); where it does not fit or saves little, None and ``carry.front`` slots of its own
    (an idle B lane writes none), for this call only (own buffers: merged into one fill, XLA copied it into
    each; +224 MiB a leaf on GPT d1024 at D = 4)."""
    if wsp is None:
        return None, carry
    if not prog.direct:
        places = placed_in_stash(wsp, avals, prog.periodic.plan.front_capacity)
        if places is not None:
            return places, carry
    fill = jnp.nan if prog.nan_bubbles else 0
    slots = (max(prog.periodic.plan.front_capacity, 1),)
    return None, carry._replace(front=own_buffers(full(wsp.frontier_avals, fill, slots)))


def _stage_variants(prog: Program, trace):
    """``(variants, doubles)``: each chunk's forward at each position its plan uses (``forward_at``), and
    its paired double forward (``double_at``; None where the plan pairs none)."""
    positions = lambda c: [(bool(p & 1), bool(p & 2)) for p in prog.used_positions[c]]
    chunks = range(prog.num_chunks)
    variants = [[forward_at(prog, trace, *at) for at in positions(c)] for c in chunks]
    if not prog.paired:
        return variants, None
    return variants, [[double_at(prog, trace, *at) for at in positions(c)] for c in chunks]


def run_call(prog: Program, trace: Trace, state):
    """The call: the scans of its phases (landings and eager exchanges between them), then the metrics,
    the counters, and a gradient policy's reduction."""
    chunk_params, opt_states, policy_states, carry = state
    M, T = prog.M, prog.num_ticks
    loss0 = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))
    state = scan_phases(prog, trace, TickState(chunk_params, opt_states, policy_states, carry, loss0))
    chunk_params, opt_states, policy_states, carry, (lsum, lcount, lweight) = state
    carry = carry._replace(front=())
    loss, lcount, lweight, errors = prog.reduction.call_loss(prog, lsum, lcount, lweight, carry.errors)
    ex = lambda tree: jax.tree.map(lambda leaf: leaf[None], tree)
    q = trace.t0 // T
    done_tab = prog.done_table
    done = jnp.where(
        q < len(done_tab),
        jnp.asarray(done_tab)[jnp.minimum(q, len(done_tab) - 1)],
        M * q + prog.buffers["done_steady"],
    )
    done = jnp.clip(done, 0, trace.n_fed)  # every op of these micro-batches has run
    counters = (trace.t0 + T, trace.base, trace.n_fed)
    policy_states = prog.routing.head_grad_to_sums(
        prog, trace, chunk_params, opt_states, policy_states, carry
    )
    policy_states = prog.reduction.finish(prog, policy_states, lweight)
    if not prog.chunked:
        chunk_params, opt_states, policy_states = chunk_params[0], opt_states[0], policy_states[0]
    if prog.replicas:  # each pipeline's own loss
        loss = loss[None]
    return (
        ex(chunk_params),
        ex(opt_states),
        ex(policy_states),
        ex(carry),
        counters,
        (loss, lcount, trace.base + done, errors),
    )
