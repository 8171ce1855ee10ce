"""The mesh's axis names, defined once (pure Python).

Pipeline axes -- manual inside jaxpipe's programs: ``pipe`` holds parallel pipelines (AvgPipe), ``data``
replicates a pipeline (data parallelism; CyclicDataParallel's workers), ``stage`` carries the pipeline.
Every other axis of a mesh is a *model axis* (``fsdp``, ``tensor``, or a user's own): left to XLA's SPMD
partitioner inside the stages, sharding a stage's weights the way its ``param_specs`` say."""

from math import prod

PIPE, DATA, STAGE = "pipe", "data", "stage"
AXES = (PIPE, DATA, STAGE)
DP_AXES = (PIPE, DATA)
FSDP, TENSOR = "fsdp", "tensor"


def model_axes(mesh):
    """The mesh's model axes (every axis but the pipeline's), in mesh order."""
    return tuple(a for a in mesh.axis_names if a not in AXES)


def pipeline_devices(mesh) -> int:
    """Devices along the pipeline axes: one in-flight state per such device (model axes share it)."""
    return prod(mesh.shape[a] for a in AXES)


def manual(mesh):
    """``jax.shard_map``'s keyword for jaxpipe's programs: manual over the pipeline axes only where the mesh
    has model axes (XLA partitions those inside), else every axis (the program as without model axes)."""
    return {"axis_names": frozenset(AXES)} if model_axes(mesh) else {}
