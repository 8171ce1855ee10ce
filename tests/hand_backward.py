"""A hand-written backward of a tanh MLP in NumPy (float64), for the weight-predicting rules (PipeOptim,
SpecTrain): F runs on the predicted weights and keeps its activations; B back-propagates through those
activations with the weights B reads -- the paper's Algorithm 1 (PipeOptim) line 14, "backward propagation
using W_t", after the forward at the predicted weights.  Imports nothing from jaxpipe's runtime or its
serial references: the second, independent oracle of those rules."""

import jax.numpy as jnp
import numpy as np

import jaxpipe as jp

L, H, N, LR, MU = 2, 8, 8, 0.05, 0.9  # layers per stage, width, rows per micro-batch, sgd lr, momentum


def tanh_mlp(D, seed=0):
    w = np.random.default_rng(seed).normal(size=(D, L, H, H)).astype(np.float32) / np.sqrt(H)

    def stage_fn(p, h):
        for i in range(L):
            h = jnp.tanh(h @ p[i])
        return h

    model = jp.PipelineModel(
        stage_fn=stage_fn, stage_params=jnp.asarray(w), post_loss=lambda _, h, b: jnp.mean((h - b["y"]) ** 2)
    )
    return model, w.astype(np.float64)


def batches(k, M, seed=1):
    r = np.random.default_rng(seed)
    return [
        {"x": r.normal(size=(M * N, H)).astype(np.float32), "y": r.normal(size=(M * N, H)).astype(np.float32)}
        for _ in range(k)
    ]


