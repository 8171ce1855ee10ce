"""Zero-bubble's B/W split without recomputation (ZB-H1, Qi et al. 2024, §2: B computes the input gradient,
W the weight gradient "from the stored output gradients of each layer").

A stage's backward ``bwd(w, res, dy) -> (dw, dx)`` is one jaxpr.  The equations ``dx`` needs run in B; the
equations only ``dw`` needs run in W.  Computed separately with two dead-code-eliminated copies of the
pullback (what the executor did before), W back-propagates through the stage a second time: the weight
gradient of layer ``l`` needs the gradient at layer ``l``'s output, which comes through layers ``l+1..L``
(one matmul per layer recomputed, ~17% more stage compute for two tanh layers).  Here B also returns the
values W's own equations read from B's part -- the per-layer output gradients, the *frontier* -- and the
executor keeps them in a slot beside the stashed residuals until W.  W then runs only the weight-gradient
equations: together B and W compute what the fused backward computes, no more.

The split is made on the flat jaxpr of the pullback (calls of jitted functions inlined).  A stage whose
layers are inside one equation (a ``lax.scan`` over layers, a ``remat``) cannot be split there: its
frontier would hold that equation's outputs -- the weight gradients themselves.  :func:`split_backward`
returns None when the frontier is larger than the stashed residuals (or W has nothing of its own), and the
executor keeps recomputing.
"""
from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional

import jax
import numpy as np

_CALLS = ("pjit", "jit", "closed_call", "core_call")


def _is_literal(v) -> bool:
    return hasattr(v, "val")


def _read(env, v):
    return v.val if _is_literal(v) else env[v]


def _eval_eqns(eqns, env, inline: bool = False):
    """Bind ``eqns`` in order on the values in ``env`` (a dict var -> value, updated); ``inline``: evaluate
    calls of jitted functions equation by equation (so that tracing this gives a flat jaxpr)."""
    for eqn in eqns:
        invals = [_read(env, v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if eqn.primitive.name in _CALLS else None
        if inline and inner is not None:
            closed = inner if hasattr(inner, "consts") else None
            jx = closed.jaxpr if closed is not None else inner
            sub = dict(zip(jx.constvars, closed.consts if closed is not None else []))
            sub.update(zip(jx.invars, invals))
            _eval_eqns(jx.eqns, sub, inline=True)
            outs = [_read(sub, v) for v in jx.outvars]
        else:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))


def _needed(eqns, targets) -> set:
    """Indices of the equations the variables ``targets`` depend on."""
    want = {v for v in targets if not _is_literal(v)}
    need = set()
    for k in range(len(eqns) - 1, -1, -1):
        if any(v in want for v in eqns[k].outvars):
            need.add(k)
            want.update(v for v in eqns[k].invars if not _is_literal(v))
    return need


class BackwardSplit(NamedTuple):
    """``input_part(w, res, dy) -> (dx, frontier)`` for B, ``weight_part(w, res, dy, frontier) -> dw`` for W;
    ``frontier_avals``: the shapes B hands to W (one slot per in-flight micro-batch)."""
    input_part: Callable
    weight_part: Callable
    frontier_avals: List[Any]


def _nbytes(avals) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in avals)


def split_backward(bwd: Callable, w, res, dy, stash_avals) -> Optional[BackwardSplit]:
    """The split of ``bwd(w, res, dy) -> (dw, dx)`` (pytrees) traced at these arguments, or None where it
    would not pay (see the module docstring).  Call it where the executor traces (inside the ``shard_map``)."""
    flat_args, in_tree = jax.tree.flatten((w, res, dy))
    nested, out_shape = jax.make_jaxpr(lambda *a: bwd(*jax.tree.unflatten(in_tree, a)),
                                       return_shape=True)(*flat_args)

    def flat_bwd(*leaves):          # the same equations with jitted calls inlined
        env = dict(zip(nested.jaxpr.constvars, nested.consts))
        env.update(zip(nested.jaxpr.invars, leaves))
        _eval_eqns(nested.jaxpr.eqns, env, inline=True)
        return [_read(env, v) for v in nested.jaxpr.outvars]

    closed = jax.make_jaxpr(flat_bwd)(*flat_args)
    out_tree = jax.tree.structure(out_shape)
    jx = closed.jaxpr
    n_dw = len(jax.tree.leaves(out_shape[0]))
    dw_vars, dx_vars = jx.outvars[:n_dw], jx.outvars[n_dw:]
    b_set = _needed(jx.eqns, dx_vars)
    w_only = sorted(_needed(jx.eqns, dw_vars) - b_set)
    if not w_only:
        return None
    b_defined = {v for k in b_set for v in jx.eqns[k].outvars}
    front, seen = [], set()
    for v in [u for k in w_only for u in jx.eqns[k].invars] + list(dw_vars):
        if not _is_literal(v) and v in b_defined and v not in seen:
            seen.add(v)
            front.append(v)
    # a frontier value made by an equation with a jaxpr inside (a scan over layers, a remat, a custom
    # rule) means B would run W's part of that equation too: no split there
    atomic = {v for k in b_set for v in jx.eqns[k].outvars
              if any(hasattr(p, "eqns") or hasattr(p, "jaxpr") for p in jx.eqns[k].params.values())}
    if any(v in atomic for v in front) or _nbytes([v.aval for v in front]) > _nbytes(stash_avals):
        return None
    b_eqns = [jx.eqns[k] for k in sorted(b_set)]
    w_eqns = [jx.eqns[k] for k in w_only]
    dx_tree = out_tree.children()[1]

    def start(w_, res_, dy_):
        env = dict(zip(jx.constvars, closed.consts))
        env.update(zip(jx.invars, jax.tree.leaves((w_, res_, dy_))))
        return env

    def input_part(w_, res_, dy_):
        env = start(w_, res_, dy_)
        _eval_eqns(b_eqns, env)
        return jax.tree.unflatten(dx_tree, [_read(env, v) for v in dx_vars]), [env[v] for v in front]

    def weight_part(w_, res_, dy_, frontier):
        env = start(w_, res_, dy_)
        env.update(zip(front, frontier))
        _eval_eqns(w_eqns, env)
        return jax.tree.unflatten(out_tree.children()[0], [_read(env, v) for v in dw_vars])

    return BackwardSplit(input_part, weight_part, [v.aval for v in front])
