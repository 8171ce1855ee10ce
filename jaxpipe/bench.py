"""Benchmark helpers shared by ``experiments.throughput`` (timings are ratios measured in one process)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import jax
import jax.numpy as jnp
import optax

from .model import PipelineModel


def make_tanh_mlp(stages: int, layers_per_stage: int, width: int, seed: int = 0) -> PipelineModel:
    """The benchmark model: ``h = tanh(h @ W)`` layers, W ``width x width``, MSE head on the last output."""
    key = jax.random.key(seed)
    w = jax.random.normal(key, (stages, layers_per_stage, width, width), jnp.float32) / jnp.sqrt(width)

    def stage_fn(p, h):
        for i in range(layers_per_stage):
            h = jnp.tanh(h @ p[i])
        return h

    return PipelineModel(stage_fn=stage_fn, stage_params=w,
                         post_loss=lambda _, h, b: jnp.mean((h - b["y"]) ** 2))


def median_time(fn: Callable[[], object], steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def plain_train_step(model: PipelineModel, opt: optax.GradientTransformation, num_microbatches: int):
    """One-device step: gradient accumulated over ``num_microbatches`` with ``lax.scan`` (1 = unchunked)."""
    M = num_microbatches

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

    return jax.jit(step, donate_argnums=(0, 1))


def plain_steps(model: PipelineModel, batch, num_microbatches: int, opt, steps: int) -> Dict[str, float]:
    dev = jax.devices()[0]
    out = {}
    for name, m in (("accum_s", num_microbatches), ("unchunked_s", 1)):
        fn = plain_train_step(model, opt, m)
        b = jax.device_put(batch, dev)
        params = jax.device_put(model.params, dev, may_alias=False)
        st = {"p": params, "o": jax.jit(opt.init)(params)}

        def run():
            st["p"], st["o"], loss = fn(st["p"], st["o"], b)
            return loss

        out[name] = median_time(run, steps)
    return out


def bench_schedule(name: str, model: PipelineModel, batch, num_microbatches: int, opt, steps: int,
                   compile_m2: int, plain: Dict[str, float], data: int = 1) -> Dict[str, float]:
    from . import Pipeline, make_mesh
    mesh = make_mesh(stages=model.num_stages, data=data)

    def compile_time(m):
        pipe = Pipeline(model, schedule=name, num_microbatches=m, optimizer=opt, mesh=mesh)
        st = pipe.init()
        t0 = time.perf_counter()
        compiled = pipe.lower("step", st, batch).compile()
        return time.perf_counter() - t0, compiled, pipe, st

    c1, compiled, pipe, state = compile_time(num_microbatches)
    mem = compiled.memory_analysis()
    b = pipe.shard_batch(batch)
    st = {"s": state}

    def run():
        st["s"], metrics = pipe.step(st["s"], b)
        return metrics["loss"]

    t = median_time(run, steps)
    c2 = compile_time(compile_m2)[0] if compile_m2 else float("nan")
    rep = pipe.schedule.simulate(f=1.0, b=2.0)
    return {"schedule": name, "step_s": t, "overhead": t / plain["accum_s"],
            "vs_unchunked": t / plain["unchunked_s"], "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
            "compile_s": c1, "compile_s_m2": c2, "lockstep_bubble": rep.lockstep_bubble_ratio,
            "bubble": rep.bubble_ratio}
