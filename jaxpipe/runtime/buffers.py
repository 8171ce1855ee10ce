"""The executor's buffers: stash and message slots read and written at a dynamic index, filled (NaN in
bubbles, zeros on the host), cast to an activation's avals; and ``cond``, which runs a lane busy everywhere
without a conditional."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def cond(pred, true_fn, false_fn, *operands):
    """``lax.cond``, or ``true_fn(*operands)`` where ``pred`` is the Python ``True`` (a lane busy on every
    device in every tick of its phase: run in the tick's own body, where XLA can share what F and B both read
    --
    a weight slice materialised in each lane's conditional was read twice)."""
    if pred is True:
        return true_fn(*operands)
    return lax.cond(pred, true_fn, false_fn, *operands)


#: the in-flight fields a forward lane writes (the rest pass through its conditional untouched)
F_OUT = ("stash", "gpost", "dy_own", "gtie", "cnt_own")


def read(buf, slot):
    """Slot ``slot`` of a buffer (or of every buffer of a pytree: activations may be pytrees)."""
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, False), buf)


def write(buf, slot, val):
    """``buf`` with ``val`` written at ``slot`` (pytrees: leaf by leaf), cast to the buffer's dtype."""
    return jax.tree.map(
        lambda b, value: lax.dynamic_update_index_in_dim(b, value.astype(b.dtype), slot, 0), buf, val
    )


def full(avals, value, lead=()):
    """Arrays shaped like ``avals`` (a pytree of ShapeDtypeStructs) with leading dims ``lead``, all ``value``
    (NaN mode's NaN only where the dtype has it: integer leaves, such as a stashed PRNG key, get 0)."""
    return jax.tree.map(
        lambda leaf: jnp.full(tuple(lead) + tuple(leaf.shape), fill_value(value, leaf.dtype), leaf.dtype),
        avals,
    )


def host_zeros(avals):
    """Zeros shaped like ``avals`` (arrays or ShapeDtypeStructs) as host (numpy) arrays: inputs for tracing a
    function for its shapes, which compile nothing (``jnp.zeros`` compiles a program per shape and placement).
    A dtype numpy cannot hold (a typed PRNG key) gets ``jnp.zeros``."""

    def one(a):
        try:
            return np.zeros(tuple(a.shape), np.dtype(a.dtype))
        except TypeError:
            return jnp.zeros(a.shape, a.dtype)

    return jax.tree.map(one, avals)


def fill_value(value, dtype):
    """``value``, or 0 where it is NaN and ``dtype`` cannot hold NaN (casting NaN to an integer is
    undefined)."""
    nan = isinstance(value, float) and value != value
    return 0 if nan and not jnp.issubdtype(dtype, jnp.inexact) else value


def cast(x, avals):
    """``x`` with every leaf cast to the dtype of the matching leaf of ``avals``."""
    return jax.tree.map(lambda value, leaf: value.astype(leaf.dtype), x, avals)


def where(cond, a, b):
    """``jnp.where(cond, a, b)`` leaf by leaf."""
    return jax.tree.map(lambda u, value: jnp.where(cond, u, value), a, b)
