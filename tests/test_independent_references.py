"""Independent references for the no-flush methods (issue #33 item 1): nothing from ``jaxpipe.runtime`` or
``jaxpipe.optim.reference`` -- only the model's own functions (``loss_sum_count``, its keys), ``jax.grad`` and
optax.  Per micro-batch, the gradient of the unpipelined per-micro-batch loss is taken with every stage at
the weight version the method's rule says that stage read (the version table written out by hand from the
papers), then the method's optimizer rule is applied per stage.  Parameter changes are compared leaf by leaf
at 1e-5 of each change; the pipelines run with NaN bubbles.  The existing serial references stay as a second
opinion (the other test files).

Version tables (``i``: global micro-batch index, ``j = i mod M`` its place in batch ``b``; ``S`` model
stages):

* PipeDream (weight stashing, Narayanan et al. 2019 §3.3): micro-batch i's forward and backward on stage s
  read the version with the updates of micro-batches before i - (S - 1 - s) applied -- 1F1B keeps S - s
  micro-batches in flight on stage s; the stash makes the backward read the forward's version.  Each
  backward updates its stage.
* PipeDream-2BW (Narayanan et al. 2021 §3.1) and CDP-v1 (Fournier & Oyallon eq. CDP-v1): every micro-batch
  of batch b reads w(b - 1) on every stage (w(-1) = w(0)); the batch's mean gradient makes w(b + 1).
* CDP-v2 (eq. CDP-v2, 0-based): micro-batch j reads w(b) on stages s >= S - 1 - j and w(b - 1) before them
  (the paper's f_i(theta^1_{t-1}, ..., theta^{N-i}_{t-1}, theta^{N-i+1}_t, ..., theta^N_t)).  The same table
  for the pipeline form (M = S micro-batches) and the DP form (N = S workers, worker i's rows are
  micro-batch i).
* WPipe (Yang et al., eq. (1)): the model cut into 2D partitions; group G0 (partitions < D) reads
  w(b - 1 + 0), group G1 reads w(b - 1 + 1) = w(b).
* PipeOptim / SpecTrain: the forward reads a *predicted* version and the backward back-propagates through the
  forward's activations with other weights, which ``jax.grad`` of one function cannot state; their
  independent reference is the NumPy backward of a tanh MLP written by hand (``hand_backward.py``).

Tied arrays (the GPT's head and embedding) belong to stage 0; the last stage's use reads the version stage 0
read for the same micro-batch, and both uses' gradients update stage 0's copy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.model import loss_terms, microbatch_key
from hand_backward import (
    DISTANCES,
    batches as tanh_batches,
    numpy_predicting,
    pipelined_and_by_hand,
    weights_read_at_backward,
)
from helpers import RULE_MARGIN, change, rel_err, small_model

SEED = 3  # the pipelines' dropout seed (context models)


# ------------------------------------------------------------------ the version tables, by hand
def pipedream_reads(S, M, lag=None):
    lag = lag or (lambda s: S - 1 - s)
    return lambda s, i, j, b: ("update", max(0, i - lag(s)))


def delayed_reads(S, M):  # PipeDream-2BW, CDP-v1
    return lambda s, i, j, b: ("batch", max(b - 1, 0))


def cdp_v2_reads(S, M):
    return lambda s, i, j, b: ("batch", b if s >= S - 1 - j else max(b - 1, 0))


def wpipe_reads(S, M):  # S = 2D partitions; G0 = partitions < D
    return lambda s, i, j, b: ("batch", max(b - 1, 0) if s < S // 2 else b)


def fresh_reads(S, M):  # what no method does: every read the newest version (rule-matters)
    return lambda s, i, j, b: ("fresh", -1)


# ------------------------------------------------------------------ the model, stage by stage
def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _set(tree[path[0]], path[1:], value)
    return out


def stage_parts(model, s):
    """Stage s's own parameters: its slice of ``stage_params``, plus ``pre``'s on the first stage and
    ``post_loss``'s on the last (they are trained where they run)."""
    S = model.num_stages
    w = jax.tree.map(lambda a: a[s], model.stage_params)
    return (w, model.pre_params if s == 0 else (), model.post_params if s == S - 1 else ())


