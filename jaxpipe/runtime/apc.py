"""WPipe's automatic precision compression of stage messages (appendix A.3, Figure 12): a float leaf travels
as float16 with a power-of-2 scaler (``Pipeline(..., options={"apc": True})``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apc_pack(x):
    """WPipe's automatic precision compression (appendix A.3, Figure 12), for one message: every floating leaf
    divided by a power-of-2 scaler and sent as float16 with it.  The scaler 2^e is chosen from the leaf's
    largest magnitude so that the quotient stays below 2^14: the conversion cannot overflow, so the paper's
    full-precision fallback never triggers for finite values (a non-finite leaf stays non-finite, as in
    float32).  What is lost: the float16 mantissa (11 bits) and values below 2^(e - 24)."""

    def one(a):
        if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype.itemsize <= 2:
            return a, jnp.zeros((), jnp.float32)
        m = jnp.max(jnp.abs(a)).astype(jnp.float32)
        e = jnp.where(jnp.isfinite(m) & (m > 0), jnp.ceil(jnp.log2(jnp.where(m > 0, m, 1.0))) - 14.0, 0.0)
        return (a * jnp.exp2(-e).astype(a.dtype)).astype(jnp.float16), e

    leaves, tdef = jax.tree.flatten(x)
    packed = [one(a) for a in leaves]
    return tdef.unflatten([q for q, _ in packed]), tdef.unflatten([e for _, e in packed])


def apc_unpack(packed, like):
    """The receiver's side of :func:`apc_pack`: back to the original dtypes of ``like``, times the scaler."""
    payload, e = packed
    return jax.tree.map(
        lambda q, s, leaf: (
            q if q.dtype == leaf.dtype else (q.astype(leaf.dtype) * jnp.exp2(s).astype(leaf.dtype))
        ),
        payload,
        e,
        like,
    )
