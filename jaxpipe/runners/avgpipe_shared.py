"""AvgPipe in the paper's setting: N parallel pipelines sharing the same D devices (Xu et al., §3.2, eqs. 2
and 8: the n* / n terms -- each device holds its partition of every replica).

``jp.Pipeline(model, schedule="avgpipe", mesh=jp.make_mesh(stages=D), optimizer=opt, options={"shared": N})``

The N pipelines run in the same ticks of one schedule: each micro-batch slot carries one micro-batch of
every pipeline, and every stage op is the user's stage applied to the N replicas at once
(:func:`shared_model`: ``jax.vmap`` over a replica axis of the weights and the activation).  Replica ``r``
trains on the ``r``-th share of the global batch (the rows the ``pipe``-axis form gives pipe index ``r``),
split into the same M micro-batches, so each replica's gradient is the pipe-axis form's; the elastic
averaging is the same optax transform over the replica axis -- here a local mean, no communication.  The
numbers equal the ``pipe``-axis form's (tested); what changes is where the replicas live: N x the stage's
weights and activations on each of D devices instead of N x D devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..errors import ConfigError
from ..model import PipelineModel


def check_shareable(model: PipelineModel, N: int):
    if model.context:
        raise ConfigError(
            "avgpipe shared=N runs the N replicas' stage ops as one vmapped op, which cannot give "
            "each replica its own stage context (dropout key per micro-batch and pipeline); use "
            "the pipe-axis form (jp.make_mesh(pipes=N, stages=D)) for a context model"
        )
    if model.tied:
        raise ConfigError(
            "avgpipe shared=N: tied parameters are not supported in the shared-device form; use "
            "the pipe-axis form (jp.make_mesh(pipes=N, stages=D))"
        )
    if N < 1:
        raise ConfigError(
            f"avgpipe shared={N!r}: give the number of parallel pipelines (>= 1) that share the stage devices"
        )


def shared_model(model: PipelineModel, N: int, params) -> PipelineModel:
    """The model of N replicas run together: stage leaves ``[S, N, ...]``, pre/post leaves ``[N, ...]``, a
    micro-batch of ``N x rows`` rows (replica-major), the activation ``[N, rows, ...]``; the loss is the sum
    of the replicas' mean losses (each replica's gradient is its own loss's).  ``params``: the shared layout's
    ``(stage, pre, post)`` (arrays or avals, :func:`to_executor`)."""
    split = lambda mb: jax.tree.map(lambda a: a.reshape((N, a.shape[0] // N) + a.shape[1:]), mb)

    def post_loss(q, y, mb):
        losses = jax.vmap(model.post_loss)(q, y, split(mb))
        if isinstance(losses, tuple):
            raise ConfigError(
                "avgpipe shared=N needs a scalar mean post_loss: a (sum, count) pair would be "
                "normalised per replica, which one summed loss cannot express"
            )
        return jnp.sum(losses)

    return dataclasses.replace(
        model,
        stage_fn=jax.vmap(model.stage_fn),
        stage_params=params[0],
        pre_params=params[1],
        post_params=params[2],
        pre=lambda p, mb: jax.vmap(model.pre)(p, split(mb)),
        post_loss=post_loss,
        head=None,
    )


def to_executor(params):
    """``(w [N, S, ...], pre, post)`` (the replica-major state layout) -> the shared model's layout."""
    w, pre, post = params
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), w), pre, post


def from_executor(grads):
    w, pre, post = grads
    return jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), w), pre, post


def interleave_shares(batch, N: int, M: int):
    """The global batch's rows rearranged so that micro-batch ``j`` holds micro-batch ``j`` of every
    replica's share, replica-major (share ``r`` = rows ``[r B/N, (r+1) B/N)``, as the pipe axis splits
    them)."""

    def one(a):
        B = a.shape[0]
        if B % (N * M):
            raise ConfigError(
                f"avgpipe shared={N}: the batch's {B} rows must split into {N} shares of {M} "
                f"micro-batches; use a multiple of {N * M}"
            )
        x = a.reshape((N, M, B // (N * M)) + a.shape[1:])
        return jnp.swapaxes(x, 0, 1).reshape(a.shape)

    return jax.tree.map(one, batch)
