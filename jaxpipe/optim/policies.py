"""Weight policies of the asynchronous 1F1B family (PipeOptim §II-C2, §III, Tables I-II; docs/design.md §4).

A policy wraps the user's optax optimizer and says which weights a micro-batch's forward (F) and backward
(B) read on a stage, and when updates land.  It works on one stage's *local* parameters
``lp = (w, pre, post)`` (the stage's weights plus this device's copies of the embedding and head, which only
stage 0 / stage D-1 use and train) and is pure: ``(init, forward_weights, backward_weights, update)``
with state as pytrees, like an optax ``GradientTransformation``.

Timeline (jaxpipe's lockstep no-flush 1F1B, ``jaxpipe.runtime.executor``, the no-flush executor): stage ``s``
runs F of micro-batch ``i`` at tick ``2i + s`` and its B at tick ``2i + 2D - 1 - s``.  Between them the stage
runs the B (and so the update) of micro-batches ``i-(D-1-s) .. i-1``: **D - 1 - s updates**.

- ``pipedream`` (weight stashing): one update per micro-batch; F stores the version it read in slot
  ``i mod D``; B reads it back.  Stage s holds up to D - s versions.
- ``pipedream_2bw`` (double-buffered weights, Narayanan et al. 2021): gradients accumulated over the M
  micro-batches of a step; batch b reads version b-1 in F and B; after its last B, version b+1 = version b
  + update(mean gradient): w(t+1) = w(t) - lr * grad f(w(t-1)).  Two versions; needs M >= D.
- ``pipeoptim``: one update per micro-batch; F reads w_hat = w + s_pred * u_last with ``u_last`` the last
  update the wrapped optimizer produced and ``s_pred = D - 1 - s`` (the updates between F and B above);
  B reads the current w.  For SGD-momentum, Adam and AdamW, u_last = -lr * Delta W of Table I (AdamW adds
  its decoupled decay term -lr * lambda * w, which Table I leaves out); tested in tests/test_policies.py.
- ``spectrain`` (Chen et al. 2018): the same prediction from the momentum step, in F *and* B, with the
  version distances of jaxpipe's timeline: both predict the version the stage will hold when the
  micro-batch's backward ends on stage 0 (tick 2i + 2D - 1): s_fwd = floor(s/2) + D - 1 - s,
  s_bwd = floor(s/2) (BUILD_NOTES.md has the derivation).  Needs a momentum buffer (optax ``trace``).
"""

from __future__ import annotations

import functools

from typing import Any, Callable, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from ..errors import ConfigError
from ..schedules.registry import METHODS


