"""``PipelineModel``: a model cut into ``pre`` -> ``stage_fn`` x num_stages -> ``post_loss`` (DESIGN.md §4)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from .errors import ConfigError


def _default_pre(_, batch):
    if not isinstance(batch, dict) or "x" not in batch:
        raise ConfigError("the default pre(pre_params, batch) returns batch['x'], but the batch has no key "
                          "'x'; pass pre=... to PipelineModel or give the batch an 'x' entry")
    return batch["x"]


@dataclasses.dataclass(frozen=True)
class PipelineModel:
    """A pipelined model.

    stage_fn(params_of_one_stage, x) -> x, the same function on every stage (same output shape as input);
    stage_params: pytree whose leaves carry a leading axis of size num_stages;
    pre(pre_params, batch) -> x (default ``batch["x"]``), run on the first stage;
    post_loss(post_params, x, batch) -> scalar mean loss over the micro-batch, run on the last stage.
    """
    stage_fn: Callable
    stage_params: Any
    pre: Optional[Callable] = None
    pre_params: Any = ()
    post_loss: Optional[Callable] = None
    post_params: Any = ()
    head: Optional[Callable] = None   # optional head(post_params, x) -> outputs (logits), for eval/sampling

    def __post_init__(self):
        if self.pre is None:
            object.__setattr__(self, "pre", _default_pre)
        if self.post_loss is None:
            raise ConfigError("PipelineModel needs post_loss(post_params, x, batch) -> scalar mean loss")
        leaves = jax.tree.leaves(self.stage_params)
        if not leaves:
            raise ConfigError("stage_params has no arrays: give every stage its parameters, stacked on a "
                              "leading axis of size num_stages")
        sizes = {jnp.shape(l)[0] if jnp.ndim(l) else None for l in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ConfigError(f"every stage_params leaf needs the same leading (stage) axis; leading sizes "
                              f"found: {sorted(map(str, sizes))}")

    @property
    def num_stages(self) -> int:
        return int(jnp.shape(jax.tree.leaves(self.stage_params)[0])[0])

    @property
    def params(self):
        return (self.stage_params, self.pre_params, self.post_params)

    def loss(self, params, batch):
        """The unpipelined loss: ``post_loss(post, stage_fn(...stage_fn(pre(batch))), batch)``."""
        stage_p, pre_p, post_p = params
        x = self.pre(pre_p, batch)
        n = jnp.shape(jax.tree.leaves(stage_p)[0])[0]
        for s in range(n):
            x = self.stage_fn(jax.tree.map(lambda a: a[s], stage_p), x)
        return self.post_loss(post_p, x, batch)

    def forward(self, params, batch):
        """Unpipelined activations after the last stage (before ``post_loss``)."""
        stage_p, pre_p, _ = params
        x = self.pre(pre_p, batch)
        for s in range(jnp.shape(jax.tree.leaves(stage_p)[0])[0]):
            x = self.stage_fn(jax.tree.map(lambda a: a[s], stage_p), x)
        return x

    def check_activation(self, x_aval, y_aval):
        if x_aval.shape != y_aval.shape or x_aval.dtype != y_aval.dtype:
            raise ConfigError(f"stage_fn must map an activation to one of the same shape and dtype (it is sent "
                              f"to the next stage): pre gives {x_aval.dtype}{list(x_aval.shape)}, stage_fn "
                              f"returns {y_aval.dtype}{list(y_aval.shape)}")
