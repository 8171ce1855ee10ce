"""The two-lane lockstep 1F1B sketch, a baseline for the executor: every tick each device runs one forward and
one backward (each under ``lax.cond``, a ``ppermute`` after each), the residuals of ``jax.vjp`` in a
(2D - 1)-slot stash, weights never stashed -- about 90 lines in one ``shard_map``. Copied, as a function, from
the project's reference sketch so that the accelerator check (``experiments/gpu_check.py``) can time it
beside jaxpipe on a machine that has only the repository. Not library code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def scanned_stage(w, h):
    """A stage: ``tanh(h @ w[i])`` for each of its layers, in a ``lax.scan``."""
    h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)
    return h


def sketch_loss_and_grad(weights, x, y, devices: int, microbatches: int):
    """``(step, args)``: the sketch's jitted ``(loss, gradient)`` over ``devices`` stages and the arguments
    placed on a mesh of the first ``devices`` devices; ``step(*args)`` runs it.

    Args:
        weights: ``[layers, H, H]``, cut into ``devices`` stages of ``layers / devices`` layers.
        x: ``[B, H]`` inputs.
        y: ``[B, H]`` targets (the loss: the mean squared error of the last layer's output).
        devices: pipeline stages, one a device.
        microbatches: M.

    Returns:
        ``(step, args)``; the gradient comes back as ``[devices, layers / devices, H, H]``.
    """
    D, M = devices, microbatches
    L, H = weights.shape[0], weights.shape[-1]
    B = x.shape[0]
    T = M + 2 * (D - 1)
    fa, ba = np.full((T, D), -1, np.int32), np.full((T, D), -1, np.int32)
    for d in range(D):
        for mb in range(M):
            fa[mb + d, d] = mb
            ba[mb + 2 * (D - 1) - d, d] = mb
    cap = 2 * D - 1
    mesh = jax.make_mesh((D,), ("stage",), devices=jax.devices()[:D])
    mb_rows = B // M

    def vary(a):
        if "stage" in str(jax.typeof(a).manual_axis_type):
            return a
        return jax.lax.pcast(a, ("stage",), to="varying")

    def pipe(Ws, xs, ys):
        w = Ws[0]
        d = jax.lax.axis_index("stage")
        fat, bat = jnp.asarray(fa), jnp.asarray(ba)

        def f_any(w, h, yt):
            out = scanned_stage(w, h)
            return out, jnp.sum((out - yt) ** 2) / (B * H)

        _, vjp0 = jax.vjp(f_any, w, vary(xs[0]), vary(ys[0]))
        leaves0, tdef = jax.tree_util.tree_flatten(vjp0)
        isw = [leaf is w for leaf in leaves0]
        stash = [
            None if iw else vary(jnp.zeros((cap,) + leaf.shape, leaf.dtype)) for leaf, iw in zip(leaves0, isw)
        ]
        z = vary(jnp.zeros((mb_rows, H)))
        carry = (stash, z, z, vary(jnp.zeros_like(w)), vary(jnp.zeros(())))

        def tick(carry, t):
            stash, recv_f, recv_b, gacc, lacc = carry
            f_mb, b_mb = fat[t, d], bat[t, d]

            def do_f(stash, lacc):
                inp = jnp.where(d == 0, xs[jnp.maximum(f_mb, 0)], recv_f)
                (out, loss), vjp = jax.vjp(f_any, w, inp, vary(ys[jnp.maximum(f_mb, 0)]))
                slot = f_mb % cap
                leaves = jax.tree_util.tree_leaves(vjp)
                stash = [s.at[slot].set(leaf) if s is not None else None for s, leaf in zip(stash, leaves)]
                return stash, out, lacc + jnp.where(d == D - 1, loss, 0.0)

            stash, out, lacc = jax.lax.cond(f_mb >= 0, do_f, lambda s, la: (s, z * 0, la), stash, lacc)
            send_f = jax.lax.ppermute(out, "stage", [(j, j + 1) for j in range(D - 1)])

            def do_b(gacc):
                slot = b_mb % cap
                vjp = jax.tree_util.tree_unflatten(tdef, [s[slot] if s is not None else w for s in stash])
                last = d == D - 1
                gw, gx, _ = vjp((jnp.where(last, 0.0, recv_b), jnp.where(last, 1.0, 0.0)))
                return gacc + gw, gx

            gacc, gx = jax.lax.cond(b_mb >= 0, do_b, lambda g: (g, z * 0), gacc)
            send_b = jax.lax.ppermute(gx, "stage", [(j + 1, j) for j in range(D - 1)])
            return (stash, send_f, send_b, gacc, lacc), None

        (_, _, _, gacc, lacc), _ = jax.lax.scan(tick, carry, jnp.arange(T))
        return jax.lax.psum(lacc, "stage"), gacc[None]

    step = jax.jit(
        jax.shard_map(pipe, mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=(P(), P("stage")))
    )
    args = (
        jax.device_put(weights.reshape(D, L // D, H, H), NamedSharding(mesh, P("stage"))),
        jax.device_put(x.reshape(M, mb_rows, H), NamedSharding(mesh, P())),
        jax.device_put(y.reshape(M, mb_rows, H), NamedSharding(mesh, P())),
    )
    return step, args
