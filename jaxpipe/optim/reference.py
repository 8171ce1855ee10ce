"""Serial references of the asynchronous methods (docs/design.md §4: the correctness backbone).

A plain single-device loop over micro-batches in order, with no ticks, no stash slots, no messages: for
every micro-batch and stage it picks the weights the method's rule says F and B read, runs the model
stage by stage, and lands each stage's update when the rule says.  The pipelined run must equal it.

Rules, with ``c_F(s, i) = max(0, i - (D - 1 - s))`` the updates stage ``s`` has applied when micro-batch
``i``'s F runs there, and ``i`` the updates it has applied when its B runs (lockstep no-flush 1F1B):
pipedream   F, B: w_s[c_F]                                           update after every micro-batch
pipeoptim   F: w_s[c_F] + (D-1-s) u_s[c_F];  B: w_s[i]                update after every micro-batch
spectrain   F: w_s[c_F] + (s//2 + D-1-s) u_s[c_F];  B: w_s[i] + (s//2) u_s[i]
2bw         F, B of batch b: w_s[max(b-1, 0)]; after batch b: w_s[b+1] = w_s[b] + update(mean grad)
wpipe       (2D partitions) as 2bw on G0 = stages < D, and F, B of batch b read w_s[b] on G1 (WPipe eq. 1)
where ``u_s[c]`` is the update that produced ``w_s[c]`` (zero for c = 0).  Each stage has its own
optimizer state over its local parameters (w_s, pre, post); only stage 0 gets gradients for ``pre`` and
only stage D-1 for ``post``.  Tied arrays (``PipelineModel(tied=...)``, ``jaxpipe.tying``) live in stage 0's
``pre`` only: the last stage's use of micro-batch ``i`` reads the version stage 0's F read for ``i``, and its
gradient joins stage 0's gradient of ``i``.  F keeps the activations it computed; B backpropagates through
them with the weights B reads (``rebuild_pullback``), as PipeOptim's and SpecTrain's implementations do.  Each
rule is the ``reference`` of its method's declaration (:mod:`jaxpipe.schedules.registry`).
"""

from __future__ import annotations

from typing import Dict, List

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..model import loss_terms, microbatch_key
from ..runtime.residuals import rebuild_pullback, residual_mask, split_residuals
from ..schedules.registry import METHODS
from ..tying import Ties


def global_microbatches(batch, num_microbatches: int, data_parallel: int = 1) -> List[dict]:
    """The micro-batches the pipeline forms from a global batch: replica r takes rows [r n/R, (r+1) n/R) and
    splits them into M; micro-batch j is the union of every replica's j-th chunk."""
    R, M = data_parallel, num_microbatches
    out = []
    for j in range(M):

        def take(a):
            a = np.asarray(a)
            n = a.shape[0] // (R * M)
            return np.concatenate([a[(r * M + j) * n : (r * M + j + 1) * n] for r in range(R)])

        out.append(jax.tree.map(take, batch))
    return out


def _microbatch_grads(model, ties, fwd, bwd, ctx_of, x0, wF, wB, mb, i, by_count):
    """One micro-batch through every stage serially: ``(loss, count, grads)`` with ``grads[s] = (dw, dpre,
    dpost)`` of stage ``s``; F of stage s reads ``wF[s]``, B reads ``wB[s]``.  ``by_count``: a (sum, count)
    loss whose gradient is of the sum (an accumulating method divides by the step's count)."""
    D = len(wF)
    pre0, post0 = wF[0][1], wF[D - 1][2]
    # forward, stage by stage, keeping each stage's activation residuals
    x = model.pre(wF[0][1], mb)
    res = []
    for s in range(D):
        x, r = fwd(wF[s][0], x, ctx_of(mb, i, s))
        res.append(r)
    # tied arrays: the last stage reads the version stage 0's forward read; their gradient joins stage 0's
    q_last = ties.post_with(wF[D - 1][2], ties.pre_leaves(wF[0][1]))
    # a (sum, count) loss: a per-micro-batch update reads this global micro-batch's sum over its count; an
    # accumulating method sums the micro-batches' gradients of the sums and divides by the step's count
    terms = lambda q, y: loss_terms(model.post_loss(q, y, mb))
    if by_count:
        (loss_sum, n_mb), (gpost, dy) = jax.value_and_grad(terms, argnums=(0, 1), has_aux=True)(q_last, x)
        loss = loss_sum / n_mb
    else:
        n_mb = 1.0
        # a micro-batch whose every token is masked (count 0) contributes nothing (its sum is 0 too)
        loss, (gpost, dy) = jax.value_and_grad(
            lambda q, y: (lambda sc: sc[0] / jnp.where(sc[1] > 0, sc[1], 1.0))(terms(q, y)), argnums=(0, 1)
        )(q_last, x)
    gpost, g_tied = ties.take_post(gpost)
    grads = [None] * D
    for s in reversed(range(D)):
        dw, dy = bwd(wB[s][0], res[s], dy)
        dy = jax.tree.map(lambda d, a: d.astype(a.dtype), dy, x0)
        dpre = jax.tree.map(jnp.zeros_like, pre0)
        if s == 0:
            dpre = ties.add_to_pre(jax.vjp(lambda q: model.pre(q, mb), wB[0][1])[1](dy)[0], g_tied)
        dpost = gpost if s == D - 1 else jax.tree.map(jnp.zeros_like, post0)
        grads[s] = (dw, dpre, dpost)
    return loss, n_mb, grads


