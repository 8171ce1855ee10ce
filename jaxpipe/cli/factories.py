"""Models for ``jaxpipe train``: ``--model=gpt``, ``--model=mlp`` or ``--model=package.module:factory`` --
your own model with the runner's whole loop (checkpoints and resume, preemption and stop signals, the launcher
and its watchdog, non-finite handling, evaluation, progress, metrics, TensorBoard, the saved config).

A factory is a function ``factory(stages, batch, seed) -> TrainParts`` (or a dict of its fields):

* ``stages`` -- how many model stages to cut the model into (the mesh's stages times the schedule's stages per
  device: ``interleaved_1f1b`` with ``--virtual=2`` on 4 devices asks for 8);
* ``batch``, ``seed`` -- ``--batch`` rows a step and ``--seed``.

It returns the :class:`~jaxpipe.PipelineModel` (``jp.models.from_nnx`` / ``from_linen`` make one from Flax
modules), the training batches and, optionally, evaluation batches.  The training batches resume where a
checkpoint left them: give an object with ``state_dict()`` / ``load_state_dict()`` (``jaxpipe.data``'s streams
have them), or a function of no arguments that starts the stream over -- a resumed run then skips the batches
the checkpoint had used (the same batches, in the same order, if the stream is seeded).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import itertools
from typing import Any, Callable, Optional, Sequence

from absl import app, flags

from jaxpipe.errors import ConfigError
from jaxpipe.training import streams

FLAGS = flags.FLAGS


@dataclasses.dataclass
class TrainParts:
    model: Any  # jaxpipe.PipelineModel in `stages` stages
    batches: Any  # a resumable stream (state_dict / load_state_dict) or a restartable function
    eval_batches: Sequence[Any] = ()
    unit: str = "examples"  # what the throughput counts ...
    per_row: int = 1  # ... per batch row (a sequence's tokens)
    evaluate: Optional[Callable] = None  # (params, batch) -> {"eval_...": float}; default: the model's loss
    #: ``from_nnx`` / ``from_linen``'s second result: ``--save_params`` then writes the parameters in the
    #: modules' own layout (``blocks/0/attn/kernel``, ``embed/...``, ``head/...``), not the pipeline's
    to_modules: Optional[Callable] = None


def resumable(batches):
    """``batches`` as a stream the runner can checkpoint (module docstring)."""
    try:
        return streams.resumable(batches)
    except ConfigError as e:
        raise app.UsageError(f"the factory's {e}") from None


def load(spec: str) -> Callable:
    """The factory ``package.module:function`` names."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise app.UsageError(
            f"--model={spec}: give gpt, mlp, or package.module:factory (a function of "
            f"(stages, batch, seed) returning the model and its batches; see jaxpipe.cli.factories)"
        )
    try:
        if os.getcwd() not in sys.path and "" not in sys.path:  # the console script: as python -m does
            sys.path.insert(0, os.getcwd())
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise app.UsageError(
            f"--model={spec}: cannot import {module!r} ({e}); run from the directory that holds "
            f"it, or put it on PYTHONPATH"
        )
    except AttributeError:
        raise app.UsageError(f"--model={spec}: {module!r} has no {name!r}")
    return fn


#: flags that shape the runner's own models only: a user's factory builds its model itself, so giving one of
#: these with --model=package.module:factory would be ignored (and written to config.flags as if it applied)
MODEL_FLAGS = (
    "cut",
    "blocks",
    "blocks_per_stage",
    "d_model",
    "heads",
    "seq_len",
    "dropout",
    "tie_embeddings",
    "pad",
    "sample_len",
)


def build(spec: str, stages: int, batch: int, seed: int) -> TrainParts:
    """The parts of the model ``--model`` names, its batches resumable."""
    fn = {"gpt": gpt, "mlp": mlp}.get(spec)
    if fn is None:
        given = [f"--{n}={FLAGS[n].value}" for n in MODEL_FLAGS if FLAGS[n].value != FLAGS[n].default]
        if given:
            raise app.UsageError(
                f"{', '.join(given)}: flag(s) of the runner's own models (--model=gpt / mlp); "
                f"--model={spec} builds its model itself and would ignore them. Drop them and set "
                f"the model's shape in the factory (it gets the stage count, --batch and --seed)"
            )
        fn = load(spec)
    parts = fn(stages, batch, seed)
    if isinstance(parts, dict):
        fields = [f.name for f in dataclasses.fields(TrainParts)]
        unknown, missing = (
            sorted(set(parts) - set(fields)),
            [k for k in ("model", "batches") if k not in parts],
        )
        if unknown or missing:
            import difflib

            near = {k: difflib.get_close_matches(k, fields, 1) for k in unknown}
            said = [
                f"unknown key {k!r}" + (f" (did you mean {near[k][0]!r}?)" if near[k] else "")
                for k in unknown
            ]
            said += [f"no {k!r}" for k in missing]
            raise app.UsageError(
                f"--model={spec} returned a dict with {', '.join(said)}; its keys are the fields "
                f"of jaxpipe.cli.factories.TrainParts: {', '.join(fields)} (model and batches "
                f"needed)"
            )
        parts = TrainParts(**parts)
    if not isinstance(parts, TrainParts):
        raise app.UsageError(
            f"--model={spec} returned a {type(parts).__name__}; a factory returns "
            f"jaxpipe.cli.factories.TrainParts(model=..., batches=...) or a dict of its fields"
        )
    return dataclasses.replace(parts, batches=resumable(parts.batches), eval_batches=list(parts.eval_batches))


