"""The serial references themselves, checked without the executor's machinery (issue #13).

``optim/reference.py`` rebuilds pullbacks with the executor's own ``residual_mask`` / ``rebuild_pullback``:
which residuals a backward that reads *other* weights recomputes (PipeOptim, SpecTrain) is decided there,
and a misclassification would pass both sides.  Here the references meet (1) a hand-written backward of a
tanh MLP in NumPy, with the activations of F and the weights of B; (2) plain ``jax.grad`` + optax loops where
the rule degenerates (one stage: no staleness); and (3) each rule against its nearest neighbour in the same
configuration, on parameter *changes*, by at least 10x the 1e-5 tolerance.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.optim.reference import global_microbatches, serial_reference
from helpers import rel_err, small_model, RULE_MARGIN

L, H, N, LR, MU = 2, 8, 8, 0.05, 0.9      # layers per stage, width, rows per micro-batch, sgd lr, momentum


def tanh_mlp(D, seed=0):
    w = np.random.default_rng(seed).normal(size=(D, L, H, H)).astype(np.float32) / np.sqrt(H)

    def stage_fn(p, h):
        for i in range(L):
            h = jnp.tanh(h @ p[i])
        return h

    model = jp.PipelineModel(stage_fn=stage_fn, stage_params=jnp.asarray(w),
                             post_loss=lambda _, h, b: jnp.mean((h - b["y"]) ** 2))
    return model, w.astype(np.float64)


def batches(k, M, seed=1):
    r = np.random.default_rng(seed)
    return [{"x": r.normal(size=(M * N, H)).astype(np.float32), "y": r.normal(size=(M * N, H)).astype(np.float32)}
            for _ in range(k)]


def numpy_predicting(w0, bs, M, fwd_dist, bwd_dist, momentum):
    """PipeOptim / SpecTrain by hand: F on w + d_F u, B through F's activations with w + d_B u (u: the last
    SGD(-momentum) update), an update after every micro-batch."""
    D = w0.shape[0]
    hist = [[w0[s]] for s in range(D)]
    upd = [[np.zeros_like(w0[s])] for s in range(D)]
    buf = [np.zeros_like(w0[s]) for s in range(D)]
    mbs = [mb for b in bs for mb in global_microbatches(b, M)]
    for i, mb in enumerate(mbs):
        wF = [hist[s][max(0, i - (D - 1 - s))] + fwd_dist(s, D) * upd[s][max(0, i - (D - 1 - s))] for s in range(D)]
        wB = [hist[s][i] + bwd_dist(s, D) * upd[s][i] for s in range(D)]
        h, acts = np.asarray(mb["x"], np.float64), []
        for s in range(D):
            for l in range(L):
                t = np.tanh(h @ wF[s][l])
                acts.append((s, l, h, t))
                h = t
        dt = 2.0 * (h - mb["y"]) / h.size
        grads = [np.zeros_like(w0[s]) for s in range(D)]
        for s, l, hin, t in reversed(acts):
            da = dt * (1.0 - t ** 2)
            grads[s][l] = hin.T @ da
            dt = da @ wB[s][l].T                     # B's weights, F's activations
        for s in range(D):
            buf[s] = MU * buf[s] + grads[s] if momentum else grads[s]
            u = -LR * buf[s]
            hist[s].append(hist[s][-1] + u)
            upd[s].append(u)
    return np.stack([h_[-1] for h_ in hist])


@pytest.mark.parametrize("method", ["pipeoptim", "spectrain"])
def test_prediction_references_equal_a_hand_written_backward(method):
    D, M = 4, 4
    model, w0 = tanh_mlp(D)
    bs = batches(2, M)
    if method == "pipeoptim":
        opt, ref = optax.sgd(LR), numpy_predicting(w0, bs, M, lambda s, D: D - 1 - s, lambda s, D: 0, False)
    else:
        opt = optax.sgd(LR, momentum=MU)
        ref = numpy_predicting(w0, bs, M, lambda s, D: s // 2 + D - 1 - s, lambda s, D: s // 2, True)
    got = np.asarray(serial_reference(model, method, opt, M, bs)["params"][0], np.float64)
    assert rel_err(got - w0, ref - w0) <= 1e-5            # on the changes, not on the initial weights
    # and the hand-written backward is not vacuous: B on F's weights instead differs
    other = numpy_predicting(w0, bs, M, lambda s, D: D - 1 - s, lambda s, D: D - 1 - s, method == "spectrain")
    assert rel_err(other - w0, ref - w0) > 1e-4


@pytest.mark.parametrize("method", ["pipedream", "pipeoptim", "spectrain"])
def test_one_stage_is_a_plain_optax_loop(method):
    """D = 1: no staleness, no prediction distance: every rule is the plain per-micro-batch optax loop."""
    model, batch_fn = small_model("mlp", 1)
    opt = optax.sgd(0.05, momentum=0.9)
    bs = [batch_fn(8, s=k) for k in range(2)]
    ref = serial_reference(model, method, opt, 4, bs)
    params, state = model.params, opt.init(model.params)
    grad = jax.jit(jax.grad(model.loss))
    for mb in [mb for b in bs for mb in global_microbatches(b, 4)]:
        u, state = opt.update(grad(params, mb), state, params)
        params = optax.apply_updates(params, u)
    change = lambda p: jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), p, model.params)
    assert rel_err(change(ref["params"]), change(params)) <= 1e-5


def test_2bw_one_stage_is_the_delayed_accumulating_loop():
    """PipeDream-2BW at D = 1: w(t+1) = w(t) + update(mean gradient at w(t-1)), written with jax.grad."""
    model, batch_fn = small_model("mlp", 1)
    opt = optax.sgd(0.05)
    bs = [batch_fn(8, s=k) for k in range(3)]
    ref = serial_reference(model, "pipedream_2bw", opt, 4, bs)
    grad = jax.jit(jax.grad(lambda p, mbs: sum(model.loss(p, mb) for mb in mbs) / len(mbs)))
    prev, cur, state = model.params, model.params, opt.init(model.params)
    for b in bs:
        u, state = opt.update(grad(prev, global_microbatches(b, 4)), state, cur)
        prev, cur = cur, optax.apply_updates(cur, u)
    change = lambda p: jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), p, model.params)
    assert rel_err(change(ref["params"]), change(cur)) <= 1e-5


@pytest.mark.parametrize("a,b", [("wpipe", "pipedream_2bw"), ("cdp_v2", "cdp_v1"), ("pipeoptim", "pipedream"),
                                 ("spectrain", "pipeoptim")])
def test_each_rule_differs_from_its_neighbour(a, b):
    """In one configuration, a rule and its nearest neighbour move the parameters differently by >= 100x the
    tolerance the tests use (RULE_MARGIN: a test comparing a method with its reference can tell them apart)."""
    model, batch_fn = small_model("mlp", 4)
    opt = optax.sgd(0.05, momentum=0.9)
    bs = [batch_fn(16, s=k) for k in range(3)]
    change = lambda p: jax.tree.map(lambda x, y: np.asarray(x) - np.asarray(y), p, model.params)
    ra, rb = (change(serial_reference(model, m, opt, 4, bs)["params"]) for m in (a, b))
    assert rel_err(ra, rb) >= RULE_MARGIN, rel_err(ra, rb)