class WeightPolicy(NamedTuple):
    """``init(lp) -> ps``; ``forward_weights(lp, ps, i, s) -> (w_F, ps)``; ``backward_weights(lp, ps, i, s)
    -> w_B``; ``update(g, lp, opt_state, ps, i, s, count=None) -> (lp, opt_state, ps)`` (``count``: the
    micro-batch's global count of a (sum, count) loss, for the policies that accumulate a step).  ``i``:
    global micro-batch index, ``s``: the stage (traced ints).  ``versions(D)``: weight versions per stage
    (Table II).

    ``choose`` (optional): ``choose(lp, ps, i, s) -> (k, candidates)`` where the weights an op reads are
    one of a few stored versions (2BW's current and shadow copy): the executor then runs the op in one
    branch per candidate instead of materialising the chosen version (a select copies every weight)."""

    name: str
    init: Callable
    forward_weights: Callable
    backward_weights: Callable
    update: Callable
    versions: Callable[[int], List[int]]
    choose: Any = None
    per_microbatch: bool = True  # one update per micro-batch (False: a step's gradients accumulated)
    #: the state ``init`` makes is scratch: every slot a backward reads was written by that micro-batch's
    #: forward first (PipeDream's stash), so NaN mode (``nan_bubbles=True``) starts it as NaN
    scratch_state: bool = False
    #: accumulating policies: ``update`` only adds the micro-batch's gradient; ``land(lp, opt_state, ps,
    #: counting) -> (lp, opt_state, ps)`` applies the step's update after the B of micro-batch ``i`` where
    #: ``lands(i)``.  The executor runs it apart from ``update``, in the few ticks where some stage lands
    #: (a conditional holding the version swap made XLA copy the weights in every tick it was compiled in)
    land: Any = None
    lands: Any = None
    #: ``apply_pending(lp, ps) -> lp``: ``update`` left the weights as they were and put the update in the
    #: state (PipeOptim/SpecTrain keep it for their prediction); the executor adds it in a conditional of its
    #: own: one that wrote the weights and kept an update computed from them (AdamW's decay) made XLA copy
    #: the weights every tick (HLO-checked, BUILD_NOTES)
    apply_pending: Any = None
    #: ``forward_is_current(s)`` / ``backward_is_current(s)`` (optional, traced bool): the F / B of stage
    #: ``s`` reads the current weights (a prediction by distance 0: SpecTrain's B on its first stages,
    #: PipeOptim's F on the last).  The executor then runs that op on the weights themselves, in a branch of
    #: its own, instead of materialising ``w + 0 * u`` (a weight-sized axpy per micro-batch)
    forward_is_current: Any = None
    backward_is_current: Any = None
    #: accumulating policies: batch ``b`` reads version ``b - stale`` (2BW 1, WPipe's G1 0): the executor
    #: lands batch b's update after its last backward and before batch ``b + 1 + stale``'s first op, and
    #: checks that its timeline leaves room for that, with ``accumulators`` batches accumulating at once
    stale: int = 1
    accumulators: int = 1
    #: ``held(ps, i, s)`` (optional, traced bool): the version micro-batch ``i`` must read on stage ``s`` is
    #: one the policy holds; the executor counts the reads where it is not (metric ``version_errors``)
    held: Any = None
    #: ring reduction (Cyclic DP's workers on ``data``, each with every stage): ``apply_sum(g_sum, count, lp,
    #: opt_state, counting) -> (lp, opt_state)`` -- the last worker's update from the ring's complete sum,
    #: which the other workers land as it arrives; ``retire(lp, ps) -> ps`` -- the state once a new version
    #: replaces ``lp`` (the executor writes both into its stacked chunks in place)
    apply_sum: Any = None
    retire: Any = None
    #: ``finish(ps, reduce, count) -> ps`` (optional): the policy takes each micro-batch's *local* gradient
    #: in ``update`` and reduces once after the call (``reduce``: the sum ((sum, count) losses, ``count``: the
    #: call's global count) or mean over data replicas) -- a flushing schedule's gradient, returned not
    #: applied
    finish: Any = None
    #: ``(get(ps), put(ps, sums) -> ps)`` (optional): the stage's gradient sums in the state, for an exchange
    #: between chunks inside the call (Chimera's eager reduction)
    sums: Any = None
    #: ``add_leaf(sum, g) -> sum`` (optional, with ``sums``): what ``update`` does to each leaf of the stage's
    #: sums, elementwise; the executor may then add ZB's weight gradient into the sums layer by layer, in
    #: place (:meth:`jaxpipe.runtime.wsplit.BackwardSplit.weight_part_into`)
    add_leaf: Any = None
    #: --- the modes the executor runs the policy in, declared (checked against the hooks, :func:`check`) ---
    #: ``reduction``: ``"update"`` -- each micro-batch's gradient is reduced over the data replicas and
    #: handed to ``update``; ``"sum"`` -- ``update`` adds the local gradient to sums in the state and
    #: ``finish`` reduces them once after the call (a flushing schedule's gradient); ``"ring"`` -- Cyclic DP's
    #: ring reduction over the data workers (``apply_sum``, ``retire``)
    reduction: str = "update"
    #: ``reads``: ``"computed"`` -- ``forward_weights``/``backward_weights`` give the version an op reads;
    #: ``"stored"`` -- ``choose`` picks one of a few stored versions, run in one branch per candidate
    reads: str = "computed"
    #: ``landing``: ``"none"``; ``"in_scan"`` -- ``land`` after the B of the micro-batch where ``lands(i)``,
    #: inside the scan; ``"call_end"`` -- once after the call's scan, for the batch whose last B ran in it
    landing: str = "none"