def gpt(stages: int, batch: int, seed: int) -> TrainParts:
    """The reference byte-level GPT of the runner's GPT flags on the bundled text."""
    import jaxpipe as jp

    train, val = jp.data.byte_corpus()
    say = print if __import__("jax").process_index() == 0 else (lambda *a, **k: None)
    model = _gpt(stages, train, say)
    batches = jp.data.lm_batches(train, batch, FLAGS.seq_len, seed=seed, pad=FLAGS.pad)
    evals = list(
        itertools.islice(
            jp.data.lm_batches(val, batch, FLAGS.seq_len, seed=10_000 + seed, pad=FLAGS.pad),
            FLAGS.eval_batches,
        )
    )
    return TrainParts(model, batches, evals, unit="bytes", per_row=FLAGS.seq_len)


def mlp(stages: int, batch: int, seed: int) -> TrainParts:
    """The residual MLP on scikit-learn's bundled digits; evaluation adds the accuracy."""
    import jax.numpy as jnp
    import numpy as np
    import jaxpipe as jp

    if FLAGS.dropout or FLAGS.tie_embeddings or FLAGS.pad or FLAGS.tensor > 1 or FLAGS.fsdp > 1 or FLAGS.cut:
        raise app.UsageError(
            "--dropout, --tie_embeddings, --pad, --tensor, --fsdp and --cut are options of --model=gpt"
        )
    train, val = jp.data.digits(seed=seed)
    model = jp.models.residual_mlp(
        stages, 64, 10, width=FLAGS.d_model, layers_per_stage=FLAGS.blocks_per_stage, seed=seed
    )

    def evaluate(params, b):
        acc = jnp.mean(jnp.argmax(model.head(params[2], model.forward(params, b)), -1) == b["y"])
        return {"eval_acc": float(np.asarray(acc))}

    return TrainParts(
        model, jp.data.class_batches(train, batch, seed=seed), [val], unit="images", evaluate=evaluate
    )


def _gpt(n_stages, train, say):
    """The reference GPT of the flags: ``--blocks_per_stage`` on each of ``n_stages`` stages, or ``--cut``'s
    uneven stages (one count per device; a two-chunk schedule splits each) or the balanced cut."""
    import jaxpipe as jp

    kw = dict(
        d_model=FLAGS.d_model,
        heads=FLAGS.heads,
        seq_len=FLAGS.seq_len,
        seed=FLAGS.seed,
        dropout=FLAGS.dropout,
        tie_embeddings=FLAGS.tie_embeddings,
        masked=FLAGS.pad,
        tensor="tensor" if FLAGS.tensor > 1 else None,
        fsdp="fsdp" if FLAGS.fsdp > 1 else None,
    )
    if not FLAGS.cut:
        return jp.models.gpt(n_stages, blocks_per_stage=FLAGS.blocks_per_stage, **kw)
    if FLAGS.cut != "balanced":
        try:
            cut = [int(c) for c in FLAGS.cut.split(",")]
        except ValueError:
            raise app.UsageError(
                f"--cut={FLAGS.cut}: give block counts per stage (e.g. 3,3,2,2) or 'balanced'"
            )
        return jp.models.gpt(FLAGS.stages, cut=cut, **kw)
    from jaxpipe.cuts import even_cut
    from jaxpipe.cuts.balanced import balance

    n = FLAGS.blocks or FLAGS.stages * FLAGS.blocks_per_stage
    example = next(jp.data.lm_batches(train, FLAGS.batch, FLAGS.seq_len, seed=FLAGS.seed, pad=FLAGS.pad))
    rows = FLAGS.batch // (FLAGS.data * FLAGS.microbatches)
    model, choice = balance(
        jp.models.gpt(FLAGS.stages, cut=even_cut(n, FLAGS.stages), **kw),
        FLAGS.stages,
        {k: v[:rows] for k, v in example.items()},
        FLAGS.schedule,
        FLAGS.microbatches,
        verbose=False,
    )
    say(f"--cut=balanced: {choice}")
    return model
