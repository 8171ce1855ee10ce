"""Your own model, the first time: a Flax NNX transformer written without jaxpipe in mind, pipelined.

The model: a token embedding with learned positions, 4 pre-LN blocks (causal + padding attention mask,
dropout 0.1), an LM head tied to the token embedding (the head reuses the embedding's Variable). The data:
byte-level text with sequences of different lengths, padded. What this script does, as a user would:

1. checks the pipelined loss and gradients against ``nnx.value_and_grad`` of the untouched modules (dropout
   off for the check);
2. trains with 1F1B in bfloat16 (float32 master weights), checkpointing, then "restarts": a new process
   would build the same Pipeline and resume from the checkpoint -- done here in-process;
3. trains the same modules with PipeDream-2BW (asynchronous: no flush) and drains it;
4. gets NNX modules back from the trained parameters and checks that the head still shares the embedding.

    python examples/own_transformer.py               # about a minute on 2 CPU cores
    python examples/own_transformer.py --steps=4     # a quick run (the tests run this)

The same model in the runner, with its whole loop (checkpoints, preemption, the launcher, TensorBoard):

    python -m experiments.train --model=examples.own_transformer:factory --schedule=1f1b --stages=4 \
        --batch=16 --microbatches=4 --steps=60 --checkpoint_dir=/tmp/own  # SIGTERM it, run again: resumed
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # before JAX is imported

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpipe as jp

VOCAB, T, WIDTH, HEADS, LAYERS, STAGES = 256, 32, 64, 4, 4, 4


# ----------------------------------------------------------------------------------------- the user's model
class Embed(nnx.Module):
    def __init__(self, rngs):
        self.tok = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (T, WIDTH)) * 0.02)

    def __call__(self, tokens):
        return self.tok(tokens) + self.pos[...][: tokens.shape[1]]


class Head(nnx.Module):
    """Final layer norm, then logits against the token embedding: the same Variable (a tied head)."""

    def __init__(self, embed: Embed, rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.table = embed.tok.embedding

    def __call__(self, x):
        return self.norm(x) @ self.table[...].T


class Block(nnx.Module):
    def __init__(self, rngs, dropout: float):
        self.ln1, self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs), nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs), nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)
        self.dropout = dropout

    def _drop(self, h, key):
        if key is None or self.dropout == 0.0:
            return h
        keep = jax.random.bernoulli(key, 1.0 - self.dropout, h.shape)
        return jnp.where(keep, h / (1.0 - self.dropout), 0.0).astype(h.dtype)

    def __call__(self, x, pad, key=None):
        """``pad``: [batch, T] 1 for real tokens; ``key``: dropout (None: off)."""
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        mask = causal[None, None] & (pad[:, None, None, :] > 0)
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = x + self._drop(self.attn(self.ln1(x), mask=mask), k1)
        return x + self._drop(self.down(jax.nn.gelu(self.up(self.ln2(x)))), k2)


def make_modules(seed: int = 0, dropout: float = 0.1):
    rngs = nnx.Rngs(seed)
    embed = Embed(rngs)
    return [Block(rngs, dropout) for _ in range(LAYERS)], embed, Head(embed, rngs)


def masked_ce(logits, batch):
    """(sum of the real tokens' cross-entropies, their number): an exact masked mean over the whole batch."""
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), batch["y"][..., None], -1)[
        ..., 0
    ]
    m = batch["pad"].astype(jnp.float32)
    return jnp.sum(ce * m), jnp.sum(m)


def full_loss(blocks, embed, head, batch):
    """The untouched model's loss, no pipeline (dropout off)."""
    x = embed(batch["x"])
    for b in blocks:
        x = b(x, batch["pad"])
    s, n = masked_ce(head(x), batch)
    return s / n


# ----------------------------------------------------------------------------------------- data
def batches(text: np.ndarray, n: int, seed: int):
    """Windows of ``T + 1`` bytes cut to random lengths ``T/4 .. T`` and padded (``pad`` marks real
    tokens)."""
    r = np.random.default_rng(seed)
    while True:
        starts = r.integers(0, len(text) - T - 1, n)
        seq = np.stack([text[s : s + T + 1] for s in starts]).astype(np.int32)
        lengths = r.integers(T // 4, T + 1, n)
        pad = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
        yield {"x": seq[:, :-1] * pad, "y": seq[:, 1:] * pad, "pad": pad}


# ----------------------------------------------------------------------------------------- pipelining it
def pipelined(modules, schedule: str, precision=None):
    blocks, embed, head = modules
    # each block gets the micro-batch's padding mask and its own dropout key from the stage context
    model, to_modules = jp.models.from_nnx(
        blocks,
        embed,
        head,
        masked_ce,
        num_stages=STAGES,
        stage_inputs=("pad",),
        block_call=lambda apply, p, x, ctx: apply(p, x, ctx.inputs["pad"], ctx.key),
    )
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        optimizer=optax.adamw(3e-3),
        mesh=jp.make_mesh(stages=STAGES),
        precision=precision,
        seed=0,
    )
    return pipe, to_modules


