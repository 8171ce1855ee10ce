"""The balanced cut's cost model by hand (issue #50: two planted bugs survived in
``jaxpipe.cuts.balanced``)."""

import numpy as np
import pytest

from jaxpipe import schedules
from jaxpipe.cuts import even_cut
from jaxpipe.cuts.balanced import PartCosts, _descend, _search, _stage_costs


def test_stage_costs_by_hand():
    """Cut [2, 1]: stage 0 runs two blocks and the embedding (its second block sits past min(cut), in the
    rematerialising conditional: one more forward in B), stage 1 one block, one padding slot and the head.
    B and W halve the blocks' backward; the embedding's backward belongs to stage 0's W (a weight gradient),
    the head's to the last stage's B (an input gradient)."""
    c = PartCosts(
        f_block=1.0, b_block=2.0, f_pre=0.3, b_pre=0.5, f_post=0.7, b_post=1.1, f_pad=0.01, b_pad=0.02
    )
    got = _stage_costs((2, 1), c)
    f = [2 * 1.0 + 0.3, 1 * 1.0 + 0.01 + 0.7]
    b_blocks = [2 * 2.0 + 1 * 1.0, 1 * 2.0 + 0.02]  # stage 0: its second block is past min(cut): remat
    b = [b_blocks[0] + 0.5, b_blocks[1] + 1.1]
    b_in = [b_blocks[0] / 2, b_blocks[1] / 2 + 1.1]
    w = [b_blocks[0] / 2 + 0.5, b_blocks[1] / 2]
    np.testing.assert_allclose(got, np.stack([f, b, b_in, w, [2 * x for x in f]], axis=1))


def test_the_search_keeps_the_better_of_its_two_descents():
    """Over random costs on interleaved 1F1B, the balanced cut is the better of the descents from the even cut
    and from its mirror -- and the two differ in some of the cases, so keeping the worse would show."""
    s = schedules.build("interleaved_1f1b", num_stages=4, num_microbatches=8, virtual=2)
    rng = np.random.default_rng(0)
    differ = 0
    for _ in range(60):
        c = PartCosts(*rng.uniform(0.1, 3.0, 8))
        n = int(rng.integers(9, 15))
        starts = sorted({even_cut(n, 4), tuple(reversed(even_cut(n, 4)))})
        runs = [_descend(s, st, c, 2) for st in starts]
        got = _search(s, n, c, 2)
        assert got[1] == pytest.approx(min(t for _, t in runs))
        differ += len({round(t, 12) for _, t in runs}) > 1
    assert differ > 0


def test_a_measured_round_becomes_part_costs_by_hand():
    """A backward is the forward-and-backward program's time less the forward's (the pullback timed with its
    forward), and a padding slot is what the stage of one block and one slot adds to one block."""
    from jaxpipe.cuts.part_costs import to_costs

    r = {
        "f_block": 1.0,
        "fb_block": 3.5,
        "f_two": 1.25,
        "fb_two": 4.0,
        "f_pre": 0.5,
        "fb_pre": 0.75,
        "f_post": 2.0,
        "fb_post": 2.75,
    }
    c = to_costs(r)
    assert (c.f_block, c.b_block, c.f_pre, c.b_pre, c.f_post, c.b_post) == (1.0, 2.5, 0.5, 0.25, 2.0, 0.75)
    assert (c.f_pad, c.b_pad) == (0.25, 0.25)  # (1.25 - 1.0, (4.0 - 1.25) - 2.5)
    # a noisy round never gives a free backward: at least a quarter of the forward
    assert to_costs(dict(r, fb_post=1.0)).b_post == 0.25 * 2.0
    # no padding program (a model without block_fn): the padding slot costs nothing
    c = to_costs({k: v for k, v in r.items() if "two" not in k})
    assert (c.f_pad, c.b_pad) == (0.0, 0.0)


def test_a_backward_timed_no_longer_than_its_forward_is_timed_again():
    """A loaded machine can time a part's forward-and-backward no longer than its forward: the pair is timed
    again, so the round's backward is a real difference, not noise clipped to a floor."""
    import time

    from jaxpipe.cuts.part_costs import measure_rounds

    calls = {"fb": 0}

    def forward():
        time.sleep(0.002)

    def forward_and_backward():  # fast while the machine is "busy" (warm-up and the round's first 3 calls)
        calls["fb"] += 1
        time.sleep(0.001 if calls["fb"] <= 4 else 0.004)

    (r,) = measure_rounds([("f_block", forward, ()), ("fb_block", forward_and_backward, ())], 1, calls=3)
    assert r["fb_block"] > r["f_block"] and calls["fb"] == 7


def test_two_models_never_share_a_cut_cost_key():
    """The key holds the traced programs: GPTs of width 16 and 64 (the same blocks, the same backend) get two
    keys, so one never reads the other's costs; the same model gets its key again."""
    import jaxpipe as jp
    from jaxpipe.cuts.part_costs import cost_key, part_programs

    tok = np.zeros((4, 9), np.int32)
    mb = {"x": tok[:, :-1], "y": tok[:, 1:]}
    key = lambda d: cost_key(
        part_programs(jp.models.gpt(2, vocab=32, d_model=d, heads=2, seq_len=8, cut=(1, 1)), mb)[1]
    )
    assert key(16) != key(64)
    assert key(16) == key(16)
