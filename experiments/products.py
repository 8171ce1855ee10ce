"""The matrix products a pipelined step is made of, under XLA CPU's kernels and PyTorch's, on one core.

The two-process testbed's layer is ``tanh(h @ W)`` (W ``--width``², ``--rows`` rows a micro-batch): its
forward product ``h @ W``, its backward's weight product ``h.T @ g`` and input product ``g @ W.T``, and the
testbed's ``--layers`` layers forward and backward as ``jax.grad`` of a ``lax.scan`` (what a stage and the
plain step compile to). Each is timed with XLA's default kernels (this jaxlib fuses a product into a YNNPACK
call) and with YNNPACK turned off for that program
(``compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""}``: Eigen's product), and with PyTorch (one
thread) where ``--peer_python`` names a Python with ``torch``. Best of 5 repeats of ``--number`` calls, glibc
keeping freed memory as a ``Pipeline`` on CPU has it (:func:`jaxpipe.host_memory.keep_freed_memory`). Run it
pinned, nothing beside it, as a testbed process runs:

    taskset -c 0 python -m experiments.products
    taskset -c 0 python -m experiments.products --rows=64 --peer_python=VENV/bin/python

A step's gap to PyTorch's that this table shows is the backend's kernels, not the pipeline.
"""

from __future__ import annotations

import functools
import json
import subprocess
import timeit

from absl import flags

from jaxpipe.cli import common as cli


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined when it runs (importing the module defines none)."""
    flags.DEFINE_integer("rows", 32, "rows of a micro-batch (the testbed: 256 / M)")
    flags.DEFINE_integer("width", 1024, "layer width")
    flags.DEFINE_integer("layers", 8, "layers in the forward-and-backward row")
    flags.DEFINE_integer("number", 10, "calls a timed repeat")
    flags.DEFINE_integer("unroll", 1, "the scan's unroll in the forward-and-backward row (--layers: fully)")
    flags.DEFINE_string("peer_python", "", "a Python with torch: PyTorch's column (empty: none)")


FLAGS = flags.FLAGS

KERNELS = {"XLA default": {}, "XLA, YNNPACK off": {"xla_cpu_experimental_ynn_fusion_type": ""}}
WORK = ("forward h @ W", "weight h.T @ g", "input g @ W.T")

TORCH = """
import json, sys, timeit, torch
rows, width, layers, number = (int(a) for a in sys.argv[1:])
torch.set_num_threads(1)
h, g, W = torch.ones(rows, width), torch.ones(rows, width), torch.ones(width, width) / width ** 0.5
Ws = [(torch.ones(width, width) / width ** 0.5).requires_grad_() for _ in range(layers)]
def stack():
    x = h
    for w in Ws:
        x = torch.tanh(x @ w)
    (x ** 2).sum().backward()
fns = [lambda: h @ W, lambda: h.T @ g, lambda: g @ W.T, stack]
print(json.dumps([min(timeit.repeat(f, number=number, repeat=5)) / number for f in fns]))
"""


def xla_times(options) -> list:
    import jax
    import jax.numpy as jnp

    rows, width = FLAGS.rows, FLAGS.width
    h, g, W = jnp.ones((rows, width)), jnp.ones((rows, width)), jnp.ones((width, width)) / width**0.5
    Ws = jnp.ones((FLAGS.layers, width, width)) / width**0.5

    def stack(Ws, h):
        return jnp.sum(jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), h, Ws, unroll=FLAGS.unroll)[0] ** 2)

    programs = [
        (lambda h, g, W: h @ W, (h, g, W)),
        (lambda h, g, W: h.T @ g, (h, g, W)),
        (lambda h, g, W: g @ W.T, (h, g, W)),
        (jax.grad(stack), (Ws, h)),
    ]
    times = []
    for fn, args in programs:
        compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)
        call = lambda: jax.block_until_ready(compiled(*args))  # noqa: E731
        call()
        times.append(min(timeit.repeat(call, number=FLAGS.number, repeat=5)) / FLAGS.number)
    return times


def torch_times() -> list:
    args = [str(v) for v in (FLAGS.rows, FLAGS.width, FLAGS.layers, FLAGS.number)]
    out = subprocess.run([FLAGS.peer_python, "-c", TORCH, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    from jaxpipe import host_memory

    host_memory.keep_freed_memory()  # as a Pipeline on CPU does, before XLA's threads start
    columns = {}
    for name, options in KERNELS.items():
        try:
            columns[name] = xla_times(options)
        except Exception as e:  # noqa: BLE001 -- a jaxlib without that option: the column is left out
            print(f"{name}: not measured ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    if FLAGS.peer_python:
        columns["PyTorch, 1 thread"] = torch_times()
    rows = (*WORK, f"{FLAGS.layers} layers forward and backward")
    print(f"{FLAGS.rows} rows, width {FLAGS.width}; ms a call (best of 5 x {FLAGS.number})")
    print(f"{'work':<34s}" + "".join(f"{c:>20s}" for c in columns))
    for i, row in enumerate(rows):
        print(f"{row:<34s}" + "".join(f"{t[i] * 1e3:20.3f}" for t in columns.values()))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
