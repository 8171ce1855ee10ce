"""A flushing schedule's gradient on the one executor (:mod:`.async_executor`): its lane plan as a stream of one
call (:func:`jaxpipe.schedules.periodic.one_call`), every chunk under the ``gradient`` policy (the micro-batches'
gradients summed, reduced over the data replicas after the call), nothing carried between calls."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ..axes import PIPE, STAGE
from ..optim.policies import gradient
from .async_executor import ALL, make_async_fn
from .inflight import empty_carry
from .stage import stage_residuals
from .common import full


def make_stream_grad_fn(model, periodic, mesh, mb_example, M: int, *, nan_bubbles: bool = False, seed: int = 0,
                        perms=None, replicas: bool = False):
    """``fn(stage_p, pre_p, post_p, batch, step) -> (loss, (g_stage, g_pre, g_post))`` with ``stage_p`` in the
    executor's layout (leading axis ``D * chunks``, device-major: index ``d K + c`` holds model stage
    ``c D + d``), as the lane executor's ``make_grad_fn``; parameters and gradients without tied copies (a tied
    array's gradient comes back summed into ``pre``'s).  ``perms`` (:func:`.common.exchange_perms`, Chimera):
    ``stage_p`` is in the model's order, one stage per device; chunk ``c`` is fetched with one ``ppermute``
    and its gradient goes home the same way, summed with the owner's (no gather of every stage).
    ``replicas`` (AvgPipe's parallel pipelines): every parameter and gradient has a leading axis of one replica
    per ``pipe`` index, each pipeline trains its own (averaged over ``data`` only), the loss is per replica."""
    D, K = periodic.num_devices, periodic.chunks
    policies = tuple(gradient(M) for _ in range(K))
    run, x_aval = make_async_fn(model, policies if K > 1 else policies[0], None, D, M, mesh, mb_example,
                                nan_bubbles=nan_bubbles, periodic=periodic, seed=seed, replicas=replicas)
    w0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype), model.stage_params)
    _, res_avals = stage_residuals(model, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), w0), full(x_aval, 0),
                                   jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), mb_example))
    n_dev = mesh.size
    on_stage = NamedSharding(mesh, P(STAGE))
    on_own = NamedSharding(mesh, P((PIPE, STAGE)))

    def permute(t, pairs):
        spec = jax.tree.map(lambda _: P(STAGE), t)
        return jax.shard_map(lambda a: jax.tree.map(lambda x: jax.lax.ppermute(x, STAGE, pairs), a), mesh=mesh,
                             in_specs=(spec,), out_specs=spec)(t)

    def fn(stage_p, pre_p, post_p, batch, step):
        if replicas:     # pipeline r's stage s at r D + s: the executor's parameter layout over (pipe, stage)
            R = mesh.shape[PIPE]
            flat = lambda t: jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
                a.reshape((R * a.shape[1],) + a.shape[2:]), on_own), t)
            spread = lambda t: flat(jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (R, D) + a.shape[1:]), t))
            loss, (g_w, g_pre, g_post) = one_call(flat(stage_p), spread(pre_p), spread(post_p), batch, step)
            back = lambda g: jax.tree.map(lambda a: a.reshape((R, D) + a.shape[1:]), g)
            sums = lambda g: jax.tree.map(lambda a: a.sum(1), back(g))
            like = lambda g, q: jax.tree.map(lambda a, b: a.astype(b.dtype), g, q)
            return loss, (like(back(g_w), stage_p), like(sums(g_pre), pre_p), like(sums(g_post), post_p))
        return one_call(stage_p, pre_p, post_p, batch, step)

    def one_call(stage_p, pre_p, post_p, batch, step):
        """Replicas: the parameters as the executor holds them (pre/post one copy per device), the
        gradients too (pre/post per device, summed by the caller)."""
        bcast = (lambda t: t) if replicas else (lambda t: jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
            jnp.broadcast_to(a, (D,) + jnp.shape(a)), on_stage), t))
        pin = lambda t: jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, on_stage), t)
        if perms is not None:
            chunks = tuple((stage_p if pm is None else permute(stage_p, pm), bcast(pre_p), bcast(post_p))
                           for pm in perms)
        elif K == 1:
            chunks = ((stage_p, bcast(pre_p), bcast(post_p)),)
        else:
            per_dev = jax.tree.map(lambda a: a.reshape((D, K) + a.shape[1:]), stage_p)
            chunks = tuple((pin(jax.tree.map(lambda a: a[:, c], per_dev)), bcast(pre_p), bcast(post_p))
                           for c in range(K))
        pstate = tuple(jax.vmap(p.init)(lp) for p, lp in zip(policies, chunks))
        carry = jax.lax.with_sharding_constraint(
            empty_carry(model, periodic, M, n_dev, mb_example, x_aval, res_avals, nan_bubbles),
            NamedSharding(mesh, P(ALL)))
        counters = (jnp.zeros((), jnp.int32), (step * M).astype(jnp.int32), jnp.zeros((), jnp.int32))
        one = (lambda t: t[0]) if K == 1 else (lambda t: t)
        _, _, pss, _, _, (loss, _, _, _) = run(one(chunks), one(tuple(() for _ in range(K))), one(pstate), carry,
                                               counters, batch, jnp.asarray(True))
        pss = (pss,) if K == 1 else pss
        if perms is not None:       # each replica's gradient home to its stage's owner, summed there
            home = [ps.acc[0] if pm is None else permute(ps.acc[0], [(d, s_) for s_, d in pm])
                    for ps, pm in zip(pss, perms)]
            g_w = jax.tree.map(lambda *g: sum(g), *home)
        elif K == 1:
            g_w = pss[0].acc[0]
        else:
            g_w = pin(jax.tree.map(lambda *g: jnp.stack(g, 1).reshape((D * K,) + g[0].shape[1:]),
                                   *(ps.acc[0] for ps in pss)))
        total = (lambda a: a) if replicas else (lambda a: a.sum(0))
        g_pre = jax.tree.map(lambda *g: sum(total(a) for a in g), *(ps.acc[1] for ps in pss))
        g_post = jax.tree.map(lambda *g: sum(total(a) for a in g), *(ps.acc[2] for ps in pss))
        if replicas:
            return loss, (g_w, g_pre, g_post)
        like = lambda g, q: jax.tree.map(lambda a, b: a.astype(b.dtype), g, q)
        return loss, (like(g_w, stage_p), like(g_pre, pre_p), like(g_post, post_p))
    return fn

