"""Training a :class:`~jaxpipe.Pipeline` for many steps: :func:`train` / :class:`Trainer` (checkpoints and
resume, preemption and stop signals, non-finite losses, evaluation, progress, metrics and TensorBoard),
the stop protocol (:mod:`.stopping`) and resumable batch streams (:mod:`.streams`).  Importing this package
does not import JAX; the loop does when it runs."""

import importlib

_LAZY = {
    "train": "loop",
    "Trainer": "loop",
    "TrainOptions": "loop",
    "TrainResult": "loop",
    "NonFiniteLoss": "loop",
    "STOPPED_EXIT": "loop",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxpipe.training' has no attribute {name!r}")
