"""A flushing schedule's gradient on the one executor (:mod:`.executor`): its lane plan as a stream of one
call (:func:`jaxpipe.schedules.periodic.one_call`), every chunk under the ``gradient`` policy (the
micro-batches' gradients summed, reduced over the data replicas after the call), nothing carried between
calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..axes import PIPE, STAGE, manual, pipeline_devices
from ..optim.policies import gradient
from .executor import ALL, make_stream_program
from .program import sums_losses
from .inflight import empty_carry
from .stage import stage_residuals
from .buffers import host_zeros
from . import chunk_state


def make_stream_grad_fn(
    model,
    periodic,
    mesh,
    mb_example,
    M: int,
    *,
    nan_bubbles: bool = False,
    seed: int = 0,
    perms=None,
    replicas: bool = False,
    w_from: str = "frontier",
    eager_reduce: bool = False,
    double_batch: bool = False,
    divide: bool = True,
) -> "StreamGradient":
    """``fn(stage_p, pre_p, post_p, batch, step) -> (loss, (g_stage, g_pre, g_post))`` with ``stage_p`` in the
    executor's layout (leading axis ``D * chunks``, device-major: index ``d K + c`` holds model stage
    ``soc[d, c]``, :func:`.common.layout_index`), or each leaf as :class:`~.chunk_state.Chunks` (K arrays
    ``[D, ...]``, what the runner's state holds: the gradient comes back the same way, nothing sliced or
    stacked); parameters and gradients without tied copies (a tied array's gradient comes back summed into
    ``pre``'s).  ``step``: the step index (a context model's keys are
    ``model.microbatch_key(seed, step, replica * M + j)``).  ``perms`` (:func:`.common.exchange_perms`,
    Chimera): ``stage_p`` is in the model's order, one stage per device; chunk ``c`` is fetched with one
    ``ppermute`` and its gradient goes home the same way, summed with the owner's (no gather of every stage).
    ``replicas`` (AvgPipe's parallel pipelines): every parameter and gradient has a leading axis of one
    replica per ``pipe`` index, each pipeline trains its own (averaged over ``data`` only), the loss is per
    replica.  ``fn.divisor``: what the caller divides the gradients by (None: divided here)."""
    divides = _divides_here(model, divide, replicas)
    per_add = divides and not sums_losses(model, mb_example)  # (sum, count) losses divide after
    policies = tuple(gradient(M, divide=per_add) for _ in range(periodic.chunks))
    run, x_aval = make_stream_program(
        model,
        policies if periodic.chunks > 1 else policies[0],
        None,
        periodic.num_devices,
        M,
        mesh,
        mb_example,
        nan_bubbles=nan_bubbles,
        periodic=periodic,
        seed=seed,
        replicas=replicas,
        w_from=w_from,
        eager_reduce=eager_reduce,
    )
    if double_batch:
        check_double_batch(model, periodic.plan, x_aval, mb_example)
    grad = StreamGradient(
        model, periodic, mesh, mb_example, M, policies, run, x_aval, nan_bubbles, perms, replicas
    )
    grad.divisor = None if divides or run.counting else M
    return grad


class StreamGradient:
    """The gradient function :func:`make_stream_grad_fn` returns: one call of the stream program with every
    chunk under the ``gradient`` policy, its sums taken back to the caller's layout."""

    divisor = None

    def __init__(
        self, model, periodic, mesh, mb_example, M, policies, run, x_aval, nan_bubbles, perms, replicas
    ):
        self.model, self.periodic, self.mesh, self.mb_example, self.M = model, periodic, mesh, mb_example, M
        self.D, self.K = periodic.num_devices, periodic.chunks
        self.policies, self.run, self.x_aval = policies, run, x_aval
        self.nan_bubbles, self.perms, self.replicas = nan_bubbles, perms, replicas
        w0 = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype), model.stage_params
        )
        self.res_avals = stage_residuals(model, host_zeros(w0), host_zeros(x_aval), host_zeros(mb_example))[1]
        self.on_stage = NamedSharding(mesh, P(STAGE))

    def __call__(self, stage_p, pre_p, post_p, batch, step):
        if self.replicas:
            return self._replicated(stage_p, pre_p, post_p, batch, step)
        loss, (g_w, g_pre, g_post) = self._one_call(stage_p, pre_p, post_p, batch, step)
        return loss, (_like(g_w, stage_p), _like(g_pre, pre_p), _like(g_post, post_p))

    def _replicated(self, stage_p, pre_p, post_p, batch, step):
        """AvgPipe: pipeline r's stage s at ``r D + s``, the executor's parameter layout over (pipe, stage);
        pre/post one copy per device, their gradients summed over the pipeline's devices here."""
        R, D = self.mesh.shape[PIPE], self.D
        on_own = NamedSharding(self.mesh, P((PIPE, STAGE)))
        flat = lambda tree: jax.tree.map(
            lambda leaf: jax.lax.with_sharding_constraint(
                leaf.reshape((R * leaf.shape[1],) + leaf.shape[2:]), on_own
            ),
            tree,
        )
        spread = lambda tree: flat(
            jax.tree.map(lambda leaf: jnp.broadcast_to(leaf[:, None], (R, D) + leaf.shape[1:]), tree)
        )
        loss, (g_w, g_pre, g_post) = self._one_call(flat(stage_p), spread(pre_p), spread(post_p), batch, step)
        back = lambda g: jax.tree.map(lambda leaf: leaf.reshape((R, D) + leaf.shape[1:]), g)
        sums = lambda g: jax.tree.map(lambda leaf: leaf.sum(1), back(g))
        return loss, (_like(back(g_w), stage_p), _like(sums(g_pre), pre_p), _like(sums(g_post), post_p))

    def _pin(self, tree):
        return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, self.on_stage), tree)

    def _on_every_stage(self, tree):
        """pre/post's parameters, one copy per pipeline device (replicas: already so)."""
        if self.replicas:
            return tree
        return self._pin(jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (self.D,) + jnp.shape(leaf)), tree))

    def _permute(self, tree, pairs):
        return _permute(self.mesh, tree, pairs)

    def _one_call(self, stage_p, pre_p, post_p, batch, step):
        """``(loss, (g_stage, g_pre, g_post))`` of one call, gradients in the params' layout but not yet
        their dtypes (replicas: pre/post per device)."""
        D, K, M = self.D, self.K, self.M
        pre, post = self._on_every_stage(pre_p), self._on_every_stage(post_p)
        weights = _chunk_weights(stage_p, self.perms, D, K, self._pin, self._permute)
        chunks = tuple((w, pre, post) for w in weights)
        pstate = tuple(
            _apart(jax.vmap(p.init)(params), c) for c, (p, params) in enumerate(zip(self.policies, chunks))
        )
        carry = empty_carry(
            self.model,
            self.periodic,
            M,
            pipeline_devices(self.mesh),
            self.mb_example,
            self.x_aval,
            self.res_avals,
            self.nan_bubbles,
        )
        carry = jax.lax.with_sharding_constraint(carry, NamedSharding(self.mesh, P(ALL)))
        counters = (jnp.zeros((), jnp.int32), (step * M).astype(jnp.int32), jnp.zeros((), jnp.int32))
        one = (lambda tree: tree[0]) if K == 1 else (lambda tree: tree)
        _, _, policy_states, _, _, (loss, _, _, _) = self.run(
            one(chunks),
            one(tuple(() for _ in range(K))),
            one(pstate),
            carry,
            counters,
            batch,
            jnp.asarray(True),
        )
        policy_states = (policy_states,) if K == 1 else policy_states
        if self.perms is not None and any(pm is not None for pm in self.perms):
            # the replicas' gradients go home by collective-permute only once the loss metric's all-reduce is
            # done: independent, the two ran in different orders on different devices in XLA CPU's concurrent
            # thunk executor and deadlocked (once in a CI run: device 0 in the all-reduce, the others in the
            # permute; BUILD_NOTES, "The executor")
            loss, policy_states = jax.lax.optimization_barrier((loss, policy_states))
        held = chunk_state.holds_chunks(stage_p)
        g_w = _stage_gradient(policy_states, self.perms, D, self._pin, self._permute, held)
        total = (lambda leaf: leaf) if self.replicas else (lambda leaf: leaf.sum(0))
        summed = lambda part: jax.tree.map(
            lambda *g: sum(total(a) for a in g), *(ps.acc[part] for ps in policy_states)
        )
        return loss, (g_w, summed(1), summed(2))


