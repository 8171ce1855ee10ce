"""Reference models (Flax NNX): a residual MLP stack and a small GPT-style byte LM; adapters for models
written as Flax modules elsewhere (``from_nnx``, ``from_linen``)."""

from .adapters import from_linen, from_nnx
from .gpt import gpt, sample
from .mlp import residual_mlp

__all__ = ["from_linen", "from_nnx", "gpt", "residual_mlp", "sample"]
