"""What the one executor knows before it traces: a frozen :class:`Program` -- the stream's tables and buffer
sizes, the chunks' weight policies, the activation's shapes, how losses are normalised -- and its
:class:`Modes`, each chosen once and named.  Built by :func:`describe`; read (never written) by the tick
functions (:mod:`.ticks`, :mod:`.lanes_forward`, :mod:`.lanes_backward`, :mod:`.ring`).

Nothing here asks a method's name or reads a method's options by key: the policies declare their modes
(:data:`jaxpipe.optim.policies.MODES`), the runner passes the schedule's choices as fields (``w_from``,
``eager_reduce``), and the stream (:class:`jaxpipe.schedules.periodic.Periodic`) says which lanes a tick has.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import numpy as np

from ..axes import DATA, DP_AXES, PIPE
from ..errors import ConfigError
from ..model import microbatch_key
from ..optim.policies import check as check_policy
from ..schedules.lanes import L as _L
from ..schedules.layout import ROUTE_COLUMNS, eager_points
from ..tying import Ties
from .landing import landing_points, landing_segments, ring_phases
from .reduction import RingReduction, SumAfterCall, UpdateEach
from .routing import PlanSlots, Registers


class PhaseLanes(NamedTuple):
    """A lane plan's phase as its scan compiles it: the lanes some device uses there, and those busy on every
    device in every tick (run without a conditional: a plan's stream of one call is always fed, so the table
    says exactly which ops run)."""

    used: frozenset
    full: frozenset


@dataclasses.dataclass(frozen=True)
class Modes:
    """How the program runs, decided once from the policies' declarations and the stream.

    ``routing``: ``"slots"`` -- a lane plan's stream of one call: messages and residuals in the slots the plan
    allocated (:mod:`jaxpipe.schedules.lanes`); ``"registers"`` -- a periodic stream: one register per
    direction, consumed the tick after it was sent (and wrap-around buffers between chunks).
    ``gradients``: ``"sum"`` -- the policies only sum local gradients in place, reduced over the data replicas
    once after the call (a flushing schedule's gradient); ``"update"`` -- a backward's gradient, reduced over
    the replicas, feeds its chunk's update; ``"ring"`` -- Cyclic DP's ring over the data workers
    (:mod:`.reduction`).
    ``landing``: ``"none"``, ``"in_scan"`` or ``"call_end"`` (accumulating policies).  ``reads``: ``"branch"``
    --
    one branch per stored version (and chunk); ``"computed"`` -- the policy computes the version an op reads.
    ``w_lane``: ``"none"``, or ZB's weight-gradient lane computing W ``"frontier"`` (from the per-layer output
    gradients B keeps) or ``"recompute"`` (back-propagating through the stage again).  ``paired``: Chimera's
    doubled forward (an F2 lane).  ``counting``: (sum, count) losses whose counts travel with the
    gradients."""

    routing: str
    gradients: str
    landing: str
    reads: str
    w_lane: str
    paired: bool
    counting: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """The program's static description (see the module docstring); ``modes`` says how it runs."""

    model: Any
    D: int
    M: int
    mesh: Any
    policies: Tuple[Any, ...]
    chunked: bool  # a tuple of policies (one per chunk) was given: the state is per chunk
    periodic: Any
    modes: Modes
    routing: Any  # how messages and residuals move: PlanSlots or Registers (.routing), from modes.routing
    reduction: Any  # how gradients are reduced and applied: SumAfterCall, UpdateEach or RingReduction
    nan_bubbles: bool
    seed: int
    apc: bool
    broadcast: str
    replicas: bool
    unit_table: np.ndarray  # the stream's unit table
    reduce_axes: Tuple[str, ...]  # the axes gradients are reduced over
    num_replicas: int
    buffers: Dict[str, Any]  # the stream's buffer sizes (Periodic.buffers)
    x_aval: Any
    summed: bool  # the loss is a (sum, count) pair
    ties: Any
    tie_avals: Any
    num_ticks: int  # ticks per call
    segments: Tuple[Any, ...]  # the call's scans: (first tick, end tick, static flags)
    lands: Dict[int, Tuple[int, int]]  # chunk -> (lag, tick offset) of a between-scans landing
    stage_table: np.ndarray  # [chunk, device] -> model stage
    routes: Optional[np.ndarray]  # a lane plan's routing columns
    kinds: Tuple[str, ...]  # the lanes of a tick
    eager: Dict[int, Tuple[Tuple[int, int], ...]]  # tick -> Chimera's eager exchange pairs after it
    used_positions: Tuple[Tuple[int, ...], ...]  # per chunk, the positions (first/last codes) compiled
    remap: np.ndarray  # [chunk, position code] -> branch of the compiled positions
    done_table: np.ndarray

    # ---- derived readers
    num_chunks = property(lambda self: len(self.policies))
    ring_workers = property(lambda self: self.mesh.shape[DATA])  # ring workers
    ring_slots = property(lambda self: self.buffers["ring"])
    stash_slots = property(lambda self: self.buffers["stash"])
    stash_offsets = property(lambda self: np.concatenate([[0], np.cumsum(self.buffers["stash"])]))
    num_stages = property(lambda self: self.periodic.num_stages)
    lane_f2 = property(lambda self: self.kinds.index("F2") if "F2" in self.kinds else -1)
    ring = property(lambda self: self.modes.gradients == "ring")
    fused = property(lambda self: self.modes.gradients == "sum")
    by_branch = property(lambda self: self.modes.reads == "branch")
    in_scan = property(lambda self: self.modes.landing == "in_scan")
    split = property(lambda self: self.modes.w_lane != "none")
    w_frontier = property(lambda self: self.modes.w_lane == "frontier")
    paired = property(lambda self: self.modes.paired)
    counting = property(lambda self: self.modes.counting)
    # a lane plan whose F hands its residuals to the B of the same tick (D = 1): no stash slots
    direct = property(lambda self: self.periodic.plan is not None and self.periodic.plan.direct)

    def model_key(self, step, microbatch):
        """The stage context's key of micro-batch ``mb`` of step ``step`` (the synchronous schedules'
        keys)."""
        return microbatch_key(self.seed, step, microbatch)