def assemble(model, per_stage):
    """``(stacked w, pre, post)`` for ``model.loss_sum_count``; a tied leaf of ``post`` is stage 0's array
    (the version stage 0 read), so its gradient flows to stage 0 and the last stage's own copy gets none."""
    S = model.num_stages
    pre, post = per_stage[0][1], per_stage[S - 1][2]
    for pre_path, post_path in model.tied:
        post = _set(post, post_path, _get(pre, pre_path))
    return jax.tree.map(lambda *a: jnp.stack(a), *(p[0] for p in per_stage)), pre, post


def version_table_reference(model, opt, batches, M, reads, per_microbatch):
    """The method's rule from its version table: ``reads(s, i, j, b)`` names the version stage s reads for
    micro-batch i = (b, j), as ``("update", n)`` (after n per-micro-batch updates), ``("batch", b')``
    (after b' per-batch updates) or ``("fresh", -1)`` (the newest version).  ``per_microbatch``: each backward
    updates its stage (the mean-loss gradient of that micro-batch); else the batch's summed gradient over its
    summed count updates every stage once (a mean loss counts 1 per micro-batch: the mean of the
    gradients)."""
    S = model.num_stages
    hist = [[stage_parts(model, s)] for s in range(S)]
    states = [opt.init(h[0]) for h in hist]
    sum_and_count = lambda ps, mb, key: model.loss_sum_count(assemble(model, ps), mb, key=key)
    grad = jax.jit(jax.grad(sum_and_count, has_aux=True))
    for b, batch in enumerate(batches):
        n = len(batch["x"]) // M
        acc, count = None, 0.0
        for j in range(M):
            i = b * M + j
            mb = {k: v[j * n : (j + 1) * n] for k, v in batch.items()}
            g, c = grad([hist[s][reads(s, i, j, b)[1]] for s in range(S)], mb, microbatch_key(SEED, b, j))
            if per_microbatch:
                for s in range(S):
                    gs = jax.tree.map(lambda a: a / c, g[s])
                    u, states[s] = opt.update(gs, states[s], hist[s][-1])
                    hist[s].append(optax.apply_updates(hist[s][-1], u))
            else:
                acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
                count += float(c)
        if not per_microbatch:
            for s in range(S):
                gs = jax.tree.map(lambda a: a / count, acc[s])
                u, states[s] = opt.update(gs, states[s], hist[s][-1])
                hist[s].append(optax.apply_updates(hist[s][-1], u))
    stacked, pre, post = assemble(model, [h[-1] for h in hist])
    return stacked, pre, post


# ------------------------------------------------------------------ the methods against their tables
CASES = {  # method: (version table, per-micro-batch updates, model stages for D devices)
    "pipedream": (pipedream_reads, True, lambda D: D),
    "pipedream_2bw": (delayed_reads, False, lambda D: D),
    "cdp_v1": (delayed_reads, False, lambda D: D),
    "cdp_v2": (cdp_v2_reads, False, lambda D: D),
    "wpipe": (wpipe_reads, False, lambda D: 2 * D),
}


def run_pipeline(model, method, opt, batches, M, D, **kw):
    pipe = jp.Pipeline(
        model,
        schedule=method,
        num_microbatches=M,
        optimizer=opt,
        mesh=jp.make_mesh(stages=D),
        nan_bubbles=True,
        seed=SEED,
        **kw,
    )
    state = pipe.init()
    for b in batches:
        state, _ = pipe.step(state, b)
    state, _ = pipe.drain(state)
    return pipe.params(state)


def gpt_model(S):
    """The reference GPT with everything that touches the version table: dropout keyed by (step,
    micro-batch, stage), padding masks with the exact masked mean, the head tied to the token embedding."""
    model = jp.models.gpt(
        S, vocab=32, d_model=16, heads=2, seq_len=8, dropout=0.1, tie_embeddings=True, masked=True
    )

    def batch(n, s):
        r = np.random.default_rng(s)
        t = r.integers(0, 32, (n, 9)).astype(np.int32)
        mask = (np.arange(8)[None] < r.integers(3, 9, (n, 1))).astype(np.float32)
        return {"x": t[:, :-1], "y": t[:, 1:], "mask": mask}

    return model, batch