def factory(stages: int, batch: int, seed: int):
    """``jaxpipe train --model=examples.own_transformer:factory``: the model cut into ``stages`` stages, its
    training batches (a function that starts the seeded stream: a resumed run skips what it used) and held-out
    batches (``jaxpipe.cli.factories``)."""
    from jaxpipe.cli.factories import TrainParts

    blocks, embed, head = make_modules(seed)
    model, to_modules = jp.models.from_nnx(
        blocks,
        embed,
        head,
        masked_ce,
        num_stages=stages,
        stage_inputs=("pad",),
        block_call=lambda apply, p, x, ctx: apply(p, x, ctx.inputs["pad"], ctx.key),
        integer_inputs={"x": VOCAB, "y": VOCAB},
    )
    train_text, val_text = jp.data.byte_corpus()
    held_out = batches(val_text, batch, seed=10_000 + seed)
    return TrainParts(
        model,
        lambda: batches(train_text, batch, seed),
        [next(held_out) for _ in range(2)],
        unit="tokens",
        per_row=T,
        to_modules=to_modules,
    )


class Whole(nnx.Module):
    """The three parts in one graph, so that ``nnx.grad`` sees the head's and the embedding's shared Variable
    as one (differentiating the embedding alone would miss the head's use of it)."""

    def __init__(self, blocks, embed, head):
        self.blocks, self.embed, self.head = nnx.List(blocks), embed, head


def check_exact(batch):
    """Step 1: the pipeline computes the untouched model's loss and gradients (float32, dropout off)."""
    modules = make_modules(dropout=0.0)
    pipe, _ = pipelined(modules, "1f1b")
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref = nnx.value_and_grad(lambda w: full_loss(list(w.blocks), w.embed, w.head, batch))(
        Whole(*modules)
    )
    g_tok, r_tok = (
        grads[1]["tok"]["embedding"],
        ref.embed.tok.embedding[...],
    )  # the tied array: both uses summed
    err = float(jnp.linalg.norm(g_tok - r_tok) / jnp.linalg.norm(r_tok))
    print(
        f"exactness: loss {float(loss):.6f} vs {float(ref_loss):.6f}; tied embedding gradient rel. error "
        f"{err:.1e}"
    )
    return abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)), err


def train(pipe, state, data, steps: int, ckpt=None, start: int = 0):
    for step in range(start, steps):
        state, metrics = pipe.step(state, next(data))
        if ckpt is not None:
            ckpt.maybe_save(step + 1, state)
    print(f"  {pipe.schedule.name}: step {steps}, loss {float(metrics['loss']):.3f}")
    return state


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    train_text, _ = jp.data.byte_corpus()
    batch = next(batches(train_text, 16, seed=1))
    loss_err, grad_err = check_exact(batch)

    # 2. 1F1B in bfloat16, checkpointed; a restart resumes from the checkpoint
    bf16 = jp.Precision(params="float32", compute="bfloat16")
    with tempfile.TemporaryDirectory() as d:
        pipe, _ = pipelined(make_modules(), "1f1b", bf16)
        ckpt = jp.Checkpointer(d, pipe, keep=2, every=max(args.steps // 4, 1))
        data = batches(train_text, 16, seed=2)
        half = args.steps // 2
        state = train(pipe, pipe.init(), data, half, ckpt)
        ckpt.close()
        # ... the process ends here; a new one builds the same Pipeline and resumes:
        pipe, to_modules = pipelined(make_modules(), "1f1b", bf16)
        ckpt = jp.Checkpointer(d, pipe, keep=2, every=max(args.steps // 4, 1))
        state, _, start = ckpt.restore_latest(pipe.prepare(pipe.init(), batch))
        print(f"  resumed from the checkpoint of step {start}")
        state = train(pipe, state, data, args.steps, ckpt, start)
        ckpt.close()

    # 3. the same modules under an asynchronous schedule
    pipe2, _ = pipelined(make_modules(), "pipedream_2bw", bf16)
    state2 = train(pipe2, pipe2.init(), batches(train_text, 16, seed=2), args.steps)
    state2, _ = pipe2.drain(state2)

    # 4. NNX modules again, with the trained weights; the head still shares the embedding
    blocks, embed, head = to_modules(pipe.params(state))
    shared = head.table is embed.tok.embedding
    val = full_loss(blocks, embed, head, batch)
    print(
        f"trained modules: loss on the first batch {float(val):.3f}; head shares the embedding's Variable: "
        f"{shared}"
    )
    return {
        "loss_err": loss_err,
        "grad_err": grad_err,
        "shared": shared,
        "resumed_from": start,
        "final_loss": float(val),
    }


if __name__ == "__main__":
    main()
