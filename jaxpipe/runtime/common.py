"""Pieces of the executor kept apart: the vjp residual split, stash reads/writes and collectives over live
axes.  (The schedule-only helpers -- the layout of model stages over devices, the lane plan, Chimera's eager
points -- are in :mod:`jaxpipe.schedules.layout`.)"""

from __future__ import annotations

import collections
from typing import Any, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def cond(pred, true_fn, false_fn, *operands):
    """``lax.cond``, or ``true_fn(*operands)`` where ``pred`` is the Python ``True`` (a lane busy on every
    device in every tick of its phase: run in the tick's own body, where XLA can share what F and B both read
    --
    a weight slice materialised in each lane's conditional was read twice; issue #39)."""
    if pred is True:
        return true_fn(*operands)
    return lax.cond(pred, true_fn, false_fn, *operands)


#: the in-flight fields a forward lane writes (the rest pass through its conditional untouched)
F_OUT = ("stash", "gpost", "dy_own", "gtie", "cnt_own")


class RecomputedAtForwardWeights:
    """A stage function whose backward recomputes its forward on the weights that forward read.

    For the methods whose forward and backward of one micro-batch read different weights (PipeOptim's and
    SpecTrain's predictions; a method's ``reads_differ``) under a residual policy that recomputes
    (``residuals="inputs"``, a ``jax.checkpoint`` policy).  ``jax.checkpoint`` alone
    recomputes the forward from the weights the *backward* reads, which are not the ones the activations came
    from (issue #48: PipeOptim 7.5e-3 off its serial reference).  Here the stash keeps the stage's input, its
    context and the weights the forward read; the backward reruns the forward on them with every residual kept
    (``residuals="all"``'s split) and back-propagates with the weights it reads -- the rule of the serial
    reference.  The cost: one copy of the stage's weights per micro-batch in flight, and the whole forward
    recomputed (a checkpoint policy's saved values are recomputed too).
    """

    def __init__(self, stage_fn):
        self.stage_fn = stage_fn

    def __call__(self, *args):
        return self.stage_fn(*args)


#: the jitted stage functions, newest last (at most :data:`_TRACED_KEPT`: a sweep building many models does
#: not
#: keep every one's traces alive)
_TRACED: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
_TRACED_KEPT = 64


def traced_once(stage_fn):
    """``stage_fn`` under ``jax.jit``: JAX traces the model once per argument shapes, and every later forward,
    pullback and analysis of the stage in the program (one per lane, position and phase) reuses that trace --
    the executor's tracing took half the time (issue #50: 3.4 -> 1.2 s for a 4-stage MLP, 5.2 -> 1.5 s for the
    GPT).  XLA inlines the call: the compiled program is the one the inline stage gave (temp, bytes and flops
    equal, measured on the MLP, the GPT, ZB-H1 and D = 1).  (A :class:`RecomputedAtForwardWeights` stage never
    comes here: its callers take it apart first.)"""
    entry = _TRACED.get(id(stage_fn))
    if entry is None or entry[0] is not stage_fn:
        entry = _TRACED[id(stage_fn)] = (stage_fn, jax.jit(stage_fn))
        while len(_TRACED) > _TRACED_KEPT:
            _TRACED.popitem(last=False)
    _TRACED.move_to_end(id(stage_fn))
    return entry[1]


def _kept(w, x, ctx):
    """What a :class:`RecomputedAtForwardWeights` stage stashes: the forward's weights, input and context."""
    return jax.tree.flatten((w, x, ctx))


