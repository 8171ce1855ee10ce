"""The suite runs with XLA's backend optimisation off (conftest: half the compile time).  Comparisons across
different compiled programs -- the fused against the split backward, balanced against direct broadcast,
AvgPipe's advance 0 against 3, Chimera's two replicas, a pipeline against its independent reference -- must
hold in an optimised build too, where XLA fuses and reorders differently (issue #33 item 6).  This runs a
sample of them in a pytest of its own with optimisation on (JAXPIPE_TEST_XLA_OPTIMISED=1); the whole set of
those files passed that way once (BUILD_NOTES, "Tests and CI")."""

import os
import re
import subprocess
import sys

import pytest

# CI's second leg leaves this out (tests/conftest.py): one optimised-build sample per CI run
pytestmark = pytest.mark.ci_once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = [
    "tests/test_wsplit.py::test_split_is_the_fused_backward_without_recomputation",
    "tests/test_cyclic_dp.py::test_balanced_broadcast_equals_direct[4-v2]",
    "tests/test_avgpipe.py::test_advance_changes_speed_and_memory_never_numbers",
    "tests/test_chimera_interleaved_zb.py::test_chimera_replicas_bit_identical_after_steps",
    "tests/test_independent_references.py::test_no_flush_method_equals_its_hand_written_version_table"
    "[2-pipedream_2bw]",
    "tests/test_exactness.py::test_data_x_stage_mesh_equals_stage_only_and_no_pipeline[1f1b]",
]


# two pytests of their own (one process start, one jax import each): the longest sample alone, the other five
# together -- each well under a minute (they were one 3-minute test, then six of their own, each paying a
# start)
GROUPS = [
    [t for t in SAMPLE if "balanced_broadcast" in t],
    [t for t in SAMPLE if "balanced_broadcast" not in t],
]


@pytest.mark.parametrize("tests", GROUPS, ids=["cdp_balanced_broadcast", "five_others"])
def test_cross_program_comparisons_hold_in_an_optimised_build(tests):
    """The suite's persistent compilation cache (conftest) serves them: XLA's flags are part of its key, so
    the optimised programs are entries of their own."""
    env = dict(os.environ, JAXPIPE_TEST_XLA_OPTIMISED="1", XLA_FLAGS="")
    env.pop("JAXPIPE_TEST_TIMES", None)  # (the run's times file lists this test, not its inner one)
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    ran = re.search(r"(\d+) passed", p.stdout)  # (a node id without its parameters runs every case)
    assert ran and int(ran.group(1)) >= len(tests) and "failed" not in p.stdout, p.stdout[-2000:]
