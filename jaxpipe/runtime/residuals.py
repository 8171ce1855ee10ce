"""What a stage keeps between its forward and its backward: the vjp residuals split into those that
depend on the activation (stashed) and the rest (recomputed), the pullback rebuilt from them, and the stage
that recomputes its forward at the weights its forward read."""

from __future__ import annotations

import collections

from typing import Any, List, Sequence, Tuple

import jax
import jax.numpy as jnp


class RecomputedAtForwardWeights:
    """A stage function whose backward recomputes its forward on the weights that forward read.

    For the methods whose forward and backward of one micro-batch read different weights (PipeOptim's and
    SpecTrain's predictions; a method's ``reads_differ``) under a residual policy that recomputes
    (``residuals="inputs"``, a ``jax.checkpoint`` policy).  ``jax.checkpoint`` alone
    recomputes the forward from the weights the *backward* reads, which are not the ones the activations came
    from (PipeOptim 7.5e-3 off its serial reference).  Here the stash keeps the stage's input, its
    context and the weights the forward read; the backward reruns the forward on them with every residual kept
    (``residuals="all"``'s split) and back-propagates with the weights it reads -- the rule of the serial
    reference.  The cost: one copy of the stage's weights per micro-batch in flight, and the whole forward
    recomputed (a checkpoint policy's saved values are recomputed too).
    """

    def __init__(self, stage_fn):
        self.stage_fn = stage_fn

    def __call__(self, *args):
        return self.stage_fn(*args)


_TRACED_KEPT = 64
#: the jitted stage functions, newest last (at most :data:`_TRACED_KEPT`: a sweep building many models does
#: not keep every one's traces alive)
_TRACED: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()


def traced_once(stage_fn):
    """``stage_fn`` under ``jax.jit``: JAX traces the model once per argument shapes, and every later forward,
    pullback and analysis of the stage in the program (one per lane, position and phase) reuses that trace --
    the executor's tracing took half the time (3.4 -> 1.2 s for a 4-stage MLP, 5.2 -> 1.5 s for the
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
    128 MiB a micro-batch a block for nothing.  Any other equation with a dependent input makes
    all its outputs dependent."""
    from ..jax_internals import call_body

    is_var = lambda value: not hasattr(value, "val")  # Literals carry .val
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
