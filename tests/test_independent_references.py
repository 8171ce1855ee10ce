"""Independent references for no-flush methods (issue #33 item 1): nothing from ``jaxpipe.runtime`` or
``jaxpipe.optim.reference`` -- only the model's own functions, ``jax.grad`` and optax.  Per micro-batch, the
gradient of the unpipelined per-micro-batch loss is taken stage by stage at the weight version the method's
rule says each stage read (the version table written out by hand from the papers), then the method's
optimizer rule is applied per stage.  Parameter changes are compared leaf by leaf at 1e-5 of each change.

* PipeDream (weight stashing, Narayanan et al. 2019 §3.3): micro-batch i's forward and backward on stage s
  read the version with every update of micro-batches before i - (D - 1 - s) applied -- 1F1B keeps D - s
  micro-batches in flight on stage s, so the backwards of micro-batches 0 .. i - (D - s) finished before
  i's forward; the stash makes its backward read that same version.  Each backward updates its stage.
* PipeDream-2BW (Narayanan et al. 2021 §3.1): every micro-batch of batch b reads w(b - 1) on every stage
  (w(-1) = w(0)); the batch's mean gradient updates w(b) into w(b + 1).
"""
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxpipe as jp
from helpers import RULE_MARGIN, change, rel_err, small_model

D, M, STEPS = 4, 4, 3


def stage_params(model, s):
    """Stage s's own parameters: its slice of ``stage_params``, plus ``pre``'s on the first stage and
    ``post_loss``'s on the last (they are trained where they run)."""
    w = jax.tree.map(lambda a: a[s], model.stage_params)
    return (w, model.pre_params if s == 0 else (), model.post_params if s == D - 1 else ())


def microbatch_loss(model, per_stage, mb):
    """The unpipelined loss of one micro-batch, each stage at its own parameters."""
    x = model.pre(per_stage[0][1], mb)
    for s in range(D):
        x = model.stage_fn(per_stage[s][0], x)
    return model.post_loss(per_stage[D - 1][2], x, mb)


def microbatches(batches):
    """Micro-batch j of batch b is rows [j n/M, (j+1) n/M) of batch b, in order."""
    out = []
    for b in batches:
        n = len(b["x"]) // M
        out += [{k: v[j * n:(j + 1) * n] for k, v in b.items()} for j in range(M)]
    return out


def pipedream_reference(model, opt, batches, lag=lambda s: D - 1 - s):
    """``lag(s)``: how many of the latest updates stage s's reads miss (the paper's D - 1 - s; 0: plain
    per-micro-batch SGD on current weights)."""
    hist = [[stage_params(model, s)] for s in range(D)]        # hist[s][v]: stage s after v updates
    states = [opt.init(hist[s][0]) for s in range(D)]
    grad = jax.jit(jax.grad(lambda ps, mb: microbatch_loss(model, ps, mb)))
    for i, mb in enumerate(microbatches(batches)):
        read = [hist[s][max(0, i - lag(s))] for s in range(D)]
        g = grad(read, mb)
        for s in range(D):                      # stage s's backward of micro-batch i: its update
            u, states[s] = opt.update(g[s], states[s], hist[s][-1])
            hist[s].append(optax.apply_updates(hist[s][-1], u))
    return [h[-1] for h in hist]


def two_bw_reference(model, opt, batches):
    w = [[stage_params(model, s)] for s in range(D)]           # w[s][b]: stage s's version b
    states = [opt.init(w[s][0]) for s in range(D)]
    grad = jax.jit(jax.grad(lambda ps, mb: microbatch_loss(model, ps, mb)))
    mbs = microbatches(batches)
    for b in range(len(batches)):
        read = [w[s][max(b - 1, 0)] for s in range(D)]
        gs = [grad(read, mb) for mb in mbs[b * M:(b + 1) * M]]
        for s in range(D):
            mean = jax.tree.map(lambda *x: sum(x) / M, *(g[s] for g in gs))
            u, states[s] = opt.update(mean, states[s], w[s][-1])
            w[s].append(optax.apply_updates(w[s][-1], u))
    return [v[-1] for v in w]


def as_pipeline_params(per_stage):
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *(p[0] for p in per_stage))
    return stacked, per_stage[0][1], per_stage[D - 1][2]


@pytest.mark.parametrize("method,reference", [("pipedream", pipedream_reference),
                                              ("pipedream_2bw", two_bw_reference)])
def test_no_flush_method_equals_its_hand_written_version_table(method, reference):
    model, batch_fn = small_model("mlp", D)
    opt = optax.sgd(0.05, momentum=0.9)
    batches = [batch_fn(2 * M, s=k) for k in range(STEPS)]
    pipe = jp.Pipeline(model, schedule=method, num_microbatches=M, optimizer=opt, mesh=jp.make_mesh(stages=D),
                       nan_bubbles=True)
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    state, _ = pipe.drain(state)
    got = pipe.params(state)
    want = as_pipeline_params(reference(model, opt, batches))
    assert rel_err(change(got, model.params), change(want, model.params)) <= 1e-5
    # the version table matters: per-micro-batch SGD on the current weights moves them otherwise
    current = as_pipeline_params(pipedream_reference(model, opt, batches, lag=lambda s: 0))
    assert rel_err(change(current, model.params), change(want, model.params)) > RULE_MARGIN
