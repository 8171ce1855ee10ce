"""Reference models (Flax NNX): a residual MLP stack and a small GPT-style byte LM."""
from .gpt import gpt, sample
from .mlp import residual_mlp

__all__ = ["gpt", "residual_mlp", "sample"]
