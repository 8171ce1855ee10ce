"""Optimizers and weight policies (optax-wrapped transforms, docs/design.md §4).

The synchronous schedules use the ``sync`` policy: one weight version, gradients accumulated over the
micro-batches of a step, one update of the user's optax optimizer.
"""
from __future__ import annotations

import optax

from ..errors import ConfigError

OPTIMIZERS = {
    "sgd": lambda lr: optax.sgd(lr),
    "momentum": lambda lr: optax.sgd(lr, momentum=0.9),
    "adam": lambda lr: optax.adam(lr),
    "adamw": lambda lr: optax.adamw(lr, weight_decay=1e-4),
}


def by_name(name: str, learning_rate: float) -> optax.GradientTransformation:
    """``sgd``, ``momentum`` (SGD with momentum 0.9), ``adam`` or ``adamw`` at ``learning_rate``."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](learning_rate)
