"""Where a NaN or Inf came from: the first stage whose weights, output or gradient is not finite.

Run on the unpipelined model (``PipelineModel.pre`` -> ``stage_fn`` per stage -> ``post_loss``) with the
current parameters and the offending batch, after a pipelined step reported a non-finite loss or gradient
norm; it costs nothing while training is healthy.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def _finite(tree) -> bool:
    return all(
        bool(jnp.all(jnp.isfinite(x)))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
    )


def locate_nonfinite(model, params, batch) -> Optional[dict]:
    """``{"where": "weights" | "input" | "activation" | "loss" | "gradient", "stage": s or None, "detail"}``
    for the first non-finite value along the forward and backward pass, or None if everything is finite."""
    w, pre_p, post_p = params
    S = model.num_stages
    for s in range(S):
        if not _finite(jax.tree.map(lambda a: a[s], w)):
            return {"where": "weights", "stage": s, "detail": f"stage {s}'s parameters hold NaN/Inf"}
    if not _finite(pre_p):
        return {"where": "weights", "stage": 0, "detail": "the embedding (pre) parameters hold NaN/Inf"}
    if not _finite(post_p):
        return {"where": "weights", "stage": S - 1, "detail": "the head/loss (post) parameters hold NaN/Inf"}
    if not _finite(batch):
        return {"where": "input", "stage": 0, "detail": "the batch holds NaN/Inf"}
    x = jax.jit(model.pre)(pre_p, batch)
    fn = jax.jit(model.stage_fn)
    for s in range(S):
        x = fn(jax.tree.map(lambda a: a[s], w), x)
        if not _finite(x):
            return {
                "where": "activation",
                "stage": s,
                "detail": f"stage {s}'s output is the first non-finite "
                "activation (max |finite value| "
                f"{float(jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0))):.3g})",
            }
    loss = jax.jit(model.post_loss)(post_p, x, batch)
    if not np.isfinite(float(loss)):
        return {"where": "loss", "stage": S - 1, "detail": "the loss of finite activations is non-finite"}
    g = jax.jit(jax.grad(model.loss))(params, batch)
    for s in reversed(range(S)):  # the backward pass runs from the last stage down
        if s == S - 1 and not _finite(g[2]):
            return {"where": "gradient", "stage": s, "detail": "the head's gradient is non-finite"}
        if not _finite(jax.tree.map(lambda a: a[s], g[0])):
            return {
                "where": "gradient",
                "stage": s,
                "detail": f"stage {s}'s weight gradient is the first non-finite one",
            }
    return None