@pytest.mark.parametrize("method", list(CASES))
@pytest.mark.parametrize("D", [2, 4])
def test_no_flush_method_equals_its_hand_written_version_table(method, D):
    reads, per_mb, stages = CASES[method]
    S = stages(D)
    M = D if method == "cdp_v2" else 4  # CDP-v2's table is the paper's with N = M = S micro-batches
    model, batch_fn = small_model("mlp", S)
    opt = optax.sgd(0.05, momentum=0.9)
    batches = [batch_fn(2 * M, s=k) for k in range(3)]
    got = run_pipeline(model, method, opt, batches, M, D)
    want = version_table_reference(model, opt, batches, M, reads(S, M), per_mb)
    assert rel_err(change(got, model.params), change(want, model.params)) <= 1e-5
    # the table matters: every stage reading the freshest version moves the parameters otherwise
    fresh = version_table_reference(model, opt, batches, M, fresh_reads(S, M), per_mb)
    assert rel_err(change(fresh, model.params), change(want, model.params)) > RULE_MARGIN


# D = 4 for every method, D = 2 for the two whose tables differ most there (CI's hour; the MLP test above runs
# every method at both)
@pytest.mark.parametrize(
    "method,D", [(m, 4) for m in CASES] + [(m, 2) for m in ("pipedream", "wpipe") if m in CASES]
)
def test_gpt_with_dropout_masks_and_tying_equals_its_version_table(method, D):
    reads, per_mb, stages = CASES[method]
    M = D  # the GPT: M = D (2BW, CDP and WPipe need M >= D)
    S = stages(D)
    model, batch_fn = gpt_model(S)
    opt = optax.sgd(0.05, momentum=0.9)  # not Adam: a zero-gradient bias would compare float noise
    batches = [batch_fn(2 * M, s=k) for k in range(3)]
    got = run_pipeline(model, method, opt, batches, M, D)
    want = version_table_reference(model, opt, batches, M, reads(S, M), per_mb)
    assert rel_err(change(got, model.params), change(want, model.params)) <= 1e-5
    emb = got[1]["tok"]["embedding"]
    assert np.array_equal(np.asarray(emb), np.asarray(got[2]["emb"]))  # still one array


@pytest.mark.parametrize("rule,N", [("v1", 2), ("v2", 2), ("v2", 4)])
def test_cyclic_data_parallel_equals_the_papers_table(rule, N):
    """The DP form: N workers, worker i's rows are micro-batch i, N stages of one time step each."""
    model, batch_fn = small_model("mlp", N)
    opt = optax.sgd(0.05, momentum=0.9)
    cdp = jp.CyclicDataParallel(model, opt, rule=rule, mesh=jp.make_mesh(data=N), nan_bubbles=True)
    state = cdp.init()
    batches = [batch_fn(2 * N, s=k) for k in range(3)]
    for b in batches:
        state, _ = cdp.step(state, b)
    state, _ = cdp.drain(state)
    reads = (delayed_reads if rule == "v1" else cdp_v2_reads)(N, N)
    want = version_table_reference(model, opt, batches, N, reads, False)
    assert rel_err(change(cdp.params(state), model.params), change(want, model.params)) <= 1e-5


@pytest.mark.parametrize("method,D", [("pipeoptim", 2), ("pipeoptim", 4), ("spectrain", 3), ("spectrain", 4)])
def test_predicting_method_equals_the_hand_written_backward(method, D):
    """PipeOptim: F at w(c_F) + (D-1-s) u(c_F), B through F's activations with w(i) (Algorithm 1, Table I for
    SGD-momentum: u, the last update).  SpecTrain: F at distance s//2 + D-1-s, B at distance s//2 (Chen et al.
    §4, its "version difference" for each pass).  SpecTrain runs at D = 3: at D = 2 both rules coincide."""
    got, want, w0 = pipelined_and_by_hand(method, D)
    assert rel_err(got - w0, want - w0) <= 1e-5
    plain = numpy_predicting(w0, tanh_batches(2, 4), 4, lambda s, D: 0, lambda s, D: 0, True)  # no prediction
    assert rel_err(plain - w0, want - w0) > RULE_MARGIN


