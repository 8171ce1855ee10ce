"""What one accelerator shows that CPU cannot, in one run: the executor with no pipeline to hide it
(D = 1) against the plain step and the two-lane sketch, four back-to-back calls' return times, XLA's bytes
and temp, and an offloading residual policy against keeping every residual.

    python -m experiments.gpu_check                    # one GPU: under 8 minutes on an H200
    python -m experiments.gpu_check --small            # tiny sizes on any backend (the tests run it on CPU)
    python -m experiments.gpu_check --out=gpu.md       # the table also written there, for the benchmarks page

Each row is a ratio to the plain one-device step doing the same work, measured in the same process:

* ``loss_and_grad``: the gradient over M micro-batches -- the plain ``lax.scan`` accumulation, jaxpipe's 1F1B
  program, the two-lane sketch (``experiments/sketch_two_lane.py``) -- timed streamed (N calls, one wait);
* ``step``: AdamW steps, the plain jitted step against ``Pipeline.step`` blocked and streamed;
* ``bytes`` / ``temp``: XLA's cost analysis and buffer assignment of each compiled step;
* ``four calls``: the times at which four back-to-back ``Pipeline.step`` calls return, in units of one
  blocked step (the host runs two steps ahead: 0, 0, 1, 2 is the design);
* ``jp.train``: the training loop's steady step, its metrics read while the next step runs
  (``overlap_steps=True``) and before it starts, against a bare loop of ``Pipeline.step``
  (``experiments/loop_overhead.py``);
* ``offload``: ``residuals=`` a ``jax.checkpoint_policies.save_and_offload_only_these_names`` policy moving
  each layer's output to pinned host memory, against ``residuals="all"`` -- step time and temp (where the
  backend has no host memory space the row says so).
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import NamedTuple

from absl import flags

from jaxpipe.cli.common import run as run_cli

FLAGS = flags.FLAGS


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_bool("small", False, "tiny sizes (seconds on CPU): checks that every row runs")
    flags.DEFINE_string("out", "", "also write the Markdown table to this file")
    flags.DEFINE_integer("calls", 20, "calls per streamed timing")
    flags.DEFINE_integer("rounds", 5, "timing rounds (the median is reported)")


#: (label, layers, width, rows a step, micro-batches)
SIZES = [("MLP 4 x 4096^2, 1024 rows", 4, 4096, 1024, 8), ("MLP 4 x 1024^2, 256 rows", 4, 1024, 256, 8)]
SMALL_SIZES = [("MLP 2 x 64^2, 32 rows", 2, 64, 32, 4)]


def _streamed(fn, calls: int, rounds: int) -> float:
    """Seconds a call of ``fn()``, called ``calls`` times back to back with one wait (median of rounds)."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _blocked(fn, rounds: int) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(3 * rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model(layers: int, width: int):
    """The benchmark MLP with a scanned stage whose layer outputs are named ``"layer_out"`` (what the
    offloading policy moves)."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    import jaxpipe as jp

    w = jax.random.normal(jax.random.key(0), (1, layers, width, width), jnp.float32) / jnp.sqrt(width)

    def stage_fn(p, h):
        layer = lambda h, wi: (checkpoint_name(jnp.tanh(h @ wi), "layer_out"), None)
        return jax.lax.scan(layer, h, p)[0]

    return jp.PipelineModel(
        stage_fn=stage_fn, stage_params=w, post_loss=lambda _, h, b: jnp.mean((h - b["y"]) ** 2)
    )


def _pipeline(model, M, **kw):
    import optax

    import jaxpipe as jp

    return jp.Pipeline(model, schedule="1f1b", num_microbatches=M, optimizer=optax.adamw(1e-4), **kw)


def _offload_policy():
    import jax

    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["layer_out"],
        offload_src="device",
        offload_dst="pinned_host",
    )


class _PipelineStep(NamedTuple):
    """``Pipeline.step`` as timed: a blocked call, a streamed call (seconds), its XLA temp (bytes)."""

    blocked: float
    streamed: float
    temp: float


def measure(label, layers, width, rows, M) -> list:
    """The rows of the table for one size: ``[(what, value)]``."""
    import jax
    import jax.numpy as jnp

    model = _model(layers, width)
    key = jax.random.key(1)
    batch = {"x": jax.random.normal(key, (rows, width)), "y": jnp.zeros((rows, width))}
    pipe = _pipeline(model, M)
    pbatch = pipe.shard_batch(batch)
    out = _gradient_rows(model, pipe, batch, pbatch, M)
    rows_of_steps, timed = _step_rows(model, pipe, batch, pbatch, M)
    out += rows_of_steps
    out.append(
        ("four back-to-back calls return at (blocked steps)", _four_calls(pipe, pbatch, timed.blocked))
    )
    out.append(_loop_row(pipe, pbatch))
    out.append(("offloading residual policy", _offload(model, pbatch, M, timed)))
    return [(f"{label}, M = {M}", "")] + out


def _gradient_rows(model, pipe, batch, pbatch, M) -> list:
    """The gradient alone, streamed: the plain ``lax.scan`` accumulation, jaxpipe's 1F1B program, the
    two-lane sketch."""
    import jax
    import jax.numpy as jnp

    from experiments.sketch_two_lane import sketch_loss_and_grad

    calls, rounds = FLAGS.calls, FLAGS.rounds
    plain_grad = jax.jit(
        lambda p, b: jax.lax.scan(
            lambda acc, mb: (jax.tree.map(lambda a, g: a + g / M, acc, jax.grad(model.loss)(p, mb)), None),
            jax.tree.map(jnp.zeros_like, p),
            jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), b),
        )[0]
    )
    t_plain = _streamed(lambda: plain_grad(model.params, batch), calls, rounds)
    state = pipe.init()
    t_pipe = _streamed(lambda: pipe.loss_and_grad(state, pbatch)[1], calls, rounds)
    sketch, args = sketch_loss_and_grad(model.params[0][0], batch["x"], batch["y"], 1, M)
    t_sketch = _streamed(lambda: sketch(*args), calls, rounds)
    return [
        ("loss_and_grad, plain accumulation", f"{t_plain * 1e3:.3f} ms"),
        ("loss_and_grad, jaxpipe 1F1B (D = 1)", f"{t_pipe / t_plain:.3f}x"),
        ("loss_and_grad, two-lane sketch (D = 1)", f"{t_sketch / t_plain:.3f}x"),
    ]


class _Stepping:
    """``pipe.step`` on a state of its own, kept between calls; a call returns the step's loss."""

    def __init__(self, pipe, batch):
        self.pipe, self.batch, self.state = pipe, batch, pipe.init()

    def __call__(self):
        self.state, metrics = self.pipe.step(self.state, self.batch)
        return metrics["loss"]


