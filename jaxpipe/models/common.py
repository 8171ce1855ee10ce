"""Helpers to build a :class:`PipelineModel` from Flax NNX modules (parameters as pure dicts)."""

from __future__ import annotations

from typing import Callable, Tuple

import jax
import jax.numpy as jnp
from flax import nnx


def split_pure(module: nnx.Module):
    """(graphdef, parameters as a pure dict of arrays)."""
    graphdef, state = nnx.split(module)
    return graphdef, nnx.to_pure_dict(state)


def stacked_stages(make_stage: Callable[[nnx.Rngs], nnx.Module], num_stages: int, seed: int):
    """Build ``num_stages`` independently initialised stage modules and stack their parameters.

    Returns ``(apply, stacked_params)`` where ``apply(params_of_one_stage, x)`` runs one stage.
    """
    graphdef, first = split_pure(make_stage(nnx.Rngs(seed * 1000 + 1)))
    rest = [split_pure(make_stage(nnx.Rngs(seed * 1000 + 1 + s)))[1] for s in range(1, num_stages)]
    stacked = jax.jit(lambda *ps: jax.tree.map(lambda *xs: jnp.stack(xs), *ps))(first, *rest)  # one program
    return module_apply(graphdef), stacked


def module_apply(graphdef) -> Callable:
    def apply(params, *args):
        return nnx.merge(graphdef, params)(*args)

    return apply


def softmax_xent(logits, labels) -> jax.Array:
    """Mean softmax cross-entropy with integer labels (float32 log-softmax)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1))


Pair = Tuple[Callable, object]
