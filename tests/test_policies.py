"""Weight prediction for any optax optimizer: u_last (the last update the wrapped optimizer produced) equals
-lr * Delta W_t of PipeOptim Table I for SGD-momentum, Adam and AdamW (AdamW: plus its decoupled decay)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpipe.optim.policies import pipeoptim, pipeoptim_distance, spectrain, spectrain_distances
from helpers import assert_close


def run(opt, grads, w):
    state = opt.init(w)
    u = None
    for g in grads:
        u, state = opt.update(g, state, w)
        w = optax.apply_updates(w, u)
    return w, u


@pytest.mark.parametrize("name", ["sgdm", "adam", "adamw"])
def test_u_last_is_table1_delta(name):
    r = np.random.default_rng(0)
    w0 = jnp.asarray(r.normal(size=(5, 3)), jnp.float32)
    grads = [jnp.asarray(r.normal(size=(5, 3)), jnp.float32) for _ in range(4)]
    lr, mu, b1, b2, eps, lam = 0.1, 0.9, 0.9, 0.999, 1e-8, 0.01
    opt = {
        "sgdm": optax.sgd(lr, momentum=mu),
        "adam": optax.adam(lr, b1, b2, eps),
        "adamw": optax.adamw(lr, b1, b2, eps, weight_decay=lam),
    }[name]
    w_final, u_last = run(opt, grads, w0)
    # Table I, by hand (float64): v_t = u v_{t-1} + (1 - tau) g_t (tau = 0); Adam's bias-corrected moments
    v = m = s = 0.0
    w = np.asarray(w0, np.float64)
    for t, g in enumerate(grads, 1):
        g = np.asarray(g, np.float64)
        w_prev = w
        if name == "sgdm":
            v = mu * v + g
            delta = v
        else:
            m = b1 * m + (1 - b1) * g
            s = b2 * s + (1 - b2) * g * g
            delta = (m / (1 - b1**t)) / (np.sqrt(s / (1 - b2**t)) + eps)
        step = -lr * delta - (lr * lam * w_prev if name == "adamw" else 0.0)
        w = w_prev + step
    assert_close(np.asarray(u_last), step, rtol=1e-5, atol=1e-7)
    assert_close(np.asarray(w_final), w, rtol=1e-5, atol=1e-5)  # float32 accumulation


def test_prediction_reads_w_plus_s_u_last():
    """After stage s's update u (the weights now w + u), its next F reads w + u + (D - 1 - s) u and its B
    reads w + u, whether the policy predicts when it updates or when it reads."""
    D = 4
    opt = optax.sgd(0.1, momentum=0.9)
    pol = pipeoptim(opt, D)
    lp = (jnp.ones((3,)), jnp.zeros(()), jnp.zeros(()))
    g = (jnp.full((3,), 2.0), jnp.zeros(()), jnp.zeros(()))
    for s in range(D):
        lp1, _, ps = pol.update(g, lp, opt.init(lp), pol.init(lp), 0, jnp.int32(s))
        if pol.apply_pending is not None:
            lp1 = pol.apply_pending(lp1, ps)
        assert_close(np.asarray(lp1[0]), 1.0 - 0.2, rtol=1e-6)
        wF, _ = pol.forward_weights(lp1, ps, 1, jnp.int32(s))
        assert_close(np.asarray(wF[0]), np.asarray(lp1[0]) + (D - 1 - s) * (-0.1 * 2.0), rtol=1e-6)
        assert_close(np.asarray(pol.backward_weights(lp1, ps, 1, jnp.int32(s))[0]), np.asarray(lp1[0]))
    assert [pipeoptim_distance(D)(s) for s in range(D)] == [3, 2, 1, 0]  # last stage: no prediction
    f, b = spectrain_distances(D)
    assert [f(s) for s in range(D)] == [3, 2, 2, 1] and [b(s) for s in range(D)] == [0, 0, 1, 1]
    assert all(f(s) - b(s) == D - 1 - s for s in range(D))  # F and B predict the same version
    # the ops that predict by 0 read the weights themselves (the executor skips their axpy)
    spec = spectrain(opt, D)
    assert [bool(spec.backward_is_current(jnp.int32(s))) for s in range(D)] == [True, True, False, False]
    assert not any(bool(spec.forward_is_current(jnp.int32(s))) for s in range(D))
    assert [bool(pol.forward_is_current(jnp.int32(s))) for s in range(D)] == [False, False, False, True]
    assert pol.backward_is_current is None  # PipeOptim's B always reads the current weights


@pytest.mark.parametrize("D", [1, 2, 4, 8])
def test_async_schedule_is_what_runs_and_sets_the_distances(D):
    """The no-flush methods' IR is the periodic schedule the executor reads: its expansion's ticks are the
    executor's (op_at), each stage holds D - s micro-batches, and PipeOptim's prediction distance is the
    number of updates the IR puts between a micro-batch's F and its B."""
    from jaxpipe import schedules
    from jaxpipe.optim.policies import pipeoptim_distance

    s = schedules.build("pipeoptim", D, 2 * D)
    p = s.periodic
    for (kind, stage, mb), t in s.ticks().items():
        assert p.op_at(t, stage) == (kind, mb)
    assert [p.updates_between(d) for d in range(D)] == [pipeoptim_distance(D)(d) for d in range(D)]
    assert s.simulate().peak_inflight == [D - d for d in range(D)]


def test_a_periodic_schedule_with_a_broken_dependency_is_refused():
    from jaxpipe.schedules.ir import ScheduleError
    from jaxpipe.schedules.periodic import Periodic

    with pytest.raises(ScheduleError, match="B on device 0 before its input from device 1"):
        Periodic("bad", 2, 2, {"F": (0, 1), "B": (1, 2)}).validate()
