"""The tick-price runner (``experiments.tick_price``): its three estimates from one repeat's rounds."""

import pytest

from experiments import tick_price

KINDS = ("even", "uneven", "alone")


def _rounds(uneven_per_tick, overhead=3e-3, spike=None):
    """One round per entry of ``uneven_per_tick`` (seconds a tick of the uneven loop that round; the even
    loop and the loop without exchanges at 10 ms a tick), each call paying ``overhead`` once; ``spike``:
    ``(round, (kind, n), seconds)`` added to one call."""
    per_tick = lambda k, u: {"uneven": u, "even": 10e-3, "alone": 10e-3}[k]
    rounds = [
        {(k, n): overhead + n * per_tick(k, u) for k in KINDS for n in tick_price.LENGTHS}
        for u in uneven_per_tick
    ]
    if spike:
        at, key, extra = spike
        rounds[at][key] += extra
    return rounds


def test_a_slow_call_moves_none_of_the_estimates():
    got = tick_price.estimates(_rounds([10.5e-3] * 15, spike=(4, ("alone", 16), 30e-3)), KINDS)
    assert got["pipeline"] == got["least"] == got["paired"] == pytest.approx(0.5e-3)
    assert got["alone"] == pytest.approx(10e-3)


def test_the_pipelines_estimate_is_the_median_of_groups_the_least_takes_the_fastest_calls():
    """Rounds whose exchange grows group by group (three rounds a group, 0.1 to 0.5 ms): the pipeline's
    price is the middle group's, the least calls' the first group's, the paired one the middle round's."""
    drift = [10e-3 + g * 0.1e-3 for g in range(1, 6) for _ in range(3)]
    got = tick_price.estimates(_rounds(drift), KINDS)
    assert got["pipeline"] == pytest.approx(0.3e-3)
    assert got["least"] == pytest.approx(0.1e-3)
    assert got["paired"] == pytest.approx(0.3e-3)
