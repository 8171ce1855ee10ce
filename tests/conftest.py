"""Tests run on 8 CPU-emulated devices; the flags must be set before JAX is imported.

The tests check numbers, not speed: XLA's backend optimisation is turned off, which halves compile time
(most of the suite's time is compiling small pipelined programs) and changes results only at float
rounding level.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the whole run: the pytest-xdist workers and the tests' subprocesses
# (multi-process, README commands) inherit it, and many tests compile the same programs (references, the same
# pipelines in other tests): 159 -> 107 s for tests/test_exactness.py + test_lanes.py from a cold cache
# (BUILD_NOTES, "CI time"). Keyed by XLA on the program, flags and versions; set the variable to move it.
import tempfile  # noqa: E402

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxpipe-tests-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
