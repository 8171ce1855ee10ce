"""``jaxpipe.tune.memory`` (issue #53 item 2): a pipeline's memory per device predicted without compiling,
from its plan and avals, calibrated on two compiles, against XLA's own ``memory_analysis()`` of the compiled
step."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.tune.memory import MemoryModel, calibrate, compiled, footprint

T, ROWS = 16, 16


def _batch():
    tok = np.random.default_rng(0).integers(0, 64, (ROWS, T + 1)).astype(np.int32)
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def _pipe(D, M, residuals="all", data=1):
    model = jp.models.gpt(D, vocab=64, d_model=32, heads=2, blocks_per_stage=4 // D, seq_len=T)
    return jp.Pipeline(
        model,
        schedule="1f1b",
        num_microbatches=M,
        optimizer=optax.adamw(1e-3),
        mesh=jp.make_mesh(stages=D, data=data),
        residuals=residuals,
    )


HOIST = "jax_use_simplified_jaxpr_constants"  # jax >= 0.11's default: array constants over 1 KiB -> arguments


@pytest.fixture(scope="module")
def measured():
    """(footprint, XLA's figures) of four configurations, each compiled once for the module; D = 4's with
    (on a JAX that hoists constants) its tick table (1920 bytes) among the step's arguments."""
    out = {}
    for key in [(2, 2), (2, 4), (4, 4), (2, 2, "all", 2)]:  # the last: stages 2 x data 2
        pipe = _pipe(*key)
        state = pipe.init()
        out[key] = (footprint(pipe, _batch(), state), compiled(pipe, _batch(), state))
    return out


def test_the_state_on_a_device_is_the_compiled_steps_arguments(measured):
    """Also on a data x stage mesh, where a device holds its replica's share of the batch, not all of it;
    and where JAX passes the program's own constants as arguments: those are told apart, not taken for
    state."""
    for fp, xla in measured.values():
        assert fp.state == xla["arguments"] - xla["constants"]
        assert fp.stash > 0 and fp.residuals == fp.working  # residuals="all": the stash keeps them all
    assert measured[(2, 2, "all", 2)][0].state < measured[(2, 2)][0].state  # the same weights, half the rows
    if getattr(jax.config, HOIST, False):
        assert measured[(4, 4)][1]["constants"] >= 1920  # at least the tick table, int32[10, 4, 2, 6]
    else:  # jax 0.10: constants stay in the program
        assert all(xla["constants"] == 0 for _, xla in measured.values())


def test_the_compiled_total_counts_a_donated_output_once(measured):
    """The step donates its state: the outputs aliased to arguments are the same bytes, counted once
    (arguments + temp + outputs - aliases); counted again, a candidate that fits could be dropped."""
    from types import SimpleNamespace
    from jaxpipe.tune.memory import memory_total

    for fp, xla in measured.values():
        assert xla["alias"] > 0
        assert xla["total"] == xla["arguments"] + xla["temp"] + xla["outputs"] - xla["alias"]
    ma = SimpleNamespace(
        argument_size_in_bytes=100, temp_size_in_bytes=30, output_size_in_bytes=90, alias_size_in_bytes=80
    )
    assert memory_total(ma) == 140


def test_a_line_fitted_at_two_devices_predicts_four_within_ten_percent(measured):
    m = calibrate([(measured[k][0], measured[k][1]["temp"]) for k in [(2, 2), (2, 4)]])
    for k in [(4, 4)]:
        fp, xla = measured[k]
        assert m.temp(fp) == pytest.approx(xla["temp"], rel=0.10), k
        assert m.total(fp) == pytest.approx(xla["total"], rel=0.10), k


def test_a_recomputing_policy_is_its_own_family_and_needs_its_own_calibration(measured):
    fp = footprint(_pipe(2, 2, residuals="inputs"), _batch())
    assert fp.family[0] == "recompute" and fp.residuals < fp.working
    m = calibrate([(measured[k][0], measured[k][1]["temp"]) for k in [(2, 2), (2, 4)]])
    with pytest.raises(KeyError, match="no calibration for the family"):
        m.temp(fp)
    with pytest.raises(ValueError, match="two configurations whose micro-batches differ"):
        calibrate([(measured[(2, 2)][0], 1), (measured[(2, 2)][0], 2)], MemoryModel({}))


def test_a_program_compiled_for_its_figures_only_has_the_optimised_programs_figures():
    """``memory_analysis`` compiles with the backend's optimisation off and, where jaxlib has them, XLA's
    older fusion emitters (on CPU): the buffers, and so every figure, are those of the program compiled as a
    user's is, to a few hundred bytes of temp (the suite's own flags are overridden by the options)."""
    from jaxpipe.tune import memory

    pipe = _pipe(2, 2, residuals="inputs")
    lowered = pipe.lower("step", pipe.init(), pipe.shard_batch(_batch()))
    quick = memory.memory_analysis(lowered)
    users = {"xla_backend_optimization_level": 3}
    users.update({k: True for k in memory.OPTIONAL_OPTIONS if k not in memory._refused})
    full = lowered.compile(users).memory_analysis()
    assert memory.FIGURES_ONLY_OPTIONS["cpu"]["xla_backend_optimization_level"] == 0
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes"):
        assert getattr(quick, field) == getattr(full, field), field
    # the older emitters' kernels keep a few hundred bytes more scratch (320 of 1.27 MB here): 0.03%
    assert abs(quick.temp_size_in_bytes - full.temp_size_in_bytes) <= 1e-3 * full.temp_size_in_bytes


def test_a_one_stage_plan_is_a_family_of_its_own_whatever_its_policy():
    """One stage hands its residuals straight to B (no stash): its temp is the backward's working set alone,
    another line than a pipeline's -- one such point in a pipelined family's fit put README's search up to
    83% off.  Both residual policies share it (nothing is stashed either way)."""
    fams = {res: footprint(_pipe(1, 2, residuals=res), _batch(), known_state=0) for res in ("all", "inputs")}
    assert {fp.family for fp in fams.values()} == {("direct", False, 1)}
    assert all(fp.stash == 0 for fp in fams.values())
    assert footprint(_pipe(2, 2), _batch(), known_state=0).family == ("all", False, 1)


def test_zero_bubbles_own_frontier_slots_are_known_before_compiling():
    """ZB-H1's B keeps the frontier W reads in slots of its own where packing it into the stash saves too
    little: those bytes, slots x frontier, are known from the split (README's search: a ZB line fitted where
    the plan had two slots put four slots 8.9% low, now within 1%).  A recomputing policy's W reruns the
    backward: no frontier."""
    model = jp.models.gpt(2, vocab=64, d_model=32, heads=2, blocks_per_stage=2, seq_len=T)
    fps = {}
    for res in ("all", "inputs"):
        pipe = jp.Pipeline(
            model,
            schedule="zb_h1",
            num_microbatches=4,
            optimizer=optax.adamw(1e-3),
            mesh=jp.make_mesh(stages=2),
            residuals=res,
        )
        fps[res] = (pipe.lane_plan.front_capacity, footprint(pipe, _batch(), known_state=0))
    cap, fp = fps["all"]
    assert cap >= 2 and fp.frontier > 0 and fp.frontier % cap == 0
    assert fp.known == fp.stash + fp.frontier
    assert fps["inputs"][1].frontier == 0