def residual_mask(stage_fn, w, x, ctx=None) -> Tuple[Tuple[bool, ...], list]:
    """Which leaves of ``jax.vjp(stage_fn, w, x)``'s pullback depend on the activation ``x``.

    Those are stashed by F.  The others are functions of the weights alone (the weights themselves, slices,
    transposes, casts of them): B recomputes them from the weights it must read, so weights are never
    copied into the stash.  Found by a dependency walk over the jaxpr that follows call bodies (``jit``)
    output by output and is conservative elsewhere (any other equation with an x-dependent input makes all its
    outputs x-dependent).  Call it in the context the executor traces in
    (inside the ``shard_map``): how many residuals a pullback has can depend on it.  Returns the mask and
    the shapes of the stashed residuals.  ``ctx`` (a :class:`~jaxpipe.model.StageContext`, for
    ``stage_fn(w, x, ctx)``) counts as per-micro-batch like ``x``: residuals of its inputs and of its key (a
    dropout mask) are stashed too.
    """
    if isinstance(stage_fn, RecomputedAtForwardWeights):
        kept = _kept(w, x, ctx)[0]
        return (True,) * len(kept), [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in kept]

    stage_fn = traced_once(stage_fn)

    def leaves(w, x, c):
        f = stage_fn if ctx is None else (lambda w_, x_: stage_fn(w_, x_, c))
        return jax.tree.leaves(jax.vjp(f, w, x)[1])

    jaxpr = jax.make_jaxpr(leaves)(w, x, ctx).jaxpr
    n_w = len(jax.tree.leaves(w))
    mask = tuple(_depends(jaxpr, [i >= n_w for i in range(len(jaxpr.invars))]))
    return mask, [v.aval for v, m in zip(jaxpr.outvars, mask) if m]


def _depends(jaxpr, dep_in: Sequence[bool]) -> List[bool]:
    """Per output of ``jaxpr``: does it depend on an input marked in ``dep_in``?  Call equations (``jit``...)
    are followed inside, output by output: a ``jnp.where`` under ``jit`` returns its (broadcast) predicate as
    a residual, which for a causal mask depends on no activation -- stashed as one, GPT d1024's attention kept
    128 MiB a micro-batch a block for nothing (issue #39).  Any other equation with a dependent input makes
    all its outputs dependent."""
    from ..jax_internals import call_body

    is_var = lambda v: not hasattr(v, "val")  # Literals carry .val
    dep = {v for v, d in zip(jaxpr.invars, dep_in) if d}
    for eqn in jaxpr.eqns:
        ins = [is_var(v) and v in dep for v in eqn.invars]
        if not any(ins):
            continue
        body = call_body(eqn)
        outs = [True] * len(eqn.outvars) if body is None else _depends(body, ins)
        dep.update(o for o, d in zip(eqn.outvars, outs) if d)
    return [is_var(v) and v in dep for v in jaxpr.outvars]


def split_residuals(stage_fn, w, x, mask: Sequence[bool], ctx=None):
    """``jax.vjp`` of one stage; returns (y, residuals to stash, all pullback leaves, treedef)."""
    if isinstance(stage_fn, RecomputedAtForwardWeights):
        y = stage_fn(w, x) if ctx is None else stage_fn(w, x, ctx)
        kept, treedef = _kept(w, x, ctx)
        return y, kept, kept, treedef
    stage_fn = traced_once(stage_fn)
    f = stage_fn if ctx is None else (lambda w_, x_: stage_fn(w_, x_, ctx))
    y, pullback = jax.vjp(f, w, x)
    leaves, treedef = jax.tree.flatten(pullback)
    if len(leaves) != len(mask):
        raise RuntimeError(
            f"stage_fn's pullback has {len(leaves)} residuals here but {len(mask)} when "
            f"analysed; stage_fn must trace the same way every time"
        )
    return y, [l for l, m in zip(leaves, mask) if m], leaves, treedef


def rebuild_pullback(stage_fn, w, x_like, stashed: List[Any], mask: Sequence[bool], ctx_like=None):
    """The pullback of F, from the stashed activation-dependent residuals and weight-only residuals
    recomputed from ``w`` (the forward traced here on a dummy ``x`` -- and dummy context -- is dead code
    that XLA removes)."""
    if isinstance(stage_fn, RecomputedAtForwardWeights):
        # the forward again, on the weights, input and context it ran with; the pullback at ``w``
        w_f, x, ctx = jax.tree.unflatten(jax.tree.structure((w, x_like, ctx_like)), list(stashed))
        inner = stage_fn.stage_fn
        inner_mask, _ = residual_mask(inner, w_f, x, ctx)
        res = split_residuals(inner, w_f, x, inner_mask, ctx)[1]
        return rebuild_pullback(inner, w, x_like, res, inner_mask, ctx_like)
    _, _, fresh, treedef = split_residuals(stage_fn, w, x_like, mask, ctx_like)
    it = iter(stashed)
    return jax.tree.unflatten(treedef, [next(it) if m else f for f, m in zip(fresh, mask)])


def read(buf, slot):
    """Slot ``slot`` of a buffer (or of every buffer of a pytree: activations may be pytrees)."""
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, 0, False), buf)


