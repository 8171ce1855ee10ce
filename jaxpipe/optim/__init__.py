"""Optimizers and weight policies (optax-wrapped transforms, docs/design.md §4).

The synchronous schedules use the ``sync`` policy: one weight version, gradients accumulated over the
micro-batches of a step, one update of the user's optax optimizer.
"""

from __future__ import annotations

import jax
import optax

from ..errors import ConfigError

OPTIMIZERS = {
    "sgd": lambda lr: optax.sgd(lr),
    "momentum": lambda lr: optax.sgd(lr, momentum=0.9),
    "adam": lambda lr: optax.adam(lr),
    "adamw": lambda lr: optax.adamw(lr, weight_decay=1e-4),
}


def by_name(name: str, learning_rate: float) -> optax.GradientTransformation:
    """An optimizer by name.

    Args:
        name: ``sgd``, ``momentum`` (SGD with momentum 0.9), ``adam`` or ``adamw`` (weight decay 1e-4).
        learning_rate: a number or an optax schedule.

    Returns:
        The optax transformation.

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](learning_rate)


def _warmup(peak: float, warm: int):
    return optax.linear_schedule(0.0, peak, warm)


#: learning-rate schedules by name: ``(peak, steps, warm) -> optax schedule``, each a linear warm-up from 0
#: over ``warm`` steps, then: ``cosine`` decay to 0, ``linear`` decay to 0, ``rsqrt`` (peak sqrt(warm / step),
#: the Transformer paper's) or ``constant``
SCHEDULES = {
    "cosine": lambda peak, steps, warm: optax.warmup_cosine_decay_schedule(
        0.0, peak, warm, max(steps, warm + 1)
    ),
    "linear": lambda peak, steps, warm: optax.join_schedules(
        [_warmup(peak, warm), optax.linear_schedule(peak, 0.0, max(steps - warm, 1))], [warm]
    ),
    "rsqrt": lambda peak, steps, warm: optax.join_schedules(
        [_warmup(peak, warm), lambda n: peak * jax.lax.rsqrt((n + warm) / warm)], [warm]
    ),
    "constant": lambda peak, steps, warm: optax.join_schedules(
        [_warmup(peak, warm), optax.constant_schedule(peak)], [warm]
    ),
}


def schedule_by_name(name: str, peak: float, steps: int, warmup: float = 0.05) -> optax.Schedule:
    """A learning-rate schedule of :data:`SCHEDULES`: a linear warm-up from 0, then the named decay.

    Args:
        name: ``cosine``, ``linear``, ``rsqrt`` or ``constant``.
        peak: the learning rate at the end of the warm-up.
        steps: the updates the schedule spans.
        warmup: a fraction of ``steps`` if below 1, else a number of steps; at least one step.

    Returns:
        The optax schedule.

    Raises:
        ConfigError: an unknown name, or a warm-up that is neither a fraction nor a whole number of steps.
    """
    if name not in SCHEDULES:
        raise ConfigError(f"unknown learning-rate schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if warmup < 0 or (warmup >= 1 and warmup != int(warmup)):
        raise ConfigError(f"warmup={warmup!r}: a fraction of the steps in [0, 1) or a whole number of steps")
    warm = max(1, int(warmup * steps + 1e-9) if warmup < 1 else int(warmup))  # 5%: steps // 20
    return SCHEDULES[name](peak, steps, warm)