def _checked_rule(method: str):
    """``method``'s serial rule (its declaration's ``reference``); a ValueError names the known ones."""
    rule = METHODS[method].reference if method in METHODS else None
    if rule is None:
        known = ", ".join(n for n, m in METHODS.items() if m.reference is not None)
        raise ValueError(f"no serial reference for {method!r}; known: {known}")
    return rule


def _stage_ops(model, w_like, x0, ctx0):
    """``(fwd, bwd)``: a stage's forward keeping its activation residuals, and the pullback rebuilt from them
    with the weights B reads.  Jitted: a pullback's residuals come out in the traced mask's structure only
    under tracing (eagerly, JAX builds the pullback differently)."""
    x_like = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), x0)  # activations may be pytrees
    mask, _ = residual_mask(model.stage_fn, w_like, x_like, ctx0)
    ctx_like = jax.tree.map(jnp.zeros_like, ctx0)
    fwd = jax.jit(lambda w, x, c: split_residuals(model.stage_fn, w, x, mask, c)[:2])
    bwd = jax.jit(lambda w, res, dy: rebuild_pullback(model.stage_fn, w, x_like, res, mask, ctx_like)(dy))
    return fwd, bwd


class _BatchSums:
    """An accumulating method's gradient sums per stage over a batch of M micro-batches, and the batch's
    loss count (a (sum, count) loss divides by it; a mean loss by M)."""

    def __init__(self, D: int, M: int, summed: bool):
        self.M, self.summed, self.sums, self.count = M, summed, [None] * D, 0.0

    def add(self, s: int, i: int, grad, count: float):
        """Add micro-batch ``i``'s gradient of stage ``s``; the batch's mean gradient where ``i`` ends it,
        else None."""
        held = self.sums[s]
        self.sums[s] = grad if held is None else jax.tree.map(jnp.add, held, grad)
        if s == 0:
            self.count += count
        if i % self.M != self.M - 1:
            return None
        div = self.M if not self.summed else (self.count if self.count > 0 else 1.0)
        mean, self.sums[s] = jax.tree.map(lambda a: a / div, self.sums[s]), None
        if s == len(self.sums) - 1:
            self.count = 0.0
        return mean


def _land_update(opt, grad, versions, updates, ostate, s, options) -> None:
    """Stage ``s``'s update from ``grad``: its new weights appended to ``versions``, the update that made
    them to ``updates`` (PipeOptim's ``"decay_free"`` prediction keeps the update without weight decay:
    PipeOptim, Table I)."""
    cur = versions[-1]
    u, new_state = opt.update(grad, ostate[s], cur)
    versions.append(optax.apply_updates(cur, u))
    if (options or {}).get("prediction") == "decay_free":
        u = opt.update(grad, ostate[s], jax.tree.map(jnp.zeros_like, cur))[0]
    ostate[s] = new_state
    updates.append(u)


def _is_summed(model, mb) -> bool:
    """Whether the model's loss is a (sum, count) pair."""
    out = jax.eval_shape(lambda p, b: model.forward(p, b, key=jax.random.PRNGKey(0)), model.params, mb)
    return model.reduction(out, mb) == "sum"


