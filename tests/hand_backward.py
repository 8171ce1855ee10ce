"""A hand-written backward of a tanh MLP in NumPy (float64), for the weight-predicting rules (PipeOptim,
SpecTrain): F runs on the predicted weights and keeps its activations; B back-propagates through those
activations with the weights B reads -- the paper's Algorithm 1 (PipeOptim) line 14, "backward propagation
using W_t", after the forward at the predicted weights.  Imports nothing from jaxpipe's runtime or its
serial references: the second, independent oracle of those rules."""
import jax.numpy as jnp
import numpy as np

import jaxpipe as jp

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
    mbs = [{k: v[j * (len(b['x']) // M):(j + 1) * (len(b['x']) // M)] for k, v in b.items()} for b in bs for j in range(M)]
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
