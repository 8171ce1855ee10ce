"""Executors: the shard_map programs that run schedule tables on a mesh."""

from .gradient import make_grad_fn
from .mesh import make_mesh

__all__ = ["make_grad_fn", "make_mesh"]
