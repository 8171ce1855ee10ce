"""Mixed precision, in the spirit of jmp / Flax's ``dtype`` and ``param_dtype`` arguments.

A :class:`Precision` policy says in which dtype parameters are kept (``params``: the master copy the optimizer
updates), in which the stages compute (``compute``: parameters are cast to it inside ``pre``, ``stage_fn`` and
``post_loss``; activations between stages -- the messages and the stash -- are in it), and in which the
loss comes out (``output``).  :func:`with_precision` turns a model into one that follows the policy; because
the casts are inside the model's functions, every schedule and executor runs it unchanged, and gradients come
back in the parameters' dtype (the transpose of a cast casts back), accumulated there: float32 master weights
mean float32 gradient accumulation.  ``Pipeline(..., precision=Precision(...))`` applies it.

Only floating-point leaves are cast; integer inputs (token ids, labels) are left alone.  Static loss scaling
(``loss_scale``, for float16) multiplies the loss before differentiation and divides the gradients after,
in the synchronous schedules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .errors import ConfigError


def _dtype(name, what):
    try:
        d = jnp.dtype(name)
    except TypeError:
        raise ConfigError(
            f"Precision({what}={name!r}): not a dtype; use 'float32', 'bfloat16' or 'float16'"
        ) from None
    if not jnp.issubdtype(d, jnp.floating):
        raise ConfigError(f"Precision({what}={name!r}): must be a floating-point dtype")
    return d


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy (module docstring).

    Dtypes are names or numpy dtypes, floating point only.

    Attributes:
        params: the dtype of the master copy the optimizer updates (and of the gradients).
        compute: the stages' dtype: parameters are cast to it inside the model's functions, and
            activations, messages and the stash are in it.
        output: the loss's dtype.
        loss_scale: static loss scaling: the loss multiplied before differentiation and the gradients
            divided after (synchronous schedules; float16 needs it: without one it is refused)."""

    params: Any = "float32"  # the master copy the optimizer updates (and the gradients' dtype)
    compute: Any = "float32"  # stage computation, activations sent between stages, the stash
    output: Any = "float32"  # the loss
    loss_scale: float = 1.0  # static loss scaling (synchronous schedules; float16 needs it)

    def __post_init__(self):
        for f in ("params", "compute", "output"):
            object.__setattr__(self, f, _dtype(getattr(self, f), f))
        if isinstance(self.loss_scale, bool) or not (
            isinstance(self.loss_scale, (int, float)) and self.loss_scale > 0
        ):
            raise ConfigError(
                f"Precision(loss_scale={self.loss_scale!r}): give a positive number (e.g. 2**12)"
            )
        if jnp.float16 in (self.compute, self.params) and self.loss_scale == 1:
            # float16 has 5 exponent bits: gradients below 6e-8 flush to zero (47% of a small GPT's, measured)
            raise ConfigError(
                f"Precision(params={self.params.name!r}, compute={self.compute.name!r}) without a loss "
                "scale: "
                f"float16 flushes gradients below 6e-8 to zero (about half of a small GPT's). Give a static "
                "loss_scale, e.g. Precision(compute='float16', loss_scale=2**12) (synchronous schedules), "
                "or "
                f"use compute='bfloat16', which has float32's range and needs none"
            )


def cast_floats(tree, dtype):
    """Floating-point leaves of ``tree`` cast to ``dtype``; others unchanged."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a, tree
    )


def with_precision(model, policy: Precision):
    """The model with its parameters stored in ``policy.params`` and computing in ``policy.compute``.

    Args:
        model: a :class:`~jaxpipe.PipelineModel`.
        policy: the :class:`Precision` to apply.

    Returns:
        A new :class:`~jaxpipe.PipelineModel`; ``Pipeline(precision=...)`` applies it for you."""
    c, o = policy.compute, policy.output
    stage_fn, pre, post_loss, head = model.stage_fn, model.pre, model.post_loss, model.head

    if model.context:
        new_stage = lambda w, x, ctx: stage_fn(cast_floats(w, c), x, ctx)
    else:
        new_stage = lambda w, x: stage_fn(cast_floats(w, c), x)

    def new_post(p, x, b):
        out = post_loss(cast_floats(p, c), x, b)
        return cast_floats(out, o)

    return dataclasses.replace(
        model,
        stage_fn=new_stage,
        stage_params=cast_floats(model.stage_params, policy.params),
        pre=lambda p, b: cast_floats(pre(cast_floats(p, c), b), c),
        pre_params=cast_floats(model.pre_params, policy.params),
        post_loss=new_post,
        post_params=cast_floats(model.post_params, policy.params),
        head=None if head is None else (lambda p, x: head(cast_floats(p, c), x)),
    )
