"""The benchmark's plain baselines compute what they claim (they are the denominators of every speed
figure)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import rel_err
from experiments.bench import plain_predicting_step
from jaxpipe.bench import (
    STAGE_FORMS,
    held_as,
    layers_fn,
    make_tanh_mlp,
    plain_train_step,
    stacked_back,
)


def _batch(n=16, width=8):
    x = jax.random.normal(jax.random.key(0), (n, width), jnp.float32)
    return {"x": x, "y": jnp.tanh(x[:, ::-1])}


def test_predicting_step_at_distance_zero_is_the_plain_micro_step():
    """With every distance 0 the predicting baseline is the plain (gradient, update) micro-steps, to rounding;
    with SpecTrain's distances it reads other weights and ends elsewhere."""
    model, opt, batch = make_tanh_mlp(4, 1, 8), optax.sgd(0.1, momentum=0.9), _batch()
    plain = jax.jit(plain_train_step(model, opt, 4, per_microbatch=True))
    p, o, _ = plain(model.params, opt.init(model.params), batch)
    p, o, _ = plain(p, o, batch)
    zero = lambda s: 0
    for fwd, bwd, close in ((zero, None, True), (lambda s: s // 2 + 3 - s, lambda s: s // 2, False)):
        fn = plain_predicting_step(model, opt, 4, fwd, bwd)
        q = jax.tree.map(jnp.copy, model.params)
        st = (q, opt.init(q), jax.tree.map(jnp.zeros_like, q))
        for _ in range(2):
            *st, _ = fn(*st, batch)
        err = rel_err(st[0], p)
        assert (err <= 1e-5) if close else (err > 1e-4), err


def test_ratios_come_with_their_spread_and_noisy_ones_are_named():
    """Issue #52 item 4: a ratio is the median of the rounds' ratios, with half their interquartile range; one
    that varies by more than 5%, or a busy machine, is warned about by name."""
    from experiments.bench import ratio_spread, reliability

    r, s = ratio_spread([2.0, 2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert (r, s) == (2.0, 0.0)
    r, s = ratio_spread([1.0, 1.2, 0.8, 1.0, 1.4, 0.6], [1.0] * 6)
    assert r == 1.0 and 0.1 < s < 0.4
    warned = reliability({"quiet": (1.0, 0.01), "noisy": (1.0, s)}, load=0.1)
    assert len(warned) == 1 and warned[0].startswith("noisy:")
    assert any("busy" in w for w in reliability({}, load=1.5))


def test_a_hypervisors_steal_is_read_on_the_runs_cores_and_warned_about(tmp_path):
    """``/proc/stat``'s steal (the 8th field) summed over the cores asked for; a run whose share of stolen
    time is over 2% is warned about, one under it is not; the watch says what it saw."""
    from experiments.bench import CpuTicks, MachineWatch, cpu_model, cpu_ticks, reliability

    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  30 0 10 40 0 0 0 20 0 0\ncpu0 10 0 5 30 0 0 0 5 0 0\ncpu1 20 0 5 10 0 0 0 15 0 0\nintr 7\n"
    )
    assert cpu_ticks(stat=str(stat)) == CpuTicks(100, 20)
    assert cpu_ticks([1], stat=str(stat)) == CpuTicks(50, 15)
    assert cpu_ticks([0, 1], stat=str(stat)) == CpuTicks(100, 20)
    assert cpu_ticks([5], stat=str(stat)) is None and cpu_ticks(stat=str(tmp_path / "none")) is None
    assert any("steal" in w and "3.0%" in w for w in reliability({}, steal=0.03))
    assert not reliability({}, steal=0.01)
    watch = MachineWatch()
    sum(range(200_000))
    steal = watch.steal()
    assert steal is None or 0.0 <= steal <= 1.0
    assert "CPU steal during it" in watch.summary()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\n")
    assert cpu_model(str(info)) == "Some CPU (AVX2, AVX-512)"
    assert cpu_model(str(tmp_path / "none")) == "unknown CPU"


def test_the_stage_forms_run_the_same_layers():
    """``scan``, ``indexed`` and ``apart`` (``jaxpipe.bench.layers_fn``): one output and one gradient to float
    rounding, ``stacked_back`` undoing ``held_as``; an unknown form named."""
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 8)) / 3
    h = jax.random.normal(jax.random.PRNGKey(1), (4, 8))
    outs, grads = {}, {}
    for form in STAGE_FORMS:
        held = held_as(form, w)
        assert isinstance(held, tuple) == (form == "apart")
        loss = lambda p: jnp.sum(layers_fn(form)(p, h) ** 2)
        outs[form] = layers_fn(form)(held, h)
        grads[form] = stacked_back(form, jax.grad(loss)(held))
        np.testing.assert_array_equal(stacked_back(form, held), w)
    for form in STAGE_FORMS[1:]:
        np.testing.assert_allclose(outs[form], outs["scan"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(grads[form], grads["scan"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="'loops'"):
        layers_fn("loops")


def test_each_runs_timed_steps_follow_an_untimed_one_of_its_own():
    """The first step after another program's runs slow (GPipe, 1F1B's program to the byte on the testbed,
    measured 0.93-0.95x the 1F1B timed first in each round): a round times each run's steps after one of
    its own, untimed."""
    from experiments.bench import round_steps

    last = [None]

    def step_of(name):
        def step(s):
            if last[0] != name:  # cold: another run's step came before
                time.sleep(0.2)
            last[0] = name
            return s + 1

        return step

    runs = {k: [step_of(k), 0] for k in ("a", "b")}
    settled = round_steps(runs, 2)
    assert all(t < 0.05 for v in settled.values() for t in v), settled
    assert runs["a"][1] == runs["b"][1] == 2 * 4  # 1 untimed + 3 timed steps a round
    cold = round_steps({k: [step_of(k), 0] for k in ("a", "b")}, 2, settle=0)
    assert all(t > 0.06 for v in cold.values() for t in v), cold
