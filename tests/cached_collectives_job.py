"""One process of a two-process CPU job whose programs come from JAX's persistent compilation cache on a
second run: ``python tests/cached_collectives_job.py PROCESS_ID PORT CACHE_DIR``.  The cache is set before the
job is joined, as ``jaxpipe``'s commands set it (``--compilation_cache_dir``); then a ring ``ppermute`` and a
``psum`` over the 2 x 2 devices run three times, and ``done`` is printed.  With jaxlib 0.12 a second run
loaded its programs from the cache and hung in the first collective, until
:func:`jaxpipe.distributed.no_cached_programs_where_they_deadlock`."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxpipe import distributed  # noqa: E402


def main(process_id: int, port: str, cache_dir: str) -> None:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    distributed.initialize(f"127.0.0.1:{port}", 2, process_id, timeout_s=30)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def body(w, h):
        h = lax.ppermute(jnp.tanh(h @ w), "x", ring)
        return lax.psum(jnp.sum(h), "x")[None]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P("x"), check_vma=False))
    replicated = NamedSharding(mesh, P())
    w = jax.device_put(jnp.ones((16, 16)) / 16, replicated)
    x = jax.device_put(jnp.ones((4, 16)), replicated)
    for _ in range(3):
        jax.block_until_ready(step(w, x))
    print("cache", jax.config.jax_compilation_cache_dir, flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
