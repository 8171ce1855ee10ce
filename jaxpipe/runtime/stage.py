"""One stage's forward and backward, written once for every executor (docs/design.md §2).

Every executor -- the lane executor of the flushing schedules, the no-flush executors, the cyclic
data-parallel program -- runs the same three pieces of model code through :class:`StageOps`:

* ``forward``: ``pre`` on the first stage, ``jax.vjp(stage_fn)`` split into the residuals to stash (those
  that depend on the activation; see :func:`~jaxpipe.runtime.common.residual_mask`) and the rest, and on the
  last stage ``post_loss`` with its gradient (the loss, the head's gradient and dL/dy);
* ``backward``: the pullback rebuilt from the stashed residuals and the weights the op reads;
* ``pre_grad``: ``pre``'s pullback on the first stage (an embedding: recomputed, not stashed).

Executors differ in where the results go (stash slots, messages, accumulators, weight updates), not in
what a stage computes; a change to what a stage computes is made here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp

from ..model import loss_terms
from .common import rebuild_pullback, split_residuals


@dataclasses.dataclass(frozen=True)
class StageOps:
    model: Any                       # the PipelineModel (stage_fn, pre, post_loss)
    mask: Sequence[bool]             # which pullback leaves are stashed (residual_mask)
    x_aval: Any                      # the activation's shape and dtype
    x_like: Optional[Callable] = None   # a dummy activation for rebuilding pullbacks (default: zeros)

    def _x_like(self):
        if self.x_like is not None:
            return self.x_like()
        return jnp.zeros(self.x_aval.shape, self.x_aval.dtype)

    def forward(self, w, x, mb=None, pre_p=None, post_p=None, first: bool = False, last: bool = False):
        """``(y, residuals, head)``: the stage's output and its stash entries; ``head`` is None except on the
        last stage, where it is ``(value, count, g_post, dy)``: ``post_loss``'s loss (a mean, or a sum with
        its count; :func:`~jaxpipe.model.loss_terms`) and its gradients at ``y``.  ``first``: the input is
        ``pre(pre_p, mb)`` instead of ``x``."""
        m = self.model
        if first:
            x = m.pre(pre_p, mb)
        y, res, _, _ = split_residuals(m.stage_fn, w, x, self.mask)
        if not last:
            return y, res, None
        (value, count), (g_post, dy) = jax.value_and_grad(
            lambda q, v: loss_terms(m.post_loss(q, v, mb)), argnums=(0, 1), has_aux=True)(post_p, y)
        return y, res, (value, count, g_post, dy)

    def backward(self, w, res: List[Any], dy):
        """``(dw, dx)`` of the stage at the weights ``w`` from its stashed residuals."""
        return rebuild_pullback(self.model.stage_fn, w, self._x_like(), res, self.mask)(dy)

    def pre_grad(self, pre_p, mb, dx):
        """The gradient of ``pre``'s parameters for the micro-batch ``mb`` given dL/dx of the first stage."""
        return jax.vjp(lambda q: self.model.pre(q, mb), pre_p)[1](dx)[0]
