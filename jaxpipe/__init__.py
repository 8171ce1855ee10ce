"""jaxpipe: pipeline-parallel training in JAX -- every method one ``shard_map`` program over a device mesh.

    import jaxpipe as jp, optax
    model = jp.PipelineModel(stage_fn=..., stage_params=..., pre=..., pre_params=..., post_loss=..., post_params=...)
    pipe = jp.Pipeline(model, schedule="1f1b", num_microbatches=8, optimizer=optax.adamw(1e-3),
                       mesh=jp.make_mesh(stages=4, data=1))
    state = pipe.init()
    state, metrics = pipe.step(state, batch)
"""
from . import schedules
from . import data, models, optim
from .errors import ConfigError
from .model import PipelineModel
from .pipeline import Pipeline, PipelineState
from .runtime.mesh import make_mesh

__version__ = "0.1.0"

__all__ = ["ConfigError", "Pipeline", "PipelineModel", "PipelineState", "make_mesh", "schedules"]
