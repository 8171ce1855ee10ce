"""Tests run on 8 CPU-emulated devices; the flags must be set before JAX is imported.

The tests check numbers, not speed: XLA's backend optimisation is turned off, which halves compile time
(most of the suite's time is compiling small pipelined programs) and changes results only at float
rounding level.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0"
                           # An emulated device's thread starved by the other worker's processes on 2 shared
                           # cores must not abort the worker at XLA's collective rendezvous deadline.
                           " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the whole run: the pytest-xdist workers and the tests' subprocesses
# (multi-process, README commands) inherit it, and many tests compile the same programs (references, the same
# pipelines in other tests): 159 -> 107 s for tests/test_exactness.py + test_lanes.py from a cold cache
# (BUILD_NOTES, "CI time"). Keyed by XLA on the program, flags and versions; set the variable to move it.
import tempfile  # noqa: E402

import pytest  # noqa: E402

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxpipe-tests-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# A crashed xdist worker (a fatal signal, XLA's abort) prints faulthandler's Python stacks in the middle of the
# run's output, which CI shows only in part: each worker's faulthandler writes to a file instead, and the
# summary prints the file of a worker that went down.
_LOG_DIR = os.environ.setdefault("JAXPIPE_TEST_WORKER_LOGS", os.path.join(tempfile.gettempdir(), "jaxpipe-test-workers"))


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin pointed it at the worker's stderr
def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import faulthandler
        os.makedirs(_LOG_DIR, exist_ok=True)
        name = f"{os.environ['PYTEST_XDIST_TESTRUNUID']}-{os.environ['PYTEST_XDIST_WORKER']}.txt"
        config._jaxpipe_crash_log = open(os.path.join(_LOG_DIR, name), "a")
        faulthandler.enable(file=config._jaxpipe_crash_log, all_threads=True)


_CRASHED = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    if error:
        _CRASHED.append(f"{node.workerinput['testrunuid']}-{node.gateway.id}")


def pytest_terminal_summary(terminalreporter):
    for wid in _CRASHED:
        path = os.path.join(_LOG_DIR, wid + ".txt")
        tail = open(path, errors="replace").read().splitlines()[-80:] if os.path.exists(path) else []
        terminalreporter.section(f"faulthandler of crashed worker {wid} (last {len(tail)} lines of {path})")
        terminalreporter.write_line("\n".join(tail) or "(empty)")