def _like(grads, params):
    """Gradients in the parameters' dtypes."""
    return jax.tree.map(lambda leaf, p: leaf.astype(p.dtype), grads, params)


def _chunk_weights(stage_p, perms, D, K, pin, permute):
    """Each chunk's stage weights ``[D, ...]`` from the caller's layout: Chimera's replicas fetched from their
    owners (``perms``), the one chunk, the chunks as held (:class:`~.chunk_state.Chunks`: nothing sliced), or
    sliced out of a device-major stack ``[D * K, ...]``."""
    if perms is not None:
        return tuple(stage_p if pm is None else permute(stage_p, pm) for pm in perms)
    if K == 1:
        return (stage_p,)
    if chunk_state.holds_chunks(stage_p):
        return tuple(pin(chunk_state.chunk(stage_p, c)) for c in range(K))
    per_dev = jax.tree.map(lambda leaf: leaf.reshape((D, K) + leaf.shape[1:]), stage_p)
    return tuple(pin(jax.tree.map(lambda leaf: leaf[:, c], per_dev)) for c in range(K))


def _apart(pstate, c: int):
    """Chunk ``c``'s policy state (its zero gradient sums) built so that XLA cannot merge it with another
    chunk's: the K chunks' equal zero fills were one buffer, copied for each chunk after the first as the call
    took them apart (one chunk's stage bytes a step, BUILD_NOTES).  Each float leaf plus a zero XLA cannot
    fold (``c - c`` through an optimization barrier): the same +0 fill, one per chunk."""
    if c == 0:
        return pstate
    zero = jax.lax.optimization_barrier(jnp.float32(c)) - c
    return jax.tree.map(
        lambda leaf: leaf + zero.astype(leaf.dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf,
        pstate,
    )


def _divides_here(model, divide: bool, replicas: bool) -> bool:
    """``divide=False`` asks for the gradients as sums over the micro-batches, ``fn.divisor`` saying what the
    caller divides them by; they are divided here all the same for AvgPipe's replicas and for parameters
    stored below float32 (their gradients are cast before they leave), and (sum, count) losses divide by their
    counts."""
    low = any(jnp.promote_types(a.dtype, jnp.float32) != a.dtype for a in jax.tree.leaves(model.params))
    return divide or replicas or low


def _permute(mesh, t, pairs):
    """``t`` (leading axis over ``stage``) moved along ``pairs`` (one ``ppermute`` per leaf)."""
    spec = jax.tree.map(lambda _: P(STAGE), t)
    return jax.shard_map(
        lambda leaf: jax.tree.map(lambda x: jax.lax.ppermute(x, STAGE, pairs), leaf),
        mesh=mesh,
        in_specs=(spec,),
        out_specs=spec,
        **manual(mesh),
    )(t)


def _stage_gradient(policy_states, perms, D, pin, permute, held=False):
    """The stage weights' gradient in the caller's layout from the chunks' sums: each replica's home to its
    stage's owner, summed there (``perms``: Chimera), the one chunk's, the chunks' as they are (``held``: the
    parameters came as :class:`~.chunk_state.Chunks`), or the chunks interleaved device-major."""
    K = len(policy_states)
    if perms is not None:
        home = [
            ps.acc[0] if pm is None else permute(ps.acc[0], [(d, s_) for s_, d in pm])
            for ps, pm in zip(policy_states, perms)
        ]
        return jax.tree.map(lambda *g: sum(g), *home)
    if K == 1:
        return policy_states[0].acc[0]
    if held:
        return chunk_state.gather([ps.acc[0] for ps in policy_states])
    return pin(
        jax.tree.map(
            lambda *g: jnp.stack(g, 1).reshape((D * K,) + g[0].shape[1:]),
            *(ps.acc[0] for ps in policy_states),
        )
    )


def check_double_batch(model, plan, x_aval, mb_example):
    """Chimera's forward doubling as one double-size micro-batch computes what the paired forwards compute:
    a context-free model (a stage context is per micro-batch), activations and stashed residuals with the
    micro-batch's rows on their leading axis (the pair is split back there), and wherever F2 runs, F runs the
    same stage (the executor doubles only such pairs).  A ConfigError naming what is off otherwise."""
    from ..errors import ConfigError
    from ..schedules.lanes import F2, L
    from .residuals import residual_mask

    if F2 not in plan.lanes:
        raise ConfigError(
            "double_batch=True runs paired forwards as one: it needs Chimera with "
            "concat='forward_doubling' and placement='ordered' (the lanes placement runs forwards "
            "one per F lane beside the backwards, unpaired)"
        )
    if model.context:
        raise ConfigError(
            "double_batch=True: this model takes a stage context (a key per micro-batch), which "
            "one forward of two micro-batches cannot reproduce; use double_batch=False (paired "
            "forwards, the same numbers)"
        )
    rows = {int(np.shape(a)[0]) for a in jax.tree.leaves(mb_example)}
    xs = {int(np.shape(a)[0]) if np.ndim(a) else -1 for a in jax.tree.leaves(x_aval)}
    w = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype), model.stage_params)
    x2 = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct((2 * leaf.shape[0],) + tuple(leaf.shape[1:]), leaf.dtype), x_aval
    )
    _, r1 = residual_mask(model.stage_fn, w, x_aval, None)
    _, r2 = residual_mask(model.stage_fn, w, x2, None)
    ok_res = len(r1) == len(r2) and all(
        tuple(b.shape) == (2 * a.shape[0],) + tuple(a.shape[1:]) for a, b in zip(r1, r2)
    )
    if len(rows) != 1 or xs != rows or not ok_res:
        raise ConfigError(
            f"double_batch=True concatenates two micro-batches along the leading axis: every "
            f"activation leaf and stashed residual must lead with the micro-batch's rows "
            f"(micro-batch rows {sorted(rows)}, activation leading sizes {sorted(xs)}, residuals "
            f"split {'ok' if ok_res else 'not along the rows'}); use double_batch=False"
        )
    la, lb = plan.lanes.index("F"), plan.lanes.index(F2)
    tab = plan.table
    both = tab[:, :, lb, L["op"]] > 0
    if np.any(
        both & ((tab[:, :, la, L["op"]] <= 0) | (tab[:, :, la, L["stage"]] != tab[:, :, lb, L["stage"]]))
    ):
        raise ConfigError("double_batch=True: the plan pairs forwards of different stages (executor bug)")