#: each declared mode and the hooks it needs
MODES = {
    "reduction": {"update": (), "sum": ("finish",), "ring": ("apply_sum", "retire")},
    "reads": {"computed": (), "stored": ("choose",)},
    "landing": {"none": (), "in_scan": ("land", "lands"), "call_end": ("land", "lands")},
}


def per_count(a, count):
    """A (sum, count) loss's summed gradient over its count; where the count is 0 (every token masked) the sum
    is 0 too and so is the result -- the micro-batch contributes nothing instead of 0/0 = NaN."""
    n = count.astype(a.dtype)
    return a / jnp.where(n > 0, n, jnp.ones_like(n))


def check(policy: WeightPolicy) -> WeightPolicy:
    """``policy`` if every declared mode is known and has the hooks it needs; ConfigError naming them
    otherwise."""
    for field, modes in MODES.items():
        mode = getattr(policy, field)
        if mode not in modes:
            raise ConfigError(
                f"weight policy {policy.name!r}: {field}={mode!r}; choose one of {sorted(modes)}"
            )
        missing = [h for h in modes[mode] if getattr(policy, h) is None]
        if missing:
            raise ConfigError(f"weight policy {policy.name!r}: {field}={mode!r} needs the hooks {missing}")
    return policy


def _apply(opt, g, lp, opt_state):
    u, opt_state = opt.update(g, opt_state, lp)
    return optax.apply_updates(lp, u), opt_state, u


def _axpy(a, x, y):
    """y + a * x, with ``a`` a traced scalar."""
    return jax.tree.map(lambda xx, yy: yy + a.astype(yy.dtype) * xx, x, y)


def pipedream(opt: optax.GradientTransformation, num_stages: int) -> WeightPolicy:
    D = num_stages

    def init(lp):
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (D,) + a.shape).copy(), lp)

    def forward_weights(lp, stash, i, s):
        stash = jax.tree.map(lambda b, a: lax.dynamic_update_index_in_dim(b, a, i % D, 0), stash, lp)
        return lp, stash

    def backward_weights(lp, stash, i, s):
        return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, i % D, 0, False), stash)

    def update(g, lp, opt_state, stash, i, s, count=None):
        lp, opt_state, _ = _apply(opt, g, lp, opt_state)
        return lp, opt_state, stash

    return WeightPolicy(
        "pipedream",
        init,
        forward_weights,
        backward_weights,
        update,
        METHODS["pipedream"].weight_versions,
        scratch_state=True,
    )


class TwoBWState(NamedTuple):
    shadow: Any  # the previous version w(n - 1)
    acc: Any  # gradient sums ([K, ...] per leaf): batch b adds to acc[b % K] (K = 2: by parity)
    n_updates: jax.Array  # versions produced so far: lp holds w(n_updates)
    count: Any = None  # (sum, count) losses: [K] global counts, as acc (acc / count lands)


class _TwoVersionReads(NamedTuple):
    """Which of PipeDream-2BW's two versions micro-batch ``i`` reads on stage ``s``: ``lp`` holds
    w(n_updates), the shadow w(n_updates - 1).  Batch b = i // M reads w(b - 1) (w(-1) = w(0)); with
    ``fresh`` (CDP-v2) w(b) where j + s >= D - 1."""

    M: int
    D: int
    fresh: bool

    def read_version(self, i, s):
        b = i // self.M
        return jnp.where(i % self.M + s >= self.D - 1, b, b - 1) if self.fresh else b - 1

    def latest(self, ps, i, s):
        v = self.read_version(i, s)
        return (ps.n_updates == v) | ((v < 0) & (ps.n_updates == 0))

    def version(self, lp, ps, i, s):
        now = self.latest(ps, i, s)
        return jax.tree.map(lambda a, sh: jnp.where(now, a, sh), lp, ps.shadow)

    def forward_weights(self, lp, ps, i, s):
        return self.version(lp, ps, i, s), ps

    def choose(self, lp, ps, i, s):
        return jnp.where(self.latest(ps, i, s), 0, 1), (lp, ps.shadow)

    def held(self, ps, i, s):
        return self.latest(ps, i, s) | (ps.n_updates - 1 == self.read_version(i, s))


