"""Reference model 1: a residual MLP stack (Flax NNX), e.g. a digits classifier.

pre: ``Linear(in_dim -> width)``; each stage: ``layers_per_stage`` residual blocks
``h + W2 gelu(W1 LayerNorm(h))``; post: ``LayerNorm -> Linear(width -> classes)`` + softmax cross-entropy.
"""

from __future__ import annotations

import jax
from flax import nnx

from ..model import PipelineModel
from .common import module_apply, softmax_xent, split_pure, stacked_stages


class ResidualBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(self.norm(h))))


class MLPStage(nnx.Module):
    def __init__(self, width: int, layers: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([ResidualBlock(width, rngs) for _ in range(layers)])

    def __call__(self, h):
        for blk in self.blocks:
            h = blk(h)
        return h


class Head(nnx.Module):
    def __init__(self, width: int, classes: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.out = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, h):
        return self.out(self.norm(h))


def residual_mlp(
    num_stages: int, in_dim: int, num_classes: int, width: int = 64, layers_per_stage: int = 1, seed: int = 0
) -> PipelineModel:
    """A residual MLP classifier on ``batch = {"x": float[B, in_dim], "y": int[B]}``; ``model.head`` gives
    logits.

    Args:
        num_stages: model stages.
        in_dim: input features.
        num_classes: classes of ``y``.
        width: the hidden width.
        layers_per_stage: residual layers on every stage.
        seed: the parameters' seed.

    Returns:
        The :class:`~jaxpipe.PipelineModel`.
    """
    stage_fn, stage_params = stacked_stages(lambda r: MLPStage(width, layers_per_stage, r), num_stages, seed)
    emb_def, emb_params = split_pure(nnx.Linear(in_dim, width, rngs=nnx.Rngs(seed * 1000)))
    head_def, head_params = split_pure(Head(width, num_classes, nnx.Rngs(seed * 1000 + 999)))
    embed, head = module_apply(emb_def), module_apply(head_def)
    return PipelineModel(
        stage_fn=stage_fn,
        stage_params=stage_params,
        pre=lambda p, b: embed(p, b["x"]),
        pre_params=emb_params,
        post_loss=lambda p, h, b: softmax_xent(head(p, h), b["y"]),
        post_params=head_params,
        head=head,
        integer_inputs={"y": num_classes},
    )