def serial_reference(
    model,
    method: str,
    opt: optax.GradientTransformation,
    num_microbatches: int,
    batches,
    data_parallel: int = 1,
    seed: int = 0,
    options=None,
    drains=(),
) -> Dict[str, object]:
    """Run ``method`` serially over ``batches`` (global batches, each of M micro-batches), fill and drain
    included.  Returns ``{"params": (w [D..], pre, post), "losses": [per micro-batch]}``.  ``options``: the
    method's options where its rule depends on them (PipeOptim's ``distance`` and ``prediction``).  A context
    model's stage s gets micro-batch i's key ``stage_key(microbatch_key(seed, i // M, i % M), s)`` (one
    replica). ``drains``: the batch counts after which the pipeline was drained: a per-micro-batch method's
    rule counts micro-batches, batches and weight versions from there (an accumulating method's batch-counted
    versions go on); the updates, the optimizer state and the keys' global micro-batch index go on."""
    user_layout, model = model.user_layout, model.padded()  # uneven stages: padded as the pipeline holds them
    if model.context and data_parallel != 1:
        raise ValueError(
            "the serial reference of a context model runs one replica (its global micro-batches "
            "join the replicas', which have their own keys); use data_parallel=1"
        )
    rule, accumulating = _checked_rule(method), METHODS[method].accumulating
    D, M = model.num_stages, num_microbatches
    ties = Ties(model)
    w0, pre0, post0 = ties.strip(model.params)
    local = [(jax.tree.map(lambda a: a[s], w0), pre0, post0) for s in range(D)]
    hist = [[lp] for lp in local]  # hist[s][c]: version after c updates
    upd = [[jax.tree.map(jnp.zeros_like, lp)] for lp in local]  # upd[s][c]: the update that made it
    ostate = [opt.init(lp) for lp in local]
    mbs = [mb for b in batches for mb in global_microbatches(b, M, data_parallel)]
    x0 = jax.eval_shape(model.pre, pre0, mbs[0])
    ctx_of = lambda mb, i, s: (
        model.stage_context(mb, microbatch_key(seed, i // M, i % M), s) if model.context else None
    )
    fwd, bwd = _stage_ops(model, local[0][0], x0, ctx_of(mbs[0], 0, 0))
    axpy = lambda a, x, y: jax.tree.map(lambda xx, yy: yy + jnp.asarray(a, yy.dtype) * xx, x, y)
    summed = _is_summed(model, mbs[0])
    batch_sums, losses = _BatchSums(D, M, summed), []
    # a drain restarts a per-micro-batch method's stream: i0, v0 = its first micro-batch, each stage's version
    restarts, i0, v0 = {int(n) * M * data_parallel for n in drains}, 0, [0] * D
    extra = {"o": options} if options else {}

    for i, mb in enumerate(mbs):
        if i in restarts and not accumulating:  # (an accumulating method's versions count batches: go on)
            i0, v0 = i, [len(h) - 1 for h in hist]
        read = [
            rule(s, i - i0, (i - i0) // M, D, M, hist[s][v0[s] :], upd[s][v0[s] :], axpy, **extra)
            for s in range(D)
        ]
        wF, wB = [r[0] for r in read], [r[1] for r in read]
        loss, n_mb, grads = _microbatch_grads(
            model, ties, fwd, bwd, ctx_of, x0, wF, wB, mb, i, accumulating and summed
        )
        losses.append(float(loss))
        for s in range(D):
            g = batch_sums.add(s, i, grads[s], n_mb) if accumulating else grads[s]
            if g is not None:
                _land_update(opt, g, hist[s], upd[s], ostate, s, options)

    final = [h[-1] for h in hist]
    stacked = user_layout(jax.tree.map(lambda *a: jnp.stack(a), *[f[0] for f in final]))
    return {"params": ties.fill((stacked, final[0][1], final[D - 1][2])), "losses": losses}


def avgpipe_reference(
    model,
    opt: optax.GradientTransformation,
    num_pipes: int,
    num_microbatches: int,
    batches,
    alpha=None,
    data_parallel: int = 1,
) -> Dict[str, object]:
    """AvgPipe serially: for each global batch, pipeline ``i`` takes rows ``[i n/N, (i+1) n/N)``, computes
    its loss and gradient with plain ``jax.grad`` of the unpipelined model (the mean over its M x data
    micro-batches), its local update with its own optimizer state, and then every replica is diluted with
    the reference, ``w_i <- (1 - a) w_i + a ref + u_i``, ``ref <- ref + mean_i u_i`` (AvgPipe §3.2).  Tied
    arrays are held once (at their pre path) with the sum of their uses as gradient.
    Returns ``{"params": reference model, "replicas": [per pipe], "losses": [per step, per pipe]}``."""
    from .elastic import check_alpha

    N, M = num_pipes, num_microbatches
    a = check_alpha(alpha, N)
    ties = Ties(model)
    reps = [jax.tree.map(jnp.asarray, ties.strip(model.params)) for _ in range(N)]
    states = [opt.init(p) for p in reps]
    ref = jax.tree.map(jnp.asarray, ties.strip(model.params))

    def mean_loss(params, mbs):
        params = ties.fill(params)
        terms = [model.loss_sum_count(params, mb) for mb in mbs]
        y = jax.eval_shape(lambda p, b: model.forward(p, b, key=jax.random.PRNGKey(0)), params, mbs[0])
        if model.reduction(y, mbs[0]) == "sum":
            return sum(t[0] for t in terms) / sum(t[1] for t in terms)
        return sum(t[0] for t in terms) / M

    vg = jax.jit(jax.value_and_grad(mean_loss))
    losses = []
    for batch in batches:
        n = jax.tree.leaves(batch)[0].shape[0] // N
        us, row = [], []
        for i in range(N):
            rows = jax.tree.map(lambda x: np.asarray(x)[i * n : (i + 1) * n], batch)
            l, g = vg(reps[i], global_microbatches(rows, M, data_parallel))
            u, states[i] = opt.update(g, states[i], reps[i])
            us.append(u)
            row.append(float(l))
        losses.append(row)
        reps = [
            optax.apply_updates(
                reps[i],
                jax.tree.map(
                    lambda w, r, uu: (a * (r.astype(w.dtype) - w) + uu).astype(w.dtype), reps[i], ref, us[i]
                ),
            )
            for i in range(N)
        ]
        mean_u = jax.tree.map(lambda *u: jnp.mean(jnp.stack(u), axis=0), *us)
        ref = jax.tree.map(lambda r, uu: r + uu.astype(r.dtype), ref, mean_u)
    return {"params": ties.fill(ref), "replicas": [ties.fill(r) for r in reps], "losses": losses}
