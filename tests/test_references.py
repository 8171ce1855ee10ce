"""The serial references themselves, checked without the executor's machinery (issue #13).

``optim/reference.py`` rebuilds pullbacks with the executor's own ``residual_mask`` / ``rebuild_pullback``:
which residuals a backward that reads *other* weights recomputes (PipeOptim, SpecTrain) is decided there,
and a misclassification would pass both sides.  Here the references meet (1) a hand-written backward of a
tanh MLP in NumPy, with the activations of F and the weights of B; (2) plain ``jax.grad`` + optax loops where
the rule degenerates (one stage: no staleness); and (3) each rule against its nearest neighbour in the same
configuration, on parameter *changes*, by at least 10x the 1e-5 tolerance.
"""

import jax
import numpy as np
import optax
import pytest

from jaxpipe.optim.reference import global_microbatches, serial_reference
from helpers import rel_err, small_model, RULE_MARGIN
from hand_backward import LR, MU, batches, numpy_predicting, tanh_mlp


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
    assert rel_err(got - w0, ref - w0) <= 1e-5  # on the changes, not on the initial weights
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


@pytest.mark.parametrize(
    "a,b",
    [
        ("wpipe", "pipedream_2bw"),
        ("cdp_v2", "cdp_v1"),
        ("pipeoptim", "pipedream"),
        ("spectrain", "pipeoptim"),
    ],
)
def test_each_rule_differs_from_its_neighbour(a, b):
    """In one configuration, a rule and its nearest neighbour move the parameters differently by >= 100x the
    tolerance the tests use (RULE_MARGIN: a test comparing a method with its reference can tell them
    apart)."""
    model, batch_fn = small_model("mlp", 4)
    opt = optax.sgd(0.05, momentum=0.9)
    bs = [batch_fn(16, s=k) for k in range(3)]
    change = lambda p: jax.tree.map(lambda x, y: np.asarray(x) - np.asarray(y), p, model.params)
    ra, rb = (change(serial_reference(model, m, opt, 4, bs)["params"]) for m in (a, b))
    assert rel_err(ra, rb) >= RULE_MARGIN, rel_err(ra, rb)
