"""What a stage keeps between its forward and its backward, chosen by the user (issue #39, item 3):
``Pipeline(residuals="all" | "inputs" | a jax.checkpoint policy)``, exact in every method."""

import jax
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.optim.reference import serial_reference
from helpers import reference, rel_err, small_model

DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "interleaved_1f1b", "chimera"])
@pytest.mark.parametrize("residuals", ["inputs", "dots"])
def test_synchronous_schedules_are_exact_with_any_residual_policy(schedule, residuals):
    D = 2
    model, batch_fn = small_model("gpt", 4 if schedule == "interleaved_1f1b" else D)
    batch = batch_fn(8)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=D),
        nan_bubbles=True,
        residuals=DOTS if residuals == "dots" else residuals,
    )
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw"])
def test_no_flush_methods_are_exact_with_a_residual_policy(schedule):
    model, batch_fn = small_model("mlp", 2)
    batches = [batch_fn(8, s=k) for k in range(3)]
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=2,
        optimizer=optax.sgd(0.05),
        mesh=jp.make_mesh(stages=2),
        residuals=DOTS,
    )
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    state, _ = pipe.drain(state)
    ref = serial_reference(model, schedule, optax.sgd(0.05), 2, batches)
    assert rel_err(pipe.params(state), ref["params"]) <= 1e-5


def test_the_policy_decides_what_is_stashed():
    """More saved, more temp memory: inputs < dots <= all on the GPT stage (its attention probabilities and
    activations are recomputed under the dots policy)."""
    model, batch_fn = small_model("gpt", 2)
    batch = batch_fn(8)
    temp = {}
    for name, r in (("all", "all"), ("dots", DOTS), ("inputs", "inputs")):
        pipe = jp.Pipeline(
            model,
            schedule="1f1b",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=2),
            residuals=r,
        )
        temp[name] = pipe.lower("grad", pipe.init(), batch).compile().memory_analysis().temp_size_in_bytes
    assert temp["inputs"] < temp["dots"] <= temp["all"], temp


def test_bad_residuals_are_refused():
    model, _ = small_model("mlp", 2)
    with pytest.raises(jp.ConfigError, match="residuals='some'.*'all'.*'inputs'.*jax.checkpoint policy"):
        jp.Pipeline(model, schedule="1f1b", num_microbatches=2, mesh=jp.make_mesh(stages=2), residuals="some")


def test_residuals_that_depend_on_no_activation_are_not_stashed():
    """A causal mask under ``jnp.where`` (``jit``-wrapped in JAX) gives the pullback its broadcast predicate
    and a zero tangent as residuals: neither depends on the activation, so neither is stashed (issue #39: 128
    MiB a micro-batch a block on GPT d1024) -- while the exp and the probabilities of the softmax are."""
    import jax.numpy as jnp
    from jaxpipe.runtime.residuals import rebuild_pullback, residual_mask, split_residuals

    causal = jnp.tril(jnp.ones((8, 8), bool))

    def stage(w, x):
        s = jnp.einsum("btd,bsd->bts", x @ w, x)
        return jax.nn.softmax(jnp.where(causal, s, -1e9), -1) @ x

    w = jax.random.normal(jax.random.key(0), (4, 4))
    x = jax.random.normal(jax.random.key(1), (2, 8, 4))
    mask, avals = residual_mask(stage, w, x)
    leaves = jax.tree.leaves(jax.vjp(stage, w, x)[1])
    kept = [l for l, m in zip(leaves, mask) if m]
    assert not any(a.dtype == jnp.bool_ for a in avals)  # the predicate is recomputed
    assert len(kept) < len(leaves) and any(l.dtype == jnp.bool_ for l in leaves)
    # the pullback rebuilt from the stash and the recomputed leaves is the real one
    # (both compiled whole, as the executor's program is: the stage runs jitted inside it -- traced once,
    # runtime.residuals.traced_once -- and eager op-by-op rounding would differ in the last bit)
    dy = jax.random.normal(jax.random.key(2), (2, 8, 4))

    @jax.jit
    def got_fn(w, x, dy):
        _, stashed, _, _ = split_residuals(stage, w, x, mask)
        return rebuild_pullback(stage, w, jnp.zeros_like(x), stashed, mask)(dy)

    got = got_fn(w, x, dy)
    want = jax.jit(lambda w, x, dy: jax.vjp(stage, w, x)[1](dy))(w, x, dy)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _policy(name):
    """A residual policy by name, as ``Pipeline`` keywords."""
    return {"inputs": {"residuals": "inputs"}, "dots": {"residuals": DOTS}}[name]


