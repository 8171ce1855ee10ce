"""The planted-bug runner's own checks (issue #43, item 4): every mutation still applies to the code, the
comparison helper sees NaN anywhere, and a sample of mutations is caught (the full list: ``python
tests/mutations.py``, by hand)."""
import os

import numpy as np
import pytest

import mutations
from helpers import rel_err


def test_every_mutation_applies_to_the_code_as_it_is():
    for m in mutations.MUTATIONS:
        text = open(os.path.join(mutations.ROOT, m.path)).read()
        assert text.count(m.old) == 1, f"mutation {m.name} is stale: its text is not once in {m.path}"
        test_file, test_name = m.test.split("::")
        assert os.path.exists(os.path.join(mutations.ROOT, test_file)), m.test
        # a test id that names no test makes pytest exit 4 or 5, which the runner reports as an error, never
        # as caught; checked here too, so a renamed test shows before anyone runs the list
        assert f"def {test_name.split('[')[0]}(" in open(os.path.join(mutations.ROOT, test_file)).read(), m.test


def test_rel_err_sees_nan_in_any_leaf():
    ok = {"a": np.ones(3), "b": np.ones(2)}
    bad = {"a": np.ones(3), "b": np.array([1.0, np.nan])}
    assert rel_err(ok, ok) == 0.0
    for x, y in ((bad, ok), (ok, bad)):
        with pytest.raises(AssertionError, match=r"leaf \['b'\] of the (first|second) argument holds 1 NaN"):
            rel_err(x, y)
    with pytest.raises(AssertionError, match="structures differ"):
        rel_err({"a": np.ones(3)}, ok)
    with pytest.raises(AssertionError, match="shapes differ"):
        rel_err({"a": np.ones(3), "b": np.ones(3)}, ok)


@pytest.mark.ci_once        # CI's first leg only (tests/conftest.py): each mutant is a pytest run of its own
@pytest.mark.parametrize("name", ["status_never_read", "stage_key_ignores_stage"])
def test_a_sample_of_planted_bugs_is_caught(name):
    m = next(m for m in mutations.MUTATIONS if m.name == name)
    assert mutations.run(m, timeout=600) == "caught"
