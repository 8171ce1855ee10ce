"""``configure`` balances the cut (issue #53 item 1, "the cut"; :mod:`jaxpipe.cuts.configure`): each stage
count's fastest fitting candidate is tried again with its blocks cut from measured costs, as a candidate of
its own, its memory compiled, its model the same function."""

import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.tune.configure import configure

T, BLOCKS = 16, 4


def _batch(vocab):
    tok = np.random.default_rng(0).integers(0, vocab, (8, T + 1)).astype(np.int32)
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def _heavy_head(n):
    """A GPT of 4 blocks (its head's costs are given below, not timed)."""
    return jp.models.gpt(n, vocab=256, d_model=32, heads=2, seq_len=T, cut=[BLOCKS // n] * n)


#: a head whose forward and backward cost six blocks' (given, not timed: which cut is balanced must not depend
#: on how busy the machine is; measure_parts is tested in test_cut_costs.py)
HEAVY = dict(f_block=1e-3, b_block=2e-3, f_pre=1e-4, b_pre=2e-4, f_post=6e-3, b_post=12e-3)


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    from jaxpipe.tune import config_bench
    from jaxpipe.cuts.balanced import PartCosts

    path = str(tmp_path_factory.mktemp("configure_cut") / "measurements.json")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config_bench.Bench, "parts", lambda self, rows: PartCosts(**HEAVY))
        return configure(
            _heavy_head,
            _batch(256),
            optax.adamw(1e-3),
            devices=2,
            memory_budget=1 << 40,
            schedules=("1f1b",),
            microbatches=(2,),
            residuals=("all",),
            verbose=False,
            cache=path,
        )


def _twin(conf):
    twins = [c for c in conf.candidates if c.cut is not None]
    assert len(twins) == 1, conf.table()
    even = next(c for c in conf.candidates if c.cut is None and c.stages == 2 and not c.dropped)
    return twins[0], even


def test_a_heavy_head_gets_a_balanced_cut_as_a_candidate_of_its_own(heavy):
    twin, even = _twin(heavy)
    assert twin.cut[0] > twin.cut[-1] and sum(twin.cut) == BLOCKS, twin.cut  # the head's stage holds fewer
    assert (twin.schedule, twin.stages, twin.microbatches) == (even.schedule, even.stages, even.microbatches)
    assert twin.step_s < even.step_s  # predicted faster: the cut model's ratio applied
    assert twin.compiled_memory is not None and twin.memory == twin.compiled_memory
    assert f"cut={','.join(map(str, twin.cut))}" in heavy.table()
    assert "2 stages: balanced cut" in heavy.cut_note, heavy.cut_note
    assert heavy.best is min((c for c in heavy.candidates if not c.dropped), key=lambda c: c.step_s)


def test_the_balanced_model_computes_what_the_even_one_does(heavy):
    """The cut moves blocks between stages; the function, its loss and its update are the model's."""
    twin, even = _twin(heavy)
    losses = []
    for c in (even, twin):
        model = heavy.model(c)
        assert tuple(model.cut) == (twin.cut if c is twin else (BLOCKS // 2,) * 2)
        pipe = jp.Pipeline(model, optimizer=optax.adamw(1e-3), **c.pipeline_kwargs())
        batch = pipe.shard_batch(_batch(256))
        state, metrics = pipe.step(pipe.init(), batch)
        losses.append((float(metrics["loss"]), float(pipe.step(state, batch)[1]["loss"])))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_a_model_without_blocks_keeps_its_cut_and_says_why(tmp_path):
    make = lambda n: jp.models.gpt(n, vocab=64, d_model=32, heads=2, seq_len=T, blocks_per_stage=BLOCKS // n)
    conf = configure(
        make,
        _batch(64),
        optax.adamw(1e-3),
        devices=2,
        memory_budget=1 << 40,
        schedules=("1f1b",),
        microbatches=(2,),
        residuals=("all",),
        verbose=False,
        cache=str(tmp_path / "m.json"),
    )
    assert all(c.cut is None for c in conf.candidates)
    assert "without blocks" in conf.cut_note and "block_fn" in conf.cut_note


def test_the_part_costs_are_measured_once_per_micro_batch_size(tmp_path):
    from jaxpipe.tune.config_bench import Bench
    from jaxpipe.tune.measure_cache import MeasureCache

    make = lambda n: jp.models.gpt(n, vocab=64, d_model=32, heads=2, seq_len=T, cut=[BLOCKS // n] * n)
    bench = Bench(make, _batch(64), optax.adamw(1e-3), MeasureCache(str(tmp_path / "m.json")))
    bench.model(2)
    parts = bench.parts(4)
    # (a backward is a difference of two timings, timed again where it came out <= 0 and floored at a share of
    # the forward: a loaded machine cannot zero it)
    assert parts.f_block > 0 and parts.b_block > 0 and parts.f_post > 0 and parts.b_post > 0
    misses = bench.cache.misses
    assert bench.parts(4) == parts and bench.cache.misses == misses