def _step_rows(model, pipe, batch, pbatch, M):
    """``(rows, _PipelineStep)``: AdamW steps, the plain jitted step against ``Pipeline.step`` blocked and
    streamed, and XLA's bytes accessed and temp of each compiled step."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxpipe.bench import compiled_costs, plain_train_step

    calls, rounds = FLAGS.calls, FLAGS.rounds
    opt = optax.adamw(1e-4)
    plain = plain_train_step(model, opt, M)
    params = jax.tree.map(jnp.copy, model.params)  # the plain step donates its arguments
    box = {"p": params, "o": opt.init(params)}

    def plain_step():
        box["p"], box["o"], loss = plain(box["p"], box["o"], batch)
        return loss

    step = _Stepping(pipe, pbatch)
    b_plain, s_plain = _blocked(plain_step, rounds), _streamed(plain_step, calls, rounds)
    b_pipe, s_pipe = _blocked(step, rounds), _streamed(step, calls, rounds)
    _, bytes_plain, temp_plain = compiled_costs(plain.lower(box["p"], box["o"], batch).compile())
    _, bytes_pipe, temp_pipe = compiled_costs(pipe.lower("step", step.state, pbatch).compile())
    rows = [
        ("step, plain (blocked / streamed)", f"{b_plain * 1e3:.3f} / {s_plain * 1e3:.3f} ms"),
        ("step, Pipeline.step blocked / streamed", f"{b_pipe / b_plain:.3f}x / {s_pipe / s_plain:.3f}x"),
        (
            "XLA bytes accessed / temp of the step",
            f"{bytes_pipe / bytes_plain:.3f}x / {temp_pipe / max(temp_plain, 1):.3f}x",
        ),
    ]
    return rows, _PipelineStep(b_pipe, s_pipe, temp_pipe)


def _four_calls(pipe, pbatch, blocked: float) -> str:
    """When each of four back-to-back ``Pipeline.step`` calls returns, in blocked steps."""
    import jax

    step = _Stepping(pipe, pbatch)
    jax.block_until_ready(step())
    returns, t0 = [], time.perf_counter()
    for _ in range(4):
        step()
        returns.append((time.perf_counter() - t0) / blocked)
    jax.block_until_ready(step.state)
    return " / ".join(f"{r:.2f}" for r in returns)


def _loop_row(pipe, pbatch):
    """The training loop: ``jp.train``'s steady step, its metrics read while the next step runs or before
    it starts, against a bare loop of ``Pipeline.step``."""
    from experiments.bench import LOOPS, loop_seconds

    loops = loop_seconds(pipe, pbatch, 2 * FLAGS.calls)
    return (
        "jp.train overlapped / read one by one (x the bare pipe.step loop)",
        f"{loops[LOOPS[1]] / loops[LOOPS[0]]:.3f}x / {loops[LOOPS[2]] / loops[LOOPS[0]]:.3f}x",
    )


def _offload(model, pbatch, M, timed: _PipelineStep) -> str:
    """An offloading residual policy against keeping every residual: step time and temp (or why it did not
    run: a backend without a host memory space, an XLA that refuses the offload)."""
    from jaxpipe.bench import compiled_costs

    try:
        off = _pipeline(model, M, residuals=_offload_policy())
        step = _Stepping(off, pbatch)
        s_off = _streamed(step, FLAGS.calls, FLAGS.rounds)
        _, _, temp_off = compiled_costs(off.lower("step", step.state, pbatch).compile())
        return (
            f"step {s_off / timed.streamed:.3f}x, temp {temp_off / max(timed.temp, 1):.3f}x of "
            "residuals='all'"
        )
    except Exception as e:  # noqa: BLE001 -- the row says why
        return f"not run here: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main(argv):
    import jax

    d = jax.devices()[0]
    head = (
        f"jax {jax.__version__}, {d.platform} ({getattr(d, 'device_kind', '')}), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `python -m experiments.gpu_check"
        f"{' --small' if FLAGS.small else ''}`"
    )
    lines = [head, "", "| what | value |", "|---|---|"]
    for size in SMALL_SIZES if FLAGS.small else SIZES:
        for what, value in measure(*size):
            lines.append(f"| **{what}** | |" if not value else f"| {what} | {value} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    define_flags()
    run_cli(main)