def write(buf, slot, val):
    """``buf`` with ``val`` written at ``slot`` (pytrees: leaf by leaf), cast to the buffer's dtype."""
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), slot, 0), buf, val)


def full(avals, value, lead=()):
    """Arrays shaped like ``avals`` (a pytree of ShapeDtypeStructs) with leading dims ``lead``, all ``value``
    (NaN mode's NaN only where the dtype has it: integer leaves, such as a stashed PRNG key, get 0)."""
    return jax.tree.map(
        lambda a: jnp.full(tuple(lead) + tuple(a.shape), fill_value(value, a.dtype), a.dtype), avals
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
    return jax.tree.map(lambda v, a: v.astype(a.dtype), x, avals)


def where(cond, a, b):
    """``jnp.where(cond, a, b)`` leaf by leaf."""
    return jax.tree.map(lambda u, v: jnp.where(cond, u, v), a, b)


_INT_OF_WIDTH = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def ppermute_bits(x, axis, perm):
    """``lax.ppermute`` of a pytree with every floating leaf sent as the integers of its bits (bitcast, the
    same bytes: exact).  Measured on XLA CPU (BUILD_NOTES, "Messages as bits"): the same no-flush program
    ran 10-20% faster when its float messages travelled this way -- the collective-permute itself costs the
    same (micro-benchmark), the difference is in how XLA schedules the float result's consumers."""

    def to_bits(a):
        if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize in _INT_OF_WIDTH:
            return jax.lax.bitcast_convert_type(a, _INT_OF_WIDTH[a.dtype.itemsize])
        return a

    def from_bits(b, a):
        return jax.lax.bitcast_convert_type(b, a.dtype) if b.dtype != a.dtype else b

    return jax.tree.map(from_bits, jax.lax.ppermute(jax.tree.map(to_bits, x), axis, perm), x)


def live_axes(mesh, axes: Sequence[str]) -> Tuple[str, ...]:
    """The axes of ``axes`` with more than one device in ``mesh``."""
    return tuple(a for a in axes if mesh.shape[a] > 1)


def psum_over(x, mesh, axes: Sequence[str]):
    """``lax.psum`` over the axes of ``axes`` that have more than one device; the identity where none has.
    XLA keeps an all-reduce over one-device groups (``replica_groups={{0},{1},...}``): the no-flush methods
    ran a weight-sized one in every tick without data parallelism (BUILD_NOTES, "Collectives over one
    device"); a sum over one device is its operand, exactly.  Only for ``check_vma=False`` programs: with
    varying-axis checks the skipped reduction changes the value's type (the executor runs with
    ``check_vma=False``)."""
    live = live_axes(mesh, axes)
    return lax.psum(x, live) if live else x


def pmean_over(x, mesh, axes: Sequence[str]):
    """``lax.pmean`` over the axes with more than one device (see :func:`psum_over`)."""
    live = live_axes(mesh, axes)
    return lax.pmean(x, live) if live else x


def balanced_broadcast(x, N: int, me, axis):
    """``x`` (a pytree) of worker ``N - 1`` on every other worker, no worker sending more than ``x``'s size:
    worker ``N - 1`` scatters ``x`` in ``N - 1`` chunks (chunk ``r`` to worker ``r``), then the receivers
    all-gather them along a ring (``N - 2`` shifts; each sends ``(N - 2) / (N - 1)`` of ``x``).  The direct
    alternative sends ``(N - 1)`` copies from one worker.  Exact (a permutation of bytes; leaves of mixed
    float dtypes travel in their common dtype and come back exactly).  Worker ``N - 1``'s result is
    garbage."""
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(x)
    R, n = N - 1, flat.shape[0]
    size = -(-n // R)
    chunks = jnp.pad(flat, (0, size * R - n)).reshape(R, size)
    mine = jnp.zeros((size,), flat.dtype)
    for r in range(R):
        got = lax.ppermute(chunks[r], axis, [(N - 1, r)])
        mine = jnp.where(me == r, got, mine)
    out = jnp.zeros((R, size), flat.dtype).at[jnp.minimum(me, R - 1)].set(mine)
    for shift in range(1, R):
        got = lax.ppermute(mine, axis, [(i, (i + shift) % R) for i in range(R)])
        out = out.at[jnp.mod(me - shift, R)].set(got)
    return unravel(out.reshape(-1)[:n])
