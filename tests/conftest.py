"""Tests run on 8 CPU-emulated devices; the flags must be set before JAX is imported.

The tests check numbers, not speed: XLA's backend optimisation is turned off, which halves compile time
(most of the suite's time is compiling small pipelined programs) and changes results only at float
rounding level.
"""

import os

#: JAXPIPE_TEST_XLA_OPTIMISED=1 keeps XLA's backend optimisation on (tests/test_optimised_builds.py runs a
#: sample of the suite that way: the comparisons across different compiled programs must hold there too)
_OPT = "" if os.environ.get("JAXPIPE_TEST_XLA_OPTIMISED") == "1" else " --xla_backend_optimization_level=0"


def _legacy_emitters_flag() -> str:
    """XLA CPU's fusion kernels from its LLVM IR emitters instead of the MLIR fusion emitters, where the
    installed jaxlib still has the choice (0.10: yes; 0.12: no -- and an unknown flag in XLA_FLAGS aborts): a
    cold compile of a test's pipelined step takes a third less (BUILD_NOTES, "The CPU backend"; the same
    numbers to float rounding, compared within one process as the optimisation level is).  Probed once per run
    in a subprocess; the result travels to pytest-xdist's workers and the tests' subprocesses in the
    environment."""
    key = "JAXPIPE_TEST_LEGACY_EMITTERS"
    if key not in os.environ:
        import subprocess
        import sys

        flag = "--xla_cpu_use_fusion_emitters=false"
        env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
        try:
            ok = (
                subprocess.run(
                    [sys.executable, "-c", "import jax; jax.devices()"],
                    env=env,
                    timeout=120,
                    capture_output=True,
                ).returncode
                == 0
            )
        except (OSError, subprocess.SubprocessError):
            ok = False
        os.environ[key] = flag if ok else ""
    return (" " + os.environ[key]) if os.environ[key] else ""


if _OPT:
    _OPT += _legacy_emitters_flag()
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + _OPT
    +
    # An emulated device's thread starved by the other worker's processes on 2 shared
    # cores must not abort the worker at XLA's collective rendezvous deadline.
    " --xla_cpu_collective_call_terminate_timeout_seconds=600"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the whole run: the pytest-xdist workers and the tests' subprocesses