def pipedream_2bw(
    opt: optax.GradientTransformation,
    num_stages: int,
    num_microbatches: int,
    fresh: bool = False,
    name: str = "pipedream_2bw",
    accumulators: int = None,
) -> WeightPolicy:
    """PipeDream-2BW's rule; ``fresh=True`` is Cyclic Data Parallelism's CDP-v2 in pipeline form (Fournier &
    Oyallon, §3.2, eq. (CDP-v2)): micro-batch j of batch b reads on stage s the freshest version present
    when its forward reaches the stage -- w(b) once the update of batch b-1 has landed there, which in this
    timeline (F at tick 2(bM+j)+s, that update at 2(bM-1)+2D-1-s) is exactly when j + s >= D - 1 -- and its
    backward reads the same version.  With M = D this is the paper's rule: micro-batch i (1-based) uses the
    fresh parameters on its last i stages.  Same two versions as 2BW (CDP-v1 is 2BW's rule)."""
    M = num_microbatches
    reads = _TwoVersionReads(M, num_stages, fresh)

    # land at the end of the call (2BW, CDP-v1) -> two accumulators by batch parity (a call runs the last
    # backwards of batch b - 1 and the first of batch b); in the scan (CDP-v2) -> one, zeroed as it lands
    K = accumulators or (1 if fresh else 2)

    def init(lp):
        return TwoBWState(
            jax.tree.map(jnp.copy, lp),
            jax.tree.map(lambda a: jnp.zeros((K,) + a.shape, a.dtype), lp),
            jnp.zeros((), jnp.int32),
            jnp.zeros((K,), jnp.float32),
        )

    def update(g, lp, opt_state, ps, i, s, count=None):
        # count: this micro-batch's global token/example count when post_loss returns (sum, count) -- ``g`` is
        # then the gradient of the sum, and the batch's update is the summed gradient over the batch's count.
        p = (i // M) % K
        acc = jax.tree.map(lambda a, x: a.at[p].add(x.astype(a.dtype)), ps.acc, g)
        n = ps.count.at[p].add(0.0 if count is None else count)
        return lp, opt_state, ps._replace(acc=acc, count=n)

    def land(lp, opt_state, ps, counting=False, b=0):
        # batch b's gradient is complete: w(n+1) = w(n) + update(mean gradient of batch b, read on w(n-1))
        p = b % K
        acc = jax.tree.map(lambda a: a[p], ps.acc)
        div = (lambda a: per_count(a, ps.count[p])) if counting else (lambda a: a / M)
        new, opt_state, _ = _apply(opt, jax.tree.map(div, acc), lp, opt_state)
        return (
            new,
            opt_state,
            TwoBWState(
                lp, jax.tree.map(lambda a: a.at[p].set(0), ps.acc), ps.n_updates + 1, ps.count.at[p].set(0.0)
            ),
        )

    # 2BW / CDP-v1: w(b + 1), made from batch b's gradient, is first read by batch b + 2, so the landing may
    # wait for the end of the call that completes batch b (no conditional inside the scan); CDP-v2's fresh
    # reads need it at the tick of batch b's last backward
    return WeightPolicy(
        name,
        init,
        reads.forward_weights,
        reads.version,
        update,
        lambda D: [2] * D,
        reads.choose,
        per_microbatch=False,
        land=land,
        lands=lambda i: i % M == M - 1,
        landing="in_scan" if fresh else "call_end",
        reads="stored",
        stale=1,
        accumulators=K,
        held=reads.held,
    )


class AccumState(NamedTuple):
    acc: Any  # the batch's gradient sum
    n_updates: jax.Array  # versions produced so far: lp holds w(n_updates)
    count: Any  # (sum, count) losses: the batch's global count


class LeafAdd(NamedTuple):
    """One leaf of the summing policies' add, ``sum + addend(g)``: ``g`` in the sum's dtype, divided by
    ``divisor`` (a mean loss's M) where there is one.  A policy's ``add_leaf`` of this form lets the executor
    add a weight gradient into a slice of a stacked sum as one in-place scatter-add of :meth:`addend`
    (:func:`jaxpipe.runtime.wsplit.add_into_slice`): the same float additions, without the copy of the slice
    that XLA CPU makes to read it."""

    divisor: Optional[float] = None

    def addend(self, g, dtype):
        """What is added to a sum of ``dtype`` for the gradient ``g``."""
        g = g.astype(dtype)
        return g if self.divisor is None else g / self.divisor

    def __call__(self, u, v):
        return u + self.addend(v, u.dtype)


def _add_to_sums(g, lp, opt_state, ps, i, s, count=None, divisor=None):
    """``update`` of the one-version summing policies (``accumulate``, ``gradient``): the micro-batch's
    gradient (and count) added to the sums; a part of ``g`` that is None adds nothing (ZB's B adds pre's
    gradient, its W the stage's).  ``divisor`` (a mean loss's M; never a (sum, count) loss's, whose W adds
    without its count): each gradient is divided as it is added, in the add's own pass -- the plain step's
    ``acc + g / M``; divided after the call, the sums cost one more read and write of the whole gradient
    (1.32x the plain step's bytes at D = 1)."""
    add = LeafAdd(divisor)
    acc = tuple(a if x is None else jax.tree.map(add, a, x) for a, x in zip(ps.acc, g))
    return lp, opt_state, ps._replace(acc=acc, count=ps.count + (0.0 if count is None else count))


def accumulate(
    opt: optax.GradientTransformation, num_microbatches: int, name: str = "accumulate"
) -> WeightPolicy:
    """One version, as data parallelism: batch b reads w(b) in F and B; its mean gradient lands before batch
    b + 1's first op (WPipe's G1, eq. (1) with i = 1)."""
    M = num_microbatches

    def init(lp):
        return AccumState(
            jax.tree.map(jnp.zeros_like, lp), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
        )

    def land(lp, opt_state, ps, counting=False, b=0):
        div = (lambda a: per_count(a, ps.count)) if counting else (lambda a: a / M)
        new, opt_state, _ = _apply(opt, jax.tree.map(div, ps.acc), lp, opt_state)
        return (
            new,
            opt_state,
            AccumState(jax.tree.map(jnp.zeros_like, ps.acc), ps.n_updates + 1, jnp.zeros((), jnp.float32)),
        )

    return WeightPolicy(
        name,
        init,
        lambda lp, ps, i, s: (lp, ps),
        lambda lp, ps, i, s: lp,
        _add_to_sums,
        lambda D: [1] * D,
        choose=lambda lp, ps, i, s: (jnp.zeros((), jnp.int32), (lp,)),
        per_microbatch=False,
        land=land,
        lands=lambda i: i % M == M - 1,
        landing="call_end",
        reads="stored",
        stale=0,
        accumulators=1,
        held=lambda ps, i, s: ps.n_updates == i // M,
    )


def gradient(num_microbatches: int, name: str = "gradient", divide: bool = True) -> WeightPolicy:
    """No update inside the pipeline: the step's gradient, summed over its micro-batches in the policy state
    (one version: every op reads the weights it was given) and reduced over the data replicas once, after the
    call (``finish``): a flushing schedule (GPipe, 1F1B, interleaved 1F1B) run as a stream of one call, whose
    runner applies the optimizer to the gradient it returns.  ``divide=True``: each micro-batch's gradient is
    divided by M as it is added (a mean loss; the executor passes False for a (sum, count) loss).
    ``divide=False``: the sums over the micro-batches come back undivided (the runner divides where the
    division fuses into the update); a (sum, count) loss's sums are divided by their count after the call."""
    M = num_microbatches

    def init(lp):  # float32 sums at least (bf16 parameters: the runner casts the gradient back)
        acc = jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.promote_types(a.dtype, jnp.float32)), lp)
        return AccumState(acc, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def finish(ps, reduce, count=None):  # a mean loss's sums were divided as they were added
        if count is not None and divide:
            raise ValueError("gradient(divide=True) divides by M as it adds: not for a (sum, count) loss")
        div = (lambda a: per_count(a, count)) if count is not None else None
        return ps._replace(acc=reduce(ps.acc) if div is None else jax.tree.map(div, reduce(ps.acc)))

    divisor = M if divide else None
    add = functools.partial(_add_to_sums, divisor=divisor)
    return WeightPolicy(
        name,
        init,
        lambda lp, ps, i, s: (lp, ps),
        lambda lp, ps, i, s: lp,
        add,
        lambda D: [1] * D,
        choose=lambda lp, ps, i, s: (jnp.zeros((), jnp.int32), (lp,)),
        per_microbatch=False,
        stale=0,
        accumulators=1,
        finish=finish,
        reduction="sum",
        reads="stored",
        add_leaf=LeafAdd(divisor),
        sums=(lambda ps: ps.acc[0], lambda ps, v: ps._replace(acc=(v,) + tuple(ps.acc[1:]))),
    )


class CyclicState(NamedTuple):
    shadow: Any  # the version the current one replaced
    n_updates: jax.Array  # versions produced so far: lp holds w(n_updates)


def cyclic_dp(
    opt: optax.GradientTransformation, num_workers: int, stage: int, rule: str = "v2"
) -> WeightPolicy:
    """Cyclic Data Parallelism's DP form (Fournier & Oyallon §3.2, eqs. CDP-v1/v2) for one stage of a worker's
    replica: worker ``w``'s micro-batch of step ``k`` (``i = k``: one per worker and step) reads the stage at
    version ``k - 1`` (v1), or ``k`` where ``stage >= N - 1 - w`` (v2: the update of step k - 1 has arrived);
    two versions.  The workers are the mesh's ``data`` axis; the ring's complete sum is the last worker's
    update (``apply_sum``), which the others land (``receive``)."""
    from ..axes import DATA

    N, j = num_workers, stage

    def version(i):
        v = i - 1 if rule == "v1" else jnp.where(j >= N - 1 - lax.axis_index(DATA), i, i - 1)
        return jnp.maximum(v, 0)

    def init(lp):
        return CyclicState(jax.tree.map(jnp.copy, lp), jnp.zeros((), jnp.int32))

    def choose(lp, ps, i, s):
        return jnp.where(ps.n_updates == version(i), 0, 1), (lp, ps.shadow)

    def weights(lp, ps, i, s):
        return jax.tree.map(lambda a, b: jnp.where(ps.n_updates == version(i), a, b), lp, ps.shadow)

    def apply_sum(g_sum, count, lp, opt_state, counting=False):
        g = jax.tree.map(lambda a: per_count(a, count) if counting else a / N, g_sum)
        new, opt_state, _ = _apply(opt, g, lp, opt_state)
        return new, opt_state

    def retire(lp, ps):
        """What the state keeps when a new version replaces ``lp``: it, as the shadow."""
        return CyclicState(lp, ps.n_updates + 1)

    def unused(*a, **k):
        raise RuntimeError("cyclic_dp's updates come from the ring's sum (apply_sum), not per micro-batch")

    return WeightPolicy(
        f"cdp_dp_{rule}",
        init,
        lambda lp, ps, i, s: (weights(lp, ps, i, s), ps),
        weights,
        unused,
        lambda D: [2] * D,
        choose=choose,
        per_microbatch=False,
        held=lambda ps, i, s: (ps.n_updates == version(i)) | (ps.n_updates - 1 == version(i)),
        apply_sum=apply_sum,
        retire=retire,
        reduction="ring",
        reads="stored",
    )


def wpipe(opt: optax.GradientTransformation, num_stages: int, num_microbatches: int):
    """WPipe's 2GW (§3.2, eq. (1)): per chunk of a device, G0 with one delay (2BW's rule: batch b reads
    w(b - 1), two versions) and G1 without (one version, as data parallelism)."""
    return (
        pipedream_2bw(opt, num_stages, num_microbatches, name="wpipe_g0", accumulators=1),
        accumulate(opt, num_microbatches, name="wpipe_g1"),
    )


class Prediction(NamedTuple):
    """PipeOptim's state with ``prediction="decay_free"``: the update to apply and the direction to predict
    with (the same update computed without its parameter terms: Table I's AdamW, no decoupled decay)."""

    pending: Any
    direction: Any


def _predicting(
    name: str, opt, fwd_distance: Callable, bwd_distance: Callable, versions, decay_free: bool = False
) -> WeightPolicy:
    """Weight prediction w_hat = w + s * u_last (u_last: the last update the wrapped optimizer applied;
    ``decay_free``: that update recomputed with zero parameters, which drops parameter-proportional terms such
    as AdamW's decoupled decay -- PipeOptim Table I's form; same moments, the state not advanced twice)."""
    direction = (lambda ps: ps.direction) if decay_free else (lambda ps: ps)
    pending = (lambda ps: ps.pending) if decay_free else (lambda ps: ps)

    def init(lp):
        z = jax.tree.map(jnp.zeros_like, lp)
        return Prediction(z, jax.tree.map(jnp.zeros_like, lp)) if decay_free else z

    def forward_weights(lp, ps, i, s):
        return _axpy(fwd_distance(s), direction(ps), lp), ps

    def backward_weights(lp, ps, i, s):
        if bwd_distance is None:  # B reads the current weights (PipeOptim): no weight-sized axpy by 0
            return lp
        return _axpy(bwd_distance(s), direction(ps), lp)

    def update(g, lp, opt_state, ps, i, s, count=None):
        # the new update is the state; it lands on the weights in ``apply_pending`` (see WeightPolicy)
        u, new_state = opt.update(g, opt_state, lp)
        if decay_free:
            d, _ = opt.update(g, opt_state, jax.tree.map(jnp.zeros_like, lp))
            return lp, new_state, Prediction(u, d)
        return lp, new_state, u

    zero = lambda dist: None if dist is None else (lambda s: dist(s) == 0)
    return WeightPolicy(
        name,
        init,
        forward_weights,
        backward_weights,
        update,
        versions,
        apply_pending=lambda lp, ps: optax.apply_updates(lp, pending(ps)),
        forward_is_current=zero(fwd_distance),
        backward_is_current=zero(bwd_distance),
    )


def pipeoptim_distance(num_stages: int, distance: str = "paper") -> Callable:
    """PipeOptim's version difference s of stage ``rank``: ``"paper"``, eq. (4), s = D - rank - 1 (the
    updates jaxpipe's timeline applies between a micro-batch's F and its B: the last stage predicts nothing);
    ``"code"``, the authors' public code, s = D - rank (every stage predicts, the last one update ahead)."""
    D = num_stages
    return (lambda s: D - s) if distance == "code" else (lambda s: D - 1 - s)


def spectrain_distances(num_stages: int):
    D = num_stages
    return (lambda s: s // 2 + D - 1 - s), (lambda s: s // 2)


PIPEOPTIM_OPTIONS = {"distance": ("paper", "code"), "prediction": ("update", "decay_free")}


def pipeoptim(
    opt: optax.GradientTransformation, num_stages: int, distance: str = "paper", prediction: str = "update"
) -> WeightPolicy:
    """``distance``: see :func:`pipeoptim_distance`; ``prediction``: ``"update"`` (the last update the
    optimizer applied, decay included: optimizer-agnostic) or ``"decay_free"`` (Table I's AdamW form)."""
    for key, value in (("distance", distance), ("prediction", prediction)):
        if value not in PIPEOPTIM_OPTIONS[key]:
            raise ConfigError(
                f"pipeoptim option {key}={value!r}: choose one of {PIPEOPTIM_OPTIONS[key]} "
                f"(PipeOptim eq. (4) / the authors' code; Table I's AdamW without decay)"
            )

    def versions(n):  # Table II: w and u_last where a stage predicts, one more when the direction is apart
        v = [2] * n if distance == "code" else list(METHODS["pipeoptim"].weight_versions(n))
        return [x + 1 if x > 1 else x for x in v] if prediction == "decay_free" else v

    # B reads the current weights (distance None: lp itself)
    return _predicting(
        "pipeoptim",
        opt,
        pipeoptim_distance(num_stages, distance),
        None,
        versions,
        decay_free=prediction == "decay_free",
    )


def has_momentum(opt_state) -> bool:
    return any(
        isinstance(x, optax.TraceState)
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.TraceState))
    )


