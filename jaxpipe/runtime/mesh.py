"""Device meshes with jaxpipe's axes ``("pipe", "data", "stage")``."""
from __future__ import annotations

import jax
from jax.sharding import AxisType

from ..errors import ConfigError
from ..validate import is_int
from ..axes import AXES



def make_mesh(stages: int = 1, data: int = 1, pipes: int = 1, devices=None) -> jax.sharding.Mesh:
    """A mesh of shape (pipes, data, stages) over the first pipes*data*stages devices.

    ``stage`` carries the pipeline, ``data`` replicates it (data parallelism), ``pipe`` holds parallel
    pipelines (AvgPipe).  Axis types are ``Auto``: jaxpipe's programs are explicit ``shard_map``s and the
    optimizer update outside them is left to XLA's sharding propagation.
    """
    for name, v in (("stages", stages), ("data", data), ("pipes", pipes)):
        if not is_int(v, 1):
            raise ConfigError(f"make_mesh: {name} must be a positive integer, got {v!r}")
    devs = list(jax.devices() if devices is None else devices)
    need = pipes * data * stages
    if need > len(devs):
        raise ConfigError(
            f"make_mesh(stages={stages}, data={data}, pipes={pipes}) needs {need} devices but "
            f"{len(devs)} {devs[0].platform.upper()} device(s) are visible. On CPU, emulate more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} set before JAX is imported; or shrink the mesh.")
    return jax.make_mesh((pipes, data, stages), AXES, axis_types=(AxisType.Auto,) * 3, devices=devs[:need])
