"""Elastic averaging of parallel models, as an optax transform (AvgPipe §3.2, Figure 6).

N parallel pipelines each train a replica of the model with the user's optimizer; a reference model is the
centre of the replicas.  Each step, replica ``i``'s local update ``u_i`` (the wrapped optimizer's, on the
replica's own gradient and state) is applied and the replica is diluted with the reference in ratio
``(1 - alpha) : alpha`` (Step 2); the local updates are sent to the reference, which applies their mean
(Steps 3-4):

    w_i <- (1 - alpha) w_i + alpha ref + u_i          ref <- ref + mean_i u_i

so the reference stays the mean of the replicas (the mean of ``(1 - alpha) w_i + alpha ref`` is ``ref``
when ``ref = mean_i w_i``), as the paper requires, and the rule never looks inside the optimizer -- any optax
optimizer works (the point of §3.2 against EASGD, which is an SGD variant).  ``alpha = 1/N`` by default
(the paper's choice, after [18]).  With N = 1 the rule is plain training with the wrapped optimizer.

Pytrees carry a leading replica axis of size N (the mesh's ``pipe`` axis).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from ..errors import ConfigError


class ElasticState(NamedTuple):
    inner: Any  # the wrapped optimizer's state, one per replica (leading axis N)
    ref: Any  # the reference model (no replica axis)


def default_alpha(num_pipes: int) -> float:
    return 1.0 / num_pipes


def check_alpha(alpha, num_pipes: int) -> float:
    if alpha is None:
        return default_alpha(num_pipes)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ConfigError(
            f"avgpipe alpha={alpha!r}: the elastic ratio must be a number in [0, 1] (the "
            f"reference's share when diluting each replica, AvgPipe §3.2); None gives 1/N = "
            f"{default_alpha(num_pipes):g} for N={num_pipes} parallel pipelines"
        )
    return float(alpha)


def elastic_averaging(
    opt: optax.GradientTransformation, num_pipes: int, alpha: Optional[float] = None
) -> optax.GradientTransformation:
    """Wrap ``opt`` for ``num_pipes`` replicas stacked on a leading axis; ``update`` needs ``params``."""
    a = check_alpha(alpha, num_pipes)

    def init(params):
        return ElasticState(jax.vmap(opt.init)(params), jax.tree.map(lambda p: jnp.mean(p, axis=0), params))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("elastic_averaging needs params: tx.update(grads, state, params)")
        u, inner = jax.vmap(opt.update)(grads, state.inner, params)
        # (1 - a) w + a ref + u, written as an update to w
        out = jax.tree.map(
            lambda w, r, uu: (a * (r[None].astype(w.dtype) - w) + uu).astype(w.dtype), params, state.ref, u
        )
        ref = jax.tree.map(lambda r, uu: r + jnp.mean(uu, axis=0).astype(r.dtype), state.ref, u)
        return out, ElasticState(inner, ref)

    return optax.GradientTransformation(init, update)