@pytest.mark.parametrize(
    "method,D,policy", [("pipeoptim", 2, "inputs"), ("pipeoptim", 2, "dots"), ("spectrain", 3, "inputs")]
)
def test_predicting_methods_recompute_on_the_weights_their_forward_read(method, D, policy):
    """PipeOptim and SpecTrain read predicted weights in F and others in B: a stage that recomputes its
    forward in B must recompute it on F's prediction (issue #48: jax.checkpoint alone recomputed on B's
    weights,
    7.5e-3 / 1.2e-3 off the reference).  Against the hand-written NumPy backward (SGD-momentum, so a wrong
    weight shows)."""
    from hand_backward import pipelined_and_by_hand

    got, want, w0 = pipelined_and_by_hand(method, D, **_policy(policy))
    assert rel_err(got - w0, want - w0) <= 1e-5


@pytest.mark.parametrize("policy", ["inputs", "dots"])
def test_predicting_method_recomputes_a_gpt_with_dropout_on_its_forward_weights(policy):
    """The stage context (dropout key, mask) is kept with the input: the recomputed forward draws F's masks.
    (The dots policy on the tanh MLP above keeps every matmul's output, so nothing it recomputes reads a
    weight; the GPT's attention and layer norms do.)"""
    from test_independent_references import gpt_model, predicting_reference, run_pipeline
    from helpers import change

    model, batch_fn = gpt_model(2)
    opt = optax.sgd(0.05, momentum=0.9)
    batches = [batch_fn(4, s=k) for k in range(3)]
    got = run_pipeline(model, "pipeoptim", opt, batches, 2, 2, **_policy(policy))
    from hand_backward import DISTANCES

    want = predicting_reference(model, opt, batches, 2, *DISTANCES["pipeoptim"])
    assert rel_err(change(got, model.params), change(want, model.params)) <= 1e-5


@pytest.mark.parametrize("method,policy", [("cdp_v1", "inputs"), ("cdp_v2", "dots"), ("wpipe", "inputs")])
def test_version_methods_are_exact_with_a_residual_policy(method, policy):
    """F and B of a micro-batch read one version here: plain recomputation is exact (their hand-written
    version tables, tests/test_independent_references.py)."""
    from test_independent_references import CASES, run_pipeline, version_table_reference
    from helpers import change

    D = 2
    reads, per_mb, stages = CASES[method]
    S, M = stages(D), D
    model, batch_fn = small_model("mlp", S)
    opt = optax.sgd(0.05, momentum=0.9)
    batches = [batch_fn(2 * M, s=k) for k in range(3)]
    got = run_pipeline(model, method, opt, batches, M, D, **_policy(policy))
    want = version_table_reference(model, opt, batches, M, reads(S, M), per_mb)
    assert rel_err(change(got, model.params), change(want, model.params)) <= 1e-5


def test_avgpipe_is_exact_with_a_residual_policy():
    from jaxpipe.optim.reference import avgpipe_reference
    from helpers import change

    model, batch_fn = small_model("mlp", 2)
    opt = optax.sgd(0.05, momentum=0.9)
    batches = [batch_fn(8, s=k) for k in range(3)]
    pipe = jp.Pipeline(
        model,
        schedule="avgpipe",
        num_microbatches=2,
        optimizer=opt,
        mesh=jp.make_mesh(pipes=2, stages=2),
        nan_bubbles=True,
        residuals="inputs",
        options={"advance": 1},
    )
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    ref = avgpipe_reference(model, opt, 2, 2, batches, alpha=0.5)
    assert rel_err(change(pipe.params(state), model.params), change(ref["params"], model.params)) <= 1e-5