def predicting_reference(model, opt, batches, M, fwd_dist, bwd_dist):
    """PipeOptim / SpecTrain on any model, one update per micro-batch: stage s's F reads
    w(c) + fwd_dist(s) u(c) with c = max(0, i - (S-1-s)), its B reads w(i) + bwd_dist(s) u(i) (u(c): the
    update that made w(c), zero for c = 0), and B back-propagates through F's activations with B's weights
    (``hand_backward.weights_read_at_backward``).  Tied arrays: the last stage reads stage 0's F version."""
    S = model.num_stages
    hist = [[stage_parts(model, s)] for s in range(S)]
    upd = [[jax.tree.map(jnp.zeros_like, hist[s][0])] for s in range(S)]
    states = [opt.init(h[0]) for h in hist]
    axpy = lambda a, u, w: jax.tree.map(lambda x, y: y + a * x, u, w)
    for b, batch in enumerate(batches):
        n = len(batch["x"]) // M
        for j in range(M):
            i, mb, key = (
                b * M + j,
                {k: v[j * n : (j + 1) * n] for k, v in batch.items()},
                microbatch_key(SEED, b, j),
            )
            c = [max(0, i - (S - 1 - s)) for s in range(S)]
            wF = [axpy(fwd_dist(s, S), upd[s][c[s]], hist[s][c[s]]) for s in range(S)]
            wB = [axpy(bwd_dist(s, S), upd[s][i], hist[s][i]) for s in range(S)]
            ctx = [model.stage_context(mb, key, s) for s in range(S)]
            h = [model.pre(wF[0][1], mb)]
            for s in range(S):
                h.append(model.stage_fn(wF[s][0], h[s], ctx[s]))
            post = wF[S - 1][2]
            for pre_path, post_path in model.tied:
                post = _set(post, post_path, _get(wF[0][1], pre_path))
            mean = lambda q, y: (lambda t: t[0] / t[1])(loss_terms(model.post_loss(q, y, mb)))
            gpost, dy = jax.grad(mean, argnums=(0, 1))(post, h[S])
            g = [None] * S
            for s in reversed(range(S)):
                _, dw, dy = weights_read_at_backward(model.stage_fn, wF[s][0], wB[s][0], h[s], ctx[s], dy)
                g[s] = [
                    dw,
                    jax.tree.map(jnp.zeros_like, hist[s][0][1]),
                    jax.tree.map(jnp.zeros_like, hist[s][0][2]),
                ]
            g[0][1] = jax.vjp(lambda q: model.pre(q, mb), wB[0][1])[1](dy)[0]
            for pre_path, post_path in model.tied:  # the head's use of the tied array: stage 0's gradient
                g[0][1] = _set(g[0][1], pre_path, _get(g[0][1], pre_path) + _get(gpost, post_path))
                gpost = _set(gpost, post_path, jnp.zeros_like(_get(gpost, post_path)))
            g[S - 1][2] = gpost
            for s in range(S):
                u, states[s] = opt.update(tuple(g[s]), states[s], hist[s][-1])
                hist[s].append(optax.apply_updates(hist[s][-1], u))
                upd[s].append(u)
    return assemble(model, [h_[-1] for h_ in hist])


@pytest.mark.parametrize("method,D", [("pipeoptim", 2), ("pipeoptim", 4), ("spectrain", 3), ("spectrain", 4)])
def test_predicting_method_on_the_gpt_equals_weights_read_at_backward(method, D):
    """PipeOptim (D = 2, 4) and SpecTrain (D = 3, 4; at D = 2 it is PipeOptim) on the GPT with dropout, masks
    and a tied head, against the prediction table and the jaxpr-interpreting backward above."""
    M = 2
    model, batch_fn = gpt_model(D)
    opt = optax.sgd(0.05, momentum=0.9)
    batches = [batch_fn(2 * M, s=k) for k in range(3)]
    got = run_pipeline(model, method, opt, batches, M, D)
    want = predicting_reference(model, opt, batches, M, *DISTANCES[method])
    assert rel_err(change(got, model.params), change(want, model.params)) <= 1e-5
    # the prediction matters: no prediction at all (F at w(c), B at w(i)) moves the parameters otherwise
    plain = predicting_reference(model, opt, batches, M, lambda s, S: 0, lambda s, S: 0)
    assert rel_err(change(plain, model.params), change(want, model.params)) > RULE_MARGIN