def describe(
    model,
    policy,
    D: int,
    M: int,
    mesh,
    mb_example,
    *,
    periodic=None,
    nan_bubbles: bool = False,
    seed: int = 0,
    apc: bool = False,
    broadcast: str = "direct",
    replicas: bool = False,
    w_from: str = "frontier",
    eager_reduce: bool = False,
) -> Program:
    """The :class:`Program` of ``model`` under ``policy`` (one :class:`~jaxpipe.optim.policies.WeightPolicy`,
    or a tuple of one per chunk) on the stream ``periodic`` (default: the no-flush 1F1B)."""
    chunked = not hasattr(policy, "_fields")  # a WeightPolicy is a NamedTuple; chunks: a tuple of them
    policies = tuple(check_policy(p) for p in (policy if chunked else (policy,)))
    if periodic is None:
        from ..schedules.periodic import no_flush_1f1b

        periodic = no_flush_1f1b(policies[0].name, D)
    _check_policies(policies, periodic, mesh, D)
    ring = policies[0].reduction == "ring"
    n_dp = mesh.shape[PIPE] * mesh.shape[DATA]
    buf = periodic.buffers(M, periodic.replica_delay * (n_dp - 1))
    x_aval, y_aval = _activation_avals(model, mb_example)
    model.check_activation(x_aval, y_aval)
    summed = model.reduction(y_aval, mb_example) == "sum"
    ties = Ties(model)
    slots = periodic.plan is not None
    kinds = periodic.kinds  # the lanes of a tick: F, (F2,) B, (W); (F', B', W': a second lane of a kind)
    modes = _modes(policies, periodic, w_from, summed, ring)
    # replicas (AvgPipe's parallel pipelines): one set of weights per 'pipe' index, averaged over 'data' only
    T = periodic.call_ticks(M)
    eager = _eager(periodic, policies, eager_reduce and slots)
    segments, lands = _segments(periodic, M, D, policies, mesh, ring, eager)
    used_pos, remap = _positions(periodic, D, len(policies))
    return Program(
        model=model,
        D=D,
        M=M,
        mesh=mesh,
        policies=policies,
        chunked=chunked,
        periodic=periodic,
        modes=modes,
        routing=PlanSlots() if modes.routing == "slots" else Registers(),
        reduction=RingReduction() if ring else SumAfterCall() if modes.gradients == "sum" else UpdateEach(),
        nan_bubbles=nan_bubbles,
        seed=seed,
        apc=apc,
        broadcast=broadcast,
        replicas=replicas,
        unit_table=periodic.unit_table(M),
        reduce_axes=(DATA,) if replicas else DP_AXES,
        num_replicas=mesh.shape[DATA] if replicas else n_dp,
        buffers=buf,
        x_aval=x_aval,
        summed=summed,
        ties=ties,
        tie_avals=ties.pre_leaves(model.pre_params),
        num_ticks=T,
        segments=tuple(segments),
        lands=lands,
        stage_table=periodic.stage_table(),
        routes=_routes(periodic.plan) if slots else None,
        kinds=kinds,
        eager=eager,
        used_positions=used_pos,
        remap=remap,
        done_table=np.asarray(buf["done"], np.int32),
    )


def _modes(policies, periodic, w_from: str, summed: bool, ring: bool) -> Modes:
    """How the program runs (:class:`Modes`) for ``policies`` on ``periodic``'s stream.

    Raises:
        ConfigError: a lane plan's stream under a policy that does not return the call's gradient."""
    slots = periodic.plan is not None
    kinds = periodic.kinds
    modes = Modes(
        routing="slots" if slots else "registers",
        gradients="ring" if ring else "sum" if all(p.reduction == "sum" for p in policies) else "update",
        landing=policies[0].landing,
        reads="branch" if len(policies) > 1 or policies[0].reads == "stored" else "computed",
        w_lane=w_from if "W" in kinds else "none",
        paired="F2" in kinds,
        # (sum, count) losses: per-micro-batch updaters scale each micro-batch at the loss by replicas / its
        # global count; accumulating policies (2BW, CDP, WPipe) get unscaled sums, and each micro-batch's
        # global count travels back with dL/dy so that every stage divides its step's summed gradient by the
        # step's count (the ring reduction sums each micro-batch's count along the ring with its gradient)
        counting=summed and (ring or not policies[0].per_microbatch),
    )
    if slots and modes.gradients != "sum":
        raise ConfigError(
            "a lane plan's stream runs under a policy that returns the call's gradient ('gradient')"
        )
    return modes


