"""jaxpipe: pipeline-parallel training in JAX -- every method one ``shard_map`` program over a device mesh.

    import jaxpipe as jp, optax
    model = jp.PipelineModel(stage_fn=..., stage_params=..., pre=..., pre_params=...,
                             post_loss=..., post_params=...)
    pipe = jp.Pipeline(model, schedule="1f1b", num_microbatches=8, optimizer=optax.adamw(1e-3),
                       mesh=jp.make_mesh(stages=4, data=1))
    state = pipe.init()
    state, metrics = pipe.step(state, batch)
    result = jp.train(pipe, batches, steps=1000, checkpoint_dir="ckpt")  # the loop: checkpoints, stops

``jaxpipe.schedules`` (the schedule IR, simulator and pictures) never imports JAX; the rest is loaded on
first use.
"""

import importlib

from . import schedules
from .errors import ConfigError

__version__ = "0.1.0"

_LAZY = {
    "Pipeline": ("pipeline", "Pipeline"),
    "PipelineState": ("pipeline", "PipelineState"),
    "PipelineModel": ("model", "PipelineModel"),
    "CyclicDataParallel": ("cyclic", "CyclicDataParallel"),
    "Checkpointer": ("checkpoint", "Checkpointer"),
    "stack_stages": ("model", "stack_stages"),
    "StageContext": ("model", "StageContext"),
    "Precision": ("precision", "Precision"),
    "with_precision": ("precision", "with_precision"),
    "microbatch_key": ("model", "microbatch_key"),
    "distributed": ("distributed", None),
    "diagnose": ("checks.diagnose", None),
    "make_mesh": ("runtime.mesh", "make_mesh"),
    "models": ("models", None),
    "data": ("data", None),
    "optim": ("optim", None),
    "runtime": ("runtime", None),
    "tune": ("tune", None),
    "host_memory": ("host_memory", None),
    "training": ("training", None),
    "train": ("training.loop", "train"),
    "Trainer": ("training.loop", "Trainer"),
    "configure": ("tune.configure", "configure"),
    "save_params": ("checkpoint", "save_params"),
}

__all__ = [
    "Checkpointer",
    "ConfigError",
    "CyclicDataParallel",
    "Pipeline",
    "PipelineModel",
    "PipelineState",
    "Precision",
    "StageContext",
    "data",
    "make_mesh",
    "microbatch_key",
    "models",
    "optim",
    "with_precision",
    "train",
    "Trainer",
    "training",
    "configure",
    "schedules",
    "tune",
    "save_params",
]


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        m = importlib.import_module(f".{mod}", __name__)
        value = m if attr is None else getattr(m, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxpipe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
