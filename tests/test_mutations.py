"""The planted-bug runner's own checks (issue #43, item 4): every mutation still applies to the code, the
comparison helper sees NaN anywhere, and a sample of mutations is caught in CI's first leg -- two fixed, two
that rotate by the day, so CI runs every planted bug within a few weeks (issue #50 item 2); the full list, 6
minutes: ``python tests/mutations.py``."""

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
        assert f"def {test_name.split('[')[0]}(" in open(os.path.join(mutations.ROOT, test_file)).read(), (
            m.test
        )


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


def rotating_sample(day: int, k: int = 2):
    """The ``k`` planted bugs of UTC day ``day``: consecutive entries of the list, so that every bug is run by
    CI within ``ceil(len / k)`` days (the whole runner takes 6 minutes: too long for every CI run)."""
    n = len(mutations.MUTATIONS)
    return [mutations.MUTATIONS[(day * k + i) % n].name for i in range(k)]


def _today() -> int:
    import datetime

    return int(
        os.environ.get("JAXPIPE_MUTATION_DAY", datetime.datetime.now(datetime.timezone.utc).toordinal())
    )


def test_the_rotating_sample_covers_every_planted_bug():
    n = len(mutations.MUTATIONS)
    days = range(_today(), _today() + -(-n // 2))
    assert {name for d in days for name in rotating_sample(d)} == {m.name for m in mutations.MUTATIONS}


@pytest.mark.ci_once  # CI's first leg only (tests/conftest.py): each mutant is a pytest run of its own
@pytest.mark.parametrize(
    "name", ["status_never_read", "stage_key_ignores_stage"] + [f"today-{i}" for i in range(2)]
)
def test_a_sample_of_planted_bugs_is_caught(name):
    # two fixed bugs, and two that rotate by the UTC day (JAXPIPE_MUTATION_DAY=<ordinal> picks a day)
    if name.startswith("today-"):
        name = rotating_sample(_today())[int(name.split("-")[1])]
    m = next(m for m in mutations.MUTATIONS if m.name == name)
    assert mutations.run(m, timeout=600) == "caught", f"planted bug {name} was not caught ({m.test})"