def spectrain(opt: optax.GradientTransformation, num_stages: int, opt_state_example=None) -> WeightPolicy:
    if opt_state_example is not None and not has_momentum(opt_state_example):
        raise ConfigError(
            "spectrain predicts future weights from the SGD-momentum buffer (SpecTrain, Chen et al. 2018; "
            "PipeOptim Table II: it works only with SGDM), and this optimizer's state has no momentum trace "
            "(optax.TraceState). Use optax.sgd(lr, momentum=0.9), or schedule='pipeoptim', which predicts "
            "from whatever update rule the optimizer has."
        )
    f, b = spectrain_distances(num_stages)
    return _predicting("spectrain", opt, f, b, METHODS["spectrain"].weight_versions)


def _two_versions(name: str, fresh: bool):
    def make(opt, D: int, M: int, opt_state_example=None) -> WeightPolicy:
        if M < D:
            raise ConfigError(
                f"{name} needs num_microbatches >= num_stages (got M={M}, D={D}): a step's micro-batches "
                "must "
                "cover the pipeline so that only two weight versions are ever in flight (PipeDream-2BW "
                "§3.1, "
                f"m >= d; CDP uses M = D). Use num_microbatches={D} or more."
            )
        return pipedream_2bw(opt, D, M, fresh=fresh, name=name)

    return make


#: weight policy name (a registry entry's ``policy``) -> ``make(opt, D, M, opt_state_example)``
POLICIES = {
    "pipedream": lambda opt, D, M, ex=None: pipedream(opt, D),
    "pipedream_2bw": _two_versions("pipedream_2bw", False),
    "cdp_v1": _two_versions("cdp_v1", False),  # CDP-v1 is 2BW's rule
    "cdp_v2": _two_versions("cdp_v2", True),
    "pipeoptim": lambda opt, D, M, ex=None, **o: pipeoptim(opt, D, **o),
    "spectrain": lambda opt, D, M, ex=None: spectrain(opt, D, ex),
    "wpipe": lambda opt, D, M, ex=None: wpipe(opt, D, M),
}


def make_policy(name: str, opt, num_stages: int, num_microbatches: int, opt_state_example=None, options=None):
    """``options``: the method's policy options (its registry entry's ``policy_keys``), as keywords.  A
    :class:`WeightPolicy`, or a tuple of one per model chunk of a device (WPipe's two groups)."""
    if name not in POLICIES:
        raise ConfigError(f"unknown weight policy {name!r}; available: {', '.join(POLICIES)}")
    return POLICIES[name](opt, num_stages, num_microbatches, opt_state_example, **(options or {}))
