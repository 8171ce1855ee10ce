"""Did a change to the executor leave every method's compiled program as it was?

Prints one line per variant: every method's step program lowered (``Pipeline.lower("step", ...)``, the
StableHLO text before XLA's passes) for the tests' small MLP and GPT on CPU-emulated devices, and the first
12 hex digits of its sha1.  Run it before and after a change that only moves code, and compare:

    python -m experiments.program_text > before.txt
    # ... the change ...
    python -m experiments.program_text > after.txt && diff before.txt after.txt && echo same

The variants: every synchronous schedule (ZB-H1 in both placements, Chimera's two concatenations), every
asynchronous method, WPipe, Cyclic DP (v1 and v2) and AvgPipe, each at two pipeline stages -- Cyclic DP and
AvgPipe on two data workers too, whose ring policy holds its chunks otherwise than the rest (a refactor
whose check left them out broke them).  Ops are priced at given costs, so nothing is measured.
"""

from __future__ import annotations

import functools
import hashlib

from absl import flags

import experiments
from jaxpipe.cli import common as cli

FLAGS = flags.FLAGS


@functools.cache
def define_flags() -> None:
    """The runner's flags, defined only when it runs (a test that imports the module for its fingerprints
    defines none that would clash with another runner's)."""
    flags.DEFINE_string("models", "mlp,gpt", "the tests' small models to lower each variant for (mlp, gpt)")
    flags.DEFINE_string("only", "", "comma-separated method names: only their variants (default: all)")


#: ``(method, options for Pipeline, model stages, data workers)``: what is lowered
VARIANTS = [
    ("1f1b", {}, 2, 1),
    ("gpipe", {}, 2, 1),
    ("zb_h1", {}, 2, 1),
    ("zb_h1", {"placement": "lanes"}, 2, 1),
    ("zb_v", {}, 4, 1),
    ("dualpipe_v", {}, 4, 1),
    ("interleaved_1f1b", {}, 4, 1),
    ("chimera", {}, 2, 1),
    ("chimera", {"placement": "ordered", "options": {"concat": "forward_doubling"}}, 2, 1),
    ("chimera", {"options": {"concat": "backward_halving"}}, 2, 1),
    ("pipedream", {}, 2, 1),
    ("pipedream_2bw", {}, 2, 1),
    ("spectrain", {}, 2, 1),
    ("pipeoptim", {}, 2, 1),
    ("wpipe", {}, 4, 1),
    ("cdp_v1", {}, 2, 2),
    ("cdp_v2", {}, 2, 2),
    ("avgpipe", {}, 2, 2),
]
#: methods priced at given op costs (the others place no plan by costs)
PRICED = {"1f1b", "gpipe", "zb_h1", "zb_v", "dualpipe_v", "interleaved_1f1b", "chimera"}


def small_model(kind: str, stages: int):
    """The tests' small MLP or GPT (``tests/helpers.small_model``'s sizes) and a batch of 16 rows."""
    import numpy as np

    import jaxpipe as jp

    r = np.random.default_rng(1)
    if kind == "mlp":
        model = jp.models.residual_mlp(stages, in_dim=12, num_classes=5, width=16, seed=0)
        batch = {"x": r.normal(size=(16, 12)).astype(np.float32), "y": r.integers(0, 5, 16).astype(np.int32)}
    else:
        model = jp.models.gpt(stages, vocab=32, d_model=16, heads=2, seq_len=8, seed=0)
        tokens = r.integers(0, 32, (16, 9)).astype(np.int32)
        batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    return model, batch


def fingerprint(kind: str, method: str, options: dict, stages: int, data: int) -> str:
    """The first 12 hex digits of the sha1 of ``method``'s lowered step program for the ``kind`` model."""
    import optax

    import jaxpipe as jp

    model, batch = small_model(kind, stages)
    optimizer = optax.sgd(0.1, momentum=0.9) if method == "spectrain" else optax.sgd(0.1)
    costs = {"op_costs": (1, 1, 1)} if method in PRICED else {}
    pipe = jp.Pipeline(
        model,
        schedule=method,
        num_microbatches=4,
        optimizer=optimizer,
        mesh=jp.make_mesh(stages=2, data=data),
        **costs,
        **options,
    )
    text = pipe.lower("step", pipe.init(), batch).as_text()
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def main(argv):
    del argv
    only = set(filter(None, FLAGS.only.split(",")))
    for kind in FLAGS.models.split(","):
        for method, options, stages, data in VARIANTS:
            if only and method not in only:
                continue
            print(
                kind, method, options or "", f"data={data}", fingerprint(kind, method, options, stages, data)
            )


if __name__ == "__main__":
    experiments.emulate_cpu_devices(4)
    define_flags()
    cli.run(main)
