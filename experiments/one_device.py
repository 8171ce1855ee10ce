"""One-device programs the pipelines are compared with, kept out of the library's runtime path: Cyclic Data
Parallelism's single-device cyclic order (Fournier & Oyallon, Table 1, "Single-GPU DP + Cyclic") and the plain
single-device data-parallel gradient beside it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe.cyclic import _require_mean_loss
from jaxpipe.errors import ConfigError
from jaxpipe.model import PipelineModel, microbatch_key
from jaxpipe.runtime.buffers import cast, full, read, write
from jaxpipe.runtime.stage import StageOps
from jaxpipe.schedules import cyclic as cyc


def single_device_grad(model: PipelineModel, num_workers: int, cyclic: bool = True):
    """``fn(params, mbs) -> (loss_sum, grads_sum)`` over a stream ``mbs`` of ``[K, N, ...]`` micro-batches
    (step k, worker i) run on ONE device in the cyclic order (Table 1, "Single-GPU DP + Cyclic"), with fixed
    parameters: N workers interleaved two ticks apart, each tick every worker runs one stage's F or B,
    activations kept in a pool of N (N + 1)/2 stage slots (:func:`jaxpipe.schedules.cyclic.pool_slot`)
    instead of N x N.  A memory demonstration that also computes the right numbers (tested against
    ``jax.grad``).  ``cyclic=False`` runs the same program with every worker in step (DP's order: no delay,
    a pool of N x N slots), so XLA's temp bytes of the two differ only by the order.
    :func:`single_device_dp_grad` is plain ``jax.grad`` over each step's N micro-batches, for reference."""
    N = num_workers
    delay = 2 if cyclic else 0
    size = cyc.pool_size(N) if cyclic else N * N
    pool_slot = cyc.pool_slot if cyclic else (lambda N, i, j, k: i * N + j)
    pool_size = lambda N: size
    if model.num_stages != N:
        raise ConfigError(f"the model has {model.num_stages} stages; cyclic order needs one per worker ({N})")
    pre = model.pre

    def fn(params, mbs):
        w_all, pre_p, post_p = params
        K = jax.tree.leaves(mbs)[0].shape[0]
        mb0 = jax.tree.map(lambda a: a[0, 0], mbs)
        xa = jax.eval_shape(pre, pre_p, mb0)
        w0 = jax.tree.map(lambda a: a[0], w_all)
        _require_mean_loss(model, xa, mb0)
        ops, res = StageOps.build(model, w0, full(xa, 0), mb0)
        pool = [jnp.zeros((pool_size(N) + 1,) + tuple(a.shape), a.dtype) for a in res]
        regs = full(xa, 0, (N,))
        gpost_regs = jax.tree.map(lambda a: jnp.zeros((N,) + jnp.shape(a), jnp.asarray(a).dtype), post_p)
        g0 = jax.tree.map(jnp.zeros_like, params)

        branches = _cyclic_branches(ops, xa, w_all, pre_p, post_p, mbs)

        def tick(c, t):
            pool, act, dy, gpost, g, loss = c
            for i in range(N):
                tau = t - delay * i
                k = jnp.floor_divide(tau, 2 * N)
                p = jnp.mod(tau, 2 * N)
                is_f = p < N
                j = jnp.where(is_f, p, 2 * N - 1 - p)
                pos = (j == 0).astype(jnp.int32) + 2 * (j == N - 1).astype(jnp.int32)
                ok = (tau >= 0) & (k < K)
                kk = jnp.clip(k, 0, K - 1)
                br = jnp.where(ok, jnp.where(is_f, 1 + pos, 5 + pos), 0)
                slot = pool_slot(N, i, j, kk)
                r_in = [read(a, slot) for a in pool]
                r, y, d, gq, g, loss = lax.switch(
                    br, branches, i, j, kk, read(act, i), r_in, read(dy, i), g, loss
                )
                f_last = ok & is_f & (j == N - 1)
                b_last = ok & ~is_f & (j == N - 1)
                # the head's gradient joins with the backward of the last stage
                g = (g[0], g[1], jax.tree.map(lambda a, v: a + jnp.where(b_last, v[i], 0), g[2], gpost))
                gpost = jax.tree.map(lambda a, v: a.at[i].set(jnp.where(f_last, v, a[i])), gpost, gq)
                pool = [write(a, jnp.where(ok & is_f, slot, pool_size(N)), v) for a, v in zip(pool, r)]
                act, dy = write(act, i, y), write(dy, i, d)
            return (pool, act, dy, gpost, g, loss), None

        c = (pool, regs, regs, gpost_regs, g0, jnp.zeros((), jnp.float32))
        c, _ = lax.scan(tick, c, jnp.arange(2 * N * K + 2 * N - 2, dtype=jnp.int32))
        return c[5], c[4]

    return fn


def single_device_dp_grad(model: PipelineModel, num_workers: int):
    """``fn(params, mbs) -> (loss_sum, grads_sum)`` the standard way on one device: each step's N micro-
    batches forward and backward together (Table 1, "Single-GPU DP": N B Psi_A of activations at the peak),
    a scan over the K steps."""

    def fn(params, mbs):
        def one(g, step_mbs):
            def loss(p):
                return jnp.sum(jax.vmap(lambda mb: model.loss(p, mb))(step_mbs))

            l, gg = jax.value_and_grad(loss)(params)
            return jax.tree.map(jnp.add, g, gg), l

        g, ls = lax.scan(one, jax.tree.map(jnp.zeros_like, params), mbs)
        return jnp.sum(ls), g

    return fn


def _cyclic_branches(ops, xa, w_all, pre_p, post_p, mbs):
    """The switch of :func:`single_device_grad`'s tick: idle, then F and B at each (first, last) position.
    Branches return small new values; the pool and the registers are written outside the switch (a branch
    returning the whole pool makes XLA copy it every tick)."""

    def f_op(first, last):
        def f(i, j, k, x_in, r_in, dy_in, g, loss):
            w = jax.tree.map(lambda a: read(a, j), w_all)
            mb = jax.tree.map(lambda a: a[k, i], mbs)
            y, r, head = ops.forward(
                w, x_in, mb, pre_p, post_p, first, last, ops.context(mb, microbatch_key(0, k, i), j)
            )
            dy, gq = full(xa, 0), jax.tree.map(jnp.zeros_like, post_p)
            if last:
                l, _, gq, d = head
                dy, loss = cast(d, xa), loss + l
            return r, cast(y, xa), dy, gq, g, loss

        return f

    def b_op(first, last):
        def b(i, j, k, x_in, r_in, dy_in, g, loss):
            w = jax.tree.map(lambda a: read(a, j), w_all)
            dw, dx = ops.backward(w, r_in, dy_in)
            gw, gpre, gpo = g
            gw = jax.tree.map(lambda a, v: a.at[j].add(v), gw, dw)
            if first:
                mb = jax.tree.map(lambda a: a[k, i], mbs)
                dpre = ops.pre_grad(pre_p, mb, cast(dx, xa))
                gpre = jax.tree.map(jnp.add, gpre, dpre)
            return (r_in, x_in, cast(dx, xa), jax.tree.map(jnp.zeros_like, post_p), (gw, gpre, gpo), loss)

        return b

    def idle(i, j, k, x_in, r_in, dy_in, g, loss):
        return r_in, x_in, dy_in, jax.tree.map(jnp.zeros_like, post_p), g, loss

    flags = [(False, False), (True, False), (False, True), (True, True)]
    return [idle] + [f_op(*f) for f in flags] + [b_op(*f) for f in flags]