# (multi-process, README commands) inherit it, and many tests compile the same programs (references, the same
# pipelines in other tests): 159 -> 107 s for tests/test_exactness.py + test_lanes.py from a cold cache
# (BUILD_NOTES, "Tests and CI"). Keyed by XLA on the program, flags and versions; set the variable to move it.
import re  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxpipe-tests-xla-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# the balanced cut's measured costs (jaxpipe.cuts.part_costs) beside it, not in the user's ~/.cache
os.environ.setdefault("JAXPIPE_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxpipe-tests-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Pipelines rank their plans at unit costs instead of measuring op costs at their first step: the same
# programs on every run and worker, and no probe compiled for each of the suite's pipelines.
# tests/test_running_costs.py runs the measured default itself.
os.environ.setdefault("JAXPIPE_OP_COSTS", "unit")

# A crashed xdist worker (a fatal signal, XLA's abort) loses what it printed: pytest's per-test fd capture
# keeps it in an unnamed temporary file.  So the tests capture at the sys level (pyproject: addopts =
# "--capture=sys"), each worker points its file descriptor 2 -- XLA's C++ log (a rendezvous "may be stuck"
# warning, a failed CHECK, the termination message) and faulthandler's stacks -- at a file of its own, and the
# summary prints the file of a worker that went down, and XLA's stuck-rendezvous warnings from any worker.
_LOG_DIR = os.environ.setdefault(
    "JAXPIPE_TEST_WORKER_LOGS", os.path.join(tempfile.gettempdir(), "jaxpipe-test-workers")
)
_NOTABLE = re.compile(r"^[FE]\d{4} |stuck|Check failed|[Tt]ermination|rendezvous|Fatal|terminate called")


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin pointed it at the worker's stderr
def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import faulthandler

        os.makedirs(_LOG_DIR, exist_ok=True)
        name = f"{os.environ['PYTEST_XDIST_TESTRUNUID']}-{os.environ['PYTEST_XDIST_WORKER']}.txt"
        config._jaxpipe_crash_log = open(os.path.join(_LOG_DIR, name), "a", buffering=1)
        if config.getoption("capture") == "sys":
            os.dup2(config._jaxpipe_crash_log.fileno(), 2)
        faulthandler.enable(file=config._jaxpipe_crash_log, all_threads=True)


_CRASHED, _WORKER_LOGS = [], set()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    _WORKER_LOGS.add(f"{node.workerinput['testrunuid']}-{node.gateway.id}.txt")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    if error:
        _CRASHED.append(f"{node.workerinput['testrunuid']}-{node.gateway.id}.txt")


def _read(name):
    path = os.path.join(_LOG_DIR, name)
    return open(path, errors="replace").read().splitlines() if os.path.exists(path) else []


def pytest_terminal_summary(terminalreporter):
    for name in _CRASHED:
        lines = _read(name)
        notable = [ln for ln in lines if _NOTABLE.search(ln)][:40]
        terminalreporter.section(
            f"crashed worker: {os.path.join(_LOG_DIR, name)} ({len(lines)} lines); its "
            "notable lines, then the last 60"
        )
        terminalreporter.write_line("\n".join(notable + ["..."] + lines[-60:]) if lines else "(empty)")
    stuck = [f"{name}: {ln}" for name in sorted(_WORKER_LOGS) for ln in _read(name) if "stuck" in ln]
    if stuck:
        terminalreporter.section(f"XLA rendezvous warnings in the worker logs ({len(stuck)}, first 20)")
        terminalreporter.write_line("\n".join(stuck[:20]))


# NaN mode is on in every test (issue #33 item 3): a Pipeline or CyclicDataParallel made without an explicit
# ``nan_bubbles=`` starts its buffers as NaN and sends NaN on idle ticks, so every exactness test is also a
# leak test.  A test that needs the default off says ``nan_bubbles=False``; JAXPIPE_TEST_NAN_BUBBLES=0 turns
# it off.
def _nan_by_default(cls):
    import functools

    init = cls.__init__

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        kwargs.setdefault("nan_bubbles", True)
        return init(self, *args, **kwargs)

    cls.__init__ = wrapped


# A call's on-device checks are read when the host would otherwise wait: up to IN_FLIGHT (2) calls later
# (issue #51).  The suite reads each at the next call (IN_FLIGHT = 1), so that a test of a refused step knows
# which call reports it; tests/test_host_ahead.py runs the default.  JAXPIPE_TEST_IN_FLIGHT=N sets another.
import jaxpipe.checks.on_device as _step_checks  # noqa: E402

_step_checks.IN_FLIGHT = int(os.environ.get("JAXPIPE_TEST_IN_FLIGHT", "1"))


if os.environ.get("JAXPIPE_TEST_NAN_BUBBLES", "1") != "0":
    import jaxpipe as _jp  # noqa: E402

    _nan_by_default(_jp.Pipeline)
    _nan_by_default(_jp.CyclicDataParallel)


# JAXPIPE_TEST_TIMES=FILE: each phase's wall time (setup, call, teardown) of every test appended to FILE as it
# finishes, one "seconds<TAB>phase<TAB>node id" line (by the xdist controller, which sees every report): the
# data for sizing CI's two legs (BUILD_NOTES, "Tests and CI"), readable while the run goes on and kept if it
# is stopped.
_TIMES = os.environ.get("JAXPIPE_TEST_TIMES")


def pytest_runtest_logreport(report):
    if _TIMES and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller sees every worker's reports
        with open(_TIMES, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.nodeid}\n")


# ``-n auto`` on a machine of up to four cores starts one worker more than the cores (xdist's default: as
# many): a worker waits often -- on its subprocesses' start and jax.distributed's rendezvous, a launcher's
# signal timeouts, the persistent cache's files -- and the extra one runs meanwhile.  On 2 cores the full
# suite kept 1.85 cores busy with two workers; four heavy files (uneven cuts, stop signals, multi-host,
# launcher faults), cold: 199.7 s with two workers, 179.7 s with three (BUILD_NOTES, "Tests and CI").
# PYTEST_XDIST_AUTO_NUM_WORKERS still overrides it.
@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a run with -p no:xdist has no such hook
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores + 1 if cores <= 4 else cores


# CI's second leg (the newest JAX, .ci/run) runs a sample of the suite, to stay within CI's hour beside the
# first leg's full run: JAXPIPE_TEST_SAMPLE=k keeps every k-th test of each test file in collection order (the
# file's first test always, so every file runs), starting from JAXPIPE_TEST_SAMPLE_OFFSET (default: the UTC
# day number mod k, so k days of CI runs cover the whole suite on the newest releases), and leaves out the
# tests marked ``ci_once`` (process and file handling, the optimised-build and planted-bug samples: jaxpipe's
# own machinery, which the first leg runs); a test marked ``every_leg`` (a claim that must hold on every JAX
# CI tests) is always kept.  Unset or 1: everything.  Test ids named on the command line are all kept.
@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    _mark_quick(config, items)
    _sample(config, items)


def _mark_quick(config, items):
    """The quick tier (``-m quick``, tests/quick_tier.py): its files and tests get the ``quick`` marker.
    Where whole files were collected, a test the tier names in one of them that no collected test is, is an
    error: a renamed test is renamed in the tier too, never silently dropped from it."""
    import quick_tier

    files, tests = set(quick_tier.FILES), set(quick_tier.TESTS)
    for item in items:
        if item.nodeid in tests or item.nodeid.split("::")[0] in files:
            item.add_marker(pytest.mark.quick)
    if any("::" in a for a in config.args) or config.option.keyword:
        return
    ids = {item.nodeid for item in items}
    collected = {i.split("::")[0] for i in ids}
    stale = sorted(t for t in tests if t.split("::")[0] in collected and t not in ids)
    if stale:
        raise pytest.UsageError(
            "tests/quick_tier.py names tests that do not exist (renamed? rename them there "
            "too): " + ", ".join(stale)
        )


def _sample(config, items):
    import datetime

    k = int(os.environ.get("JAXPIPE_TEST_SAMPLE", "1") or 1)
    if k <= 1 or any("::" in a for a in config.args):
        return
    offset = int(
        os.environ.get(
            "JAXPIPE_TEST_SAMPLE_OFFSET", datetime.datetime.now(datetime.timezone.utc).toordinal() % k
        )
    )
    seen, keep, dropped = {}, [], []
    for item in items:
        f = item.nodeid.split("::")[0]
        i = seen[f] = seen.get(f, -1) + 1
        chosen = i == 0 or (i - offset) % k == 0 or item.get_closest_marker("every_leg") is not None
        (keep if chosen and not item.get_closest_marker("ci_once") else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = keep
