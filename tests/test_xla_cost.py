"""XLA's own cost of a compiled program against the plain one-device step that does the same work
(``compiled.cost_analysis()`` bytes accessed): what the executor adds where no pipeline hides it (D = 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpipe as jp

L, H, B, M = 4, 256, 128, 4


def _bytes(compiled):
    ca = compiled.cost_analysis()
    return (ca[0] if isinstance(ca, list) else ca)["bytes accessed"]


def _stage(w, h):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)[0]


def _mse(w, x, y):
    return jnp.mean((_stage(w, x) - y) ** 2)


def _account_agrees_with_xla(compiled, trips):
    """``jaxpipe.hlo_bytes``: with every loop body once its count is XLA's own (within 2%); the step's loop
    runs ``trips`` times, and counted so (with the layer scans inside it) the program moves at least that many
    bodies more than XLA's once-per-body figure."""
    from jaxpipe.hlo_bytes import account

    a = account(compiled.as_text())
    assert a.static == pytest.approx(_bytes(compiled), rel=0.02)
    assert [n for n, _ in a.loops] == [trips]
    assert a.per_call >= (a.static + (trips - 1) * a.loops[0][1]) * (1 - 1e-6)  # (and loops inside it)
    assert a.top and a.top[0][2] >= a.top[-1][2]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_loss_and_grad_at_one_device_adds_no_pass_over_the_gradient(schedule):
    """Issue #51 item 3: ``loss_and_grad`` divided the summed gradient after its loop -- one more read and
    write of the whole gradient, 1.32x the plain step's bytes (MLP 8 x 1024²).  It now divides each
    micro-batch's gradient as it adds it, as the plain step does; and the stage's layer scan adds into the
    sums in place (``runtime.wsplit.BackwardSplit.weight_part_into``), reading only the slice it adds to."""
    r = np.random.default_rng(0)
    w = jnp.asarray(r.normal(size=(L, H, H)) / np.sqrt(H), jnp.float32)
    x, y = (jnp.asarray(r.normal(size=(B, H)), jnp.float32) for _ in range(2))

    @jax.jit
    def plain(w, x, y):
        def body(c, xy):
            l, g = jax.value_and_grad(_mse)(w, *xy)
            return (c[0] + l / M, c[1] + g / M), None

        return jax.lax.scan(body, (0.0, jnp.zeros_like(w)), (x.reshape(M, -1, H), y.reshape(M, -1, H)))[0]

    model = jp.PipelineModel(
        stage_fn=_stage, stage_params=w[None], post_loss=lambda _, h, b: jnp.mean((h - b["y"]) ** 2)
    )
    pipe = jp.Pipeline(model, schedule=schedule, num_microbatches=M, mesh=jp.make_mesh(stages=1, data=1))
    state, batch = pipe.init(), {"x": x, "y": y}
    ours, theirs = pipe.lower("grad", state, batch).compile(), plain.lower(w, x, y).compile()
    ratio = _bytes(ours) / _bytes(theirs)
    # 0.72x since the backward adds each layer's weight gradient into the sums in place (the plain step stacks
    # them and adds after); 0.66x since that add is one scatter-add, without XLA's copy of the slice it adds
    # to (runtime.wsplit.add_into_slice); dividing after the loop again measured 0.94x
    assert ratio <= 0.69, ratio
    _account_agrees_with_xla(ours, pipe.lane_plan.num_ticks)
    _account_agrees_with_xla(theirs, M)
    loss, (g, _, _) = pipe.loss_and_grad(state, batch)
    ref_loss, ref_g = plain(w, x, y)
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(ref_g), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
