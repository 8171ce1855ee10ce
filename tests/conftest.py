"""Tests run on 8 CPU-emulated devices; the flags must be set before JAX is imported.

The tests check numbers, not speed: XLA's backend optimisation is turned off, which halves compile time
(most of the suite's time is compiling small pipelined programs) and changes results only at float
rounding level.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
