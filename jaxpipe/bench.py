"""The plain one-device step every published ratio is measured against, and the benchmark model.

Kept in the library (the rest of the benchmark helpers are the clone's ``experiments.bench``): the plain step
is the reference a user times their pipeline against, the exactness tests compare with it, and the measurement
tools outside the repository import it (``from jaxpipe.bench import make_tanh_mlp, plain_train_step``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from .model import PipelineModel


def make_tanh_mlp(
    stages: int, layers_per_stage: int, width: int, seed: int = 0, pytree: bool = False
) -> PipelineModel:
    """The benchmark model: ``h = tanh(h @ W)`` layers, W ``width x width``, MSE head on the last output.

    ``pytree=True``: the same math with the activation sent as a pair of halves ``(h[:, :w/2], h[:, w/2:])``
    (a pytree of two leaves) -- the cost of pytree activations against one array."""
    key = jax.random.key(seed)
    w = jax.random.normal(key, (stages, layers_per_stage, width, width), jnp.float32) / jnp.sqrt(width)

    def stage_fn(p, h):
        for i in range(layers_per_stage):
            h = jnp.tanh(h @ p[i])
        return h

    if not pytree:
        return PipelineModel(
            stage_fn=stage_fn, stage_params=w, post_loss=lambda _, h, b: jnp.mean((h - b["y"]) ** 2)
        )
    half = width // 2
    split = lambda h: (h[:, :half], h[:, half:])
    join = lambda t: jnp.concatenate(t, axis=-1)
    return PipelineModel(
        stage_fn=lambda p, t: split(stage_fn(p, join(t))),
        stage_params=w,
        pre=lambda _, b: split(b["x"]),
        post_loss=lambda _, t, b: jnp.mean((join(t) - b["y"]) ** 2),
    )


def compiled_costs(compiled):
    """(flops, bytes accessed, temp bytes) of a compiled program (per device), from XLA's own cost analysis
    and buffer assignment (some JAX versions return the analysis as a list of one dict)."""
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return c.get("flops", 0.0), c.get("bytes accessed", 0.0), compiled.memory_analysis().temp_size_in_bytes


def plain_train_step(
    model: PipelineModel,
    opt: optax.GradientTransformation,
    num_microbatches: int,
    per_microbatch: bool = False,
    parts: int = 1,
):
    """One-device step: gradient accumulated over ``num_microbatches`` with ``lax.scan`` (1 = unchunked).

    ``per_microbatch``: the same work as a method that updates after every micro-batch -- M (gradient,
    update) micro-steps in a ``lax.scan``.  ``parts``: the batch split into that many shares, one
    accumulating step each, in turn (AvgPipe's parallel pipelines: one plain step per pipeline's share)."""
    M = num_microbatches

    def micro_steps(params, opt_state, batch):
        mbs = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)

        def one(c, mb):
            params, opt_state, loss = c
            l, g = jax.value_and_grad(model.loss)(params, mb)
            u, opt_state = opt.update(g, opt_state, params)
            return (optax.apply_updates(params, u), opt_state, loss + l / M), None

        return jax.lax.scan(one, (params, opt_state, jnp.zeros(())), mbs)[0]

    def shares(params, opt_state, batch):
        loss = 0.0
        for k in range(parts):
            share = jax.tree.map(lambda a: a.reshape((parts, a.shape[0] // parts) + a.shape[1:])[k], batch)
            params, opt_state, l = step(params, opt_state, share)
            loss = loss + l / parts
        return params, opt_state, loss

    def step(params, opt_state, batch):
        if M == 1:
            loss, g = jax.value_and_grad(model.loss)(params, batch)
        else:
            mbs = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)

            def acc(c, mb):
                l, g = jax.value_and_grad(model.loss)(params, mb)
                return jax.tree.map(jnp.add, c, (l, g)), None

            zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (loss, g), _ = jax.lax.scan(acc, zero, mbs)
            loss, g = jax.tree.map(lambda a: a / M, (loss, g))
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    fn = micro_steps if per_microbatch else (shares if parts > 1 else step)
    return jax.jit(fn, donate_argnums=(0, 1))


#: how a stage holds and runs its layers (the runners' ``--stage_form``): ``scan``, a ``lax.scan`` over the
#: stacked ``[layers, ...]`` array; ``indexed``, a Python loop over ``w[i]`` of the same array (the form of
#: ``jaxpipe.bench.make_tanh_mlp``); ``apart``, a tuple of one array per layer
STAGE_FORMS = ("scan", "indexed", "apart")


def layers_fn(form: str):
    """``stage_fn(w, h)`` of ``tanh(h @ W)`` layers held as ``form`` (:data:`STAGE_FORMS`)."""
    if form not in STAGE_FORMS:
        raise ValueError(f"stage form {form!r}: choose one of {STAGE_FORMS}")
    if form == "scan":
        return lambda w, h: jax.lax.scan(lambda h_, wi: (jnp.tanh(h_ @ wi), None), h, w)[0]

    def loop(w, h):  # "indexed": w[i] of one array; "apart": the tuple's arrays
        for i in range(len(w)):
            h = jnp.tanh(h @ w[i])
        return h

    return loop


def held_as(form: str, stacked):
    """The layers of ``stacked`` (``[..., layers, H, H]``) held as ``form``: as they are, or (``apart``) a
    tuple of ``[..., H, H]`` arrays, one per layer."""
    if form != "apart":
        return stacked
    return tuple(stacked[..., i, :, :] for i in range(stacked.shape[-3]))


def stacked_back(form: str, held):
    """:func:`held_as`'s inverse for a gradient."""
    return jnp.stack(held, axis=-3) if form == "apart" else held