def make_grad_fn(
    model, sched, mesh, batch_example, *, nan_bubbles: bool = False, placement: str = "lanes", seed: int = 0
):
    """The gradient of a flushing schedule's step on the one executor:
    ``fn(stage_p, pre_p, post_p, batch, step) -> (loss, (g_stage, g_pre, g_post))`` with ``stage_p`` in the
    executor's layout (:func:`.common.layout_index`: leading axis ``D * chunks``, device-major) and no tied
    copies.  ``batch_example`` (arrays or ShapeDtypeStructs, global shapes) fixes the shapes.
    :class:`jaxpipe.Pipeline` (``loss_and_grad``, ``step``) is the usual way in; this is the program under
    it."""
    from ..axes import DATA
    from ..schedules.periodic import one_call
    from ..schedules.layout import lane_plan, stream_options

    M, n_dp = sched.M, mesh.shape[PIPE] * mesh.shape[DATA]
    mb = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct((leaf.shape[0] // (n_dp * M),) + tuple(leaf.shape[1:]), leaf.dtype),
        batch_example,
    )
    return make_stream_grad_fn(
        model,
        one_call(lane_plan(sched, placement)),
        mesh,
        mb,
        M,
        nan_bubbles=nan_bubbles,
        seed=seed,
        **stream_options(sched),
    )