def numpy_predicting(w0, bs, M, fwd_dist, bwd_dist, momentum):
    """PipeOptim / SpecTrain by hand: F on w + d_F u, B through F's activations with w + d_B u (u: the last
    SGD(-momentum) update), an update after every micro-batch."""
    D = w0.shape[0]
    hist = [[w0[s]] for s in range(D)]
    upd = [[np.zeros_like(w0[s])] for s in range(D)]
    buf = [np.zeros_like(w0[s]) for s in range(D)]
    mbs = [
        {k: v[j * (len(b["x"]) // M) : (j + 1) * (len(b["x"]) // M)] for k, v in b.items()}
        for b in bs
        for j in range(M)
    ]
    for i, mb in enumerate(mbs):
        wF = [
            hist[s][max(0, i - (D - 1 - s))] + fwd_dist(s, D) * upd[s][max(0, i - (D - 1 - s))]
            for s in range(D)
        ]
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
            da = dt * (1.0 - t**2)
            grads[s][l] = hin.T @ da
            dt = da @ wB[s][l].T  # B's weights, F's activations
        for s in range(D):
            buf[s] = MU * buf[s] + grads[s] if momentum else grads[s]
            u = -LR * buf[s]
            hist[s].append(hist[s][-1] + u)
            upd[s].append(u)
    return np.stack([h_[-1] for h_ in hist])


def weights_read_at_backward(fn, w_f, w_b, x, ctx, dy):
    """PyTorch's autograd semantics when the parameters are swapped between the forward and the backward
    (PipeOptim's code restores the cached weights before ``backward()``), written as a small interpreter of
    ``fn``'s jaxpr, independent of jaxpipe's residual machinery: the forward runs at ``w_f`` and keeps every
    value; the backward visits the equations in reverse and takes each one's own VJP with the values that
    depend on the weights alone (a weight, its transpose, ...) recomputed at ``w_b`` and every other value
    (activations, masks, dropout bits) as the forward computed it.  Returns ``(y, dw, dx)``."""
    import jax

    with jax.disable_jit():  # nested jits inlined: one flat list of primitives
        closed = jax.make_jaxpr(lambda w, x_: fn(w, x_, ctx))(w_f, x)
    jaxpr = closed.jaxpr
    wl_f, wl_b, xl = jax.tree.leaves(w_f), jax.tree.leaves(w_b), jax.tree.leaves(x)
    n_w = len(wl_f)
    is_lit = lambda v: type(v).__name__ == "Literal"

    def run(weights, only_weights):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, list(weights) + xl))
        weight_only = set(jaxpr.invars[:n_w]) | set(jaxpr.constvars)
        for e in jaxpr.eqns:
            ins = [v.val if is_lit(v) else env.get(v) for v in e.invars]
            pure = all(is_lit(v) or v in weight_only for v in e.invars)
            if only_weights and not pure:
                continue
            outs = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
            outs = outs if e.primitive.multiple_results else [outs]
            env.update(zip(e.outvars, outs))
            if pure:
                weight_only.update(e.outvars)
        return env, weight_only

    env_f, weight_only = run(wl_f, False)
    env_b, _ = run(wl_b, True)
    read = lambda v: v.val if is_lit(v) else (env_b[v] if v in weight_only else env_f[v])
    ct = dict(zip(jaxpr.outvars, jax.tree.leaves(dy)))
    floating = lambda a: jnp.issubdtype(jnp.result_type(a), jnp.inexact)
    for e in reversed(jaxpr.eqns):
        cts = [ct.get(v) for v in e.outvars]
        if all(c is None for c in cts):
            continue
        ins = [read(v) for v in e.invars]
        diff = [i for i, (v, a) in enumerate(zip(e.invars, ins)) if not is_lit(v) and floating(a)]
        if not diff:
            continue

        def op(*d, e=e, ins=ins, diff=diff):
            args = list(ins)
            for i, a in zip(diff, d):
                args[i] = a
            out = e.primitive.bind(*args, **e.primitive.get_bind_params(e.params))
            return out if e.primitive.multiple_results else [out]

        outs, pull = jax.vjp(op, *[ins[i] for i in diff])
        grads = pull([c if c is not None else jnp.zeros_like(o) for c, o in zip(cts, outs)])
        for i, g in zip(diff, grads):
            v = e.invars[i]
            ct[v] = g if v not in ct else ct[v] + g
    zeros = lambda v, a: ct.get(v, jnp.zeros_like(a))
    dw = jax.tree.unflatten(jax.tree.structure(w_f), [zeros(v, a) for v, a in zip(jaxpr.invars[:n_w], wl_f)])
    dx = jax.tree.unflatten(jax.tree.structure(x), [zeros(v, a) for v, a in zip(jaxpr.invars[n_w:], xl)])
    y = jax.tree.unflatten(
        jax.tree.structure(dy), [read(v) if not is_lit(v) else v.val for v in jaxpr.outvars]
    )
    return y, dw, dx


#: (F's, B's) prediction distance of stage s of S: PipeOptim (eq. 4; B reads the current weights), SpecTrain
#: (Chen et al. §4, its "version difference" for each pass)
DISTANCES = {
    "pipeoptim": (lambda s, S: S - 1 - s, lambda s, S: 0),
    "spectrain": (lambda s, S: s // 2 + S - 1 - s, lambda s, S: s // 2),
}


def pipelined_and_by_hand(method, D, M=4, **pipeline_kw):
    """``(got, want, w0)``: the tanh MLP trained two batches + drain by ``method``'s pipeline (NaN bubbles,
    SGD-momentum; ``pipeline_kw`` to ``jp.Pipeline``) and by :func:`numpy_predicting`, float64 weights."""
    import optax

    model, w0 = tanh_mlp(D)
    bs = batches(2, M)
    want = numpy_predicting(w0, bs, M, *DISTANCES[method], True)
    pipe = jp.Pipeline(
        model,
        schedule=method,
        num_microbatches=M,
        optimizer=optax.sgd(LR, momentum=MU),
        mesh=jp.make_mesh(stages=D),
        nan_bubbles=True,
        **pipeline_kw,
    )
    state = pipe.init()
    for b in bs:
        state, _ = pipe.step(state, b)
    state, _ = pipe.drain(state)
    return np.asarray(pipe.params(state)[0], np.float64), want, w0
