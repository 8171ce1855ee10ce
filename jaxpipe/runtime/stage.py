"""One stage's forward and backward, written once (docs/design.md §2).

The one executor (:mod:`.executor`: every method, flushing or not) runs the same three pieces of model code
through :class:`StageOps`:

* ``forward``: ``pre`` on the first stage, ``jax.vjp(stage_fn)`` split into the residuals to stash (those
  that depend on the activation; see :func:`~jaxpipe.runtime.residuals.residual_mask`) and the rest, and on
  the last stage ``post_loss`` with its gradient (the loss, the head's gradient and dL/dy);
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
from .residuals import rebuild_pullback, residual_mask, split_residuals


def stage_residuals(model, weights, x, microbatch):
    """``(mask, stashed avals)`` of the model's stage (:func:`~jaxpipe.runtime.residuals.residual_mask`, with
    the stage context of the micro-batch ``mb`` counted as per-micro-batch input)."""
    return residual_mask(model.stage_fn, weights, x, model.example_context(microbatch))


@dataclasses.dataclass(frozen=True)
class StageOps:
    model: Any  # the PipelineModel (stage_fn, pre, post_loss)
    mask: Sequence[bool]  # which pullback leaves are stashed (residual_mask)
    x_aval: Any  # the activation's shape and dtype
    x_like: Optional[Callable] = None  # a dummy activation for rebuilding pullbacks (default: zeros)
    ctx_aval: Any = None  # the stage context's shapes (context models)
    zeros: Optional[Callable] = None  # (shape, dtype) -> a dummy array (default jnp.zeros)
    mark: Optional[Callable] = None  # marks values device-varying (for check_vma programs; default: none)

    @classmethod
    def build(cls, model, weights, x, microbatch, x_like=None, zeros=None, mark=None):
        """Analyse the stage at weights ``w``, activation ``x`` and micro-batch ``mb`` (inside the program:
        how many residuals a pullback has can depend on it); returns ``(ops, stashed residual avals)``."""
        ctx = model.example_context(microbatch)
        mask, avals = residual_mask(model.stage_fn, weights, x, ctx)
        ctx_aval = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype), ctx)
        x_aval = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype), x)
        return cls(model, mask, x_aval, x_like, ctx_aval, zeros, mark), avals

    def _zeros(self, aval):
        if self.zeros is not None:
            return self.zeros(aval.shape, aval.dtype)
        return jnp.zeros(aval.shape, aval.dtype)

    def _x_like(self):
        if self.x_like is not None:
            return self.x_like()
        return jax.tree.map(self._zeros, self.x_aval)

    def context(self, microbatch, mb_key, stage):
        """The stage context of model stage ``stage`` for micro-batch ``mb`` with key ``mb_key`` (None for a
        context-free model)."""
        if not self.model.context:
            return None
        return self.model.stage_context(microbatch, mb_key, stage)

    def forward(
        self,
        weights,
        x,
        microbatch=None,
        pre_p=None,
        post_p=None,
        first: bool = False,
        last: bool = False,
        context=None,
    ):
        """``(y, residuals, head)``: the stage's output and its stash entries; ``head`` is None except on the
        last stage, where it is ``(value, count, g_post, dy)``: ``post_loss``'s loss (a mean, or a sum with
        its count; :func:`~jaxpipe.model.loss_terms`) and its gradients at ``y``.  ``first``: the input is
        ``pre(pre_p, mb)`` instead of ``x``.  ``ctx``: the stage context (context models)."""
        m = self.model
        if first:
            x = m.pre(pre_p, microbatch)
        if m.context and context is None:
            raise RuntimeError("a context model's stage needs its StageContext (executor bug)")
        y, res, _, _ = split_residuals(m.stage_fn, weights, x, self.mask, context if m.context else None)
        if self.mark is not None:  # residuals of the context (a stage index, a key) vary like the rest
            res = [self.mark(r) for r in res]
        if not last:
            return y, res, None
        return y, res, self.head(post_p, y, microbatch)

    def head(self, post_p, y, microbatch):
        """``(value, count, g_post, dy)`` of ``post_loss`` at the last stage's output ``y``."""
        (value, count), (g_post, dy) = jax.value_and_grad(
            lambda q, value: loss_terms(self.model.post_loss(q, value, microbatch)),
            argnums=(0, 1),
            has_aux=True,
        )(post_p, y)
        return value, count, g_post, dy

    def backward(self, weights, residuals: List[Any], cotangent):
        """``(dw, dx)`` of the stage at the weights ``w`` from its stashed residuals."""
        ctx_like = None
        if self.model.context:
            ctx_like = jax.tree.map(self._zeros, self.ctx_aval)
        return rebuild_pullback(self.model.stage_fn, weights, self._x_like(), residuals, self.mask, ctx_like)(
            cotangent
        )

    def pre_grad(self, pre_p, microbatch, dx):
        """The gradient of ``pre``'s parameters for the micro-batch ``mb`` given dL/dx of the first stage."""
        # a leaf of pre's output that depends on nothing varying (a constant initial state) must be marked
        # varying like its cotangent; it has no path to q, so the mark's transpose is never evaluated
        mark = self.mark or (lambda tree: tree)
        return jax.vjp(lambda q: mark(self.model.pre(q, microbatch)), pre_p)[1](dx)[0]