def _routes(plan) -> np.ndarray:
    """A lane plan's routing columns (:data:`ROUTE_COLUMNS`; the frontier's, last, only where a W lane reads
    it)."""
    cols = ROUTE_COLUMNS if "W" in plan.lanes else ROUTE_COLUMNS[:-1]
    return np.asarray(plan.table[..., [_L[k] for k in cols]])


def _check_policies(policies, periodic, mesh, D) -> None:
    K = len(policies)
    if periodic.chunks != K:
        raise ConfigError(f"the timeline has {periodic.chunks} chunks per device, the policy {K}")
    if K > 1 and any(p.reads != "stored" or p.landing == "in_scan" for p in policies):
        raise ConfigError(
            "a timeline of several chunks runs policies that choose among stored versions and "
            "land between scans"
        )
    if len({p.per_microbatch for p in policies}) != 1:
        raise ConfigError("the chunks' policies must all update per micro-batch or all per batch")
    if policies[0].reduction == "ring" and (
        D != 1 or mesh.shape[PIPE] != 1 or any(p.reduction != "ring" for p in policies)
    ):
        raise ConfigError(
            "a ring reduction runs every stage on each worker of the 'data' axis (stage = pipe = 1)"
        )


def _eager(periodic, policies, eager_reduce: bool):
    """Chimera §3.2's eager gradient synchronisation: after these ticks some stages' replica gradients are
    final and go home between two scans (chunk 1 of the replica device -> chunk 0 of the owner)."""
    if not eager_reduce:
        return {}
    eager = dict(eager_points(periodic.plan.schedule, periodic.plan.where))
    if eager and (len(policies) != 2 or any(p.sums is None for p in policies)):
        raise ConfigError(
            "eager_reduce moves one chunk's gradient sums to another's: two chunks whose policies "
            "expose their sums"
        )
    return eager


def _segments(periodic, M, D, policies, mesh, ring, eager):
    """The scans of a call (tick ranges with their static flags) and where accumulating policies land."""
    T = periodic.call_ticks(M)
    in_scan = policies[0].landing == "in_scan"
    segments = landing_segments(periodic, M, D) if in_scan else [(0, T, False)]
    lands = {c: landing_points(periodic, M, c, p) for c, p in enumerate(policies) if p.landing == "call_end"}
    cuts = sorted({tau for _, tau in lands.values() if tau < T})
    if cuts:
        segments = [(a, b, False) for a, b in zip([0] + cuts, cuts + [T])]
    if ring:  # runs of ticks with the same (may land, may update): only those compile the broadcast
        segments = []
        for tau, f in enumerate(ring_phases(periodic, M, mesh.shape[DATA])):
            if segments and segments[-1][2] == f:
                segments[-1] = (segments[-1][0], tau + 1, f)
            else:
                segments.append((tau, tau + 1, f))
    if periodic.plan is not None:  # one scan per phase of the plan, compiling only the lanes some device uses
        # there (its cuts include the eager-reduction points); a lane idle on every device costs a conditional
        segments = [
            (a, b, PhaseLanes(frozenset(u), frozenset(f)))
            for (a, b, u), f in zip(periodic.plan.phases, periodic.plan.full)
        ]
        if not {b for _, b, _ in segments} >= set(eager):
            raise ConfigError(
                "the plan's phases must end at its eager-reduction points (schedules.lane_plan)"
            )
    return segments, lands


def _positions(periodic, D, num_chunks):
    """Chunk ``c`` of device ``d`` is first (pre) where it holds model stage 0, last (loss) where it holds the
    last; only the (chunk, position) pairs some device has are compiled."""
    stg, n_st = periodic.stage_table(), periodic.num_stages
    pos_of = lambda c, d: int(stg[c, d] == 0) + 2 * int(stg[c, d] == n_st - 1)
    used_pos = tuple(tuple(sorted({pos_of(c, d) for d in range(D)})) for c in range(num_chunks))
    remap = np.zeros((num_chunks, 4), np.int32)
    for c in range(num_chunks):
        remap[c, list(used_pos[c])] = np.arange(len(used_pos[c]))
    return used_pos, remap


def _activation_avals(model, mb_example):
    """A micro-batch's activation as the stages receive it and as the last one returns it (shapes only)."""
    w_example = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype), model.stage_params
    )
    x_aval = jax.eval_shape(model.pre, model.pre_params, mb_example)
    return x_aval, model.stage_output_aval(w_example, x_aval, mb_example)


def sums_losses(model, mb_example) -> bool:
    """Whether ``post_loss`` returns ``(sum, count)``: its gradients are divided by the counts, not by M."""
    return model.reduction(_activation_avals(model, mb_example)[1], mb_example) == "sum"
