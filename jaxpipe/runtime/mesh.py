"""Device meshes with jaxpipe's axes ``("pipe", "data", "stage")`` and, where asked, the model axes
``("fsdp", "tensor")``."""

from __future__ import annotations

import jax
from jax.sharding import AxisType

from ..errors import ConfigError
from ..checks.values import is_int
from ..axes import AXES, FSDP, TENSOR


def make_mesh(
    stages: int = 1, data: int = 1, pipes: int = 1, fsdp: int = 1, tensor: int = 1, devices=None
) -> jax.sharding.Mesh:
    """A device mesh for a pipeline: axes ``(pipe, data, stage)``, then the model axes ``fsdp`` and ``tensor``
    where either is above 1.

    ``stage`` carries the pipeline, ``data`` replicates it (data parallelism), ``pipe`` holds parallel
    pipelines (AvgPipe); ``fsdp`` and ``tensor`` are *model axes*: a stage's weights are sharded over them
    as the model's ``param_specs`` say, and XLA partitions the stage's computation (jaxpipe's programs are
    manual over the pipeline axes only). Axis types are ``Auto``: the optimizer update outside the programs
    is left to XLA's sharding propagation.

    Args:
        stages: devices on the ``stage`` axis (the pipeline's depth D).
        data: data-parallel replicas of the pipeline.
        pipes: parallel pipelines (AvgPipe's N); 1 for every other method.
        fsdp: devices a stage's weights and the batch are sharded over (FSDP) inside each stage.
        tensor: devices a stage's weights are split over (tensor parallelism) inside each stage.
        devices: the devices to use, in order (default: the first ``pipes * data * stages * fsdp * tensor``
            of ``jax.devices()``).

    Returns:
        A ``jax.sharding.Mesh`` of shape ``(pipes, data, stages)``, or ``(pipes, data, stages, fsdp,
        tensor)`` where either model axis is above 1.

    Raises:
        ConfigError: a size that is not a positive integer, a device listed twice, or more devices asked
            for than are visible (the message gives the ``XLA_FLAGS`` that emulates them on CPU)."""
    sizes = {"stages": stages, "data": data, "pipes": pipes, "fsdp": fsdp, "tensor": tensor}
    for name, v in sizes.items():
        if not is_int(v, 1):
            raise ConfigError(f"make_mesh: {name} must be a positive integer, got {v!r}")
    devs = list(jax.devices() if devices is None else devices)
    seen = set()
    twice = [d for d in devs if d in seen or seen.add(d)]
    if twice:
        raise ConfigError(
            f"make_mesh(devices=...): {twice[0]} is listed {devs.count(twice[0])} times; each device "
            f"can hold one place of the mesh -- give distinct devices"
        )
    need = pipes * data * stages * fsdp * tensor
    if need > len(devs):
        given = ", ".join(f"{k}={v}" for k, v in sizes.items() if v != 1 or k == "stages")
        raise ConfigError(
            f"make_mesh({given}) needs {need} devices but "
            f"{len(devs)} {devs[0].platform.upper()} device(s) are visible. On CPU, emulate more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} set before JAX is imported; or shrink "
            "the mesh."
        )
    shape, names = (pipes, data, stages), AXES
    if fsdp > 1 or tensor > 1:
        shape, names = shape + (fsdp, tensor), AXES + (FSDP, TENSOR)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devs[:need])
