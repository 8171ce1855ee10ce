"""Reference model 2: a small GPT-style byte-level transformer (Flax NNX).

pre: token + position embedding; each stage: ``blocks_per_stage`` pre-LayerNorm transformer blocks (causal
multi-head self-attention, GELU MLP); post: final LayerNorm, linear head to the vocabulary, next-token
cross-entropy.  Batches are ``{"x": int[B, T], "y": int[B, T]}`` with y the next byte after each x.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..model import PipelineModel
from .common import module_apply, softmax_xent, split_pure, stacked_stages


class CausalSelfAttention(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        if d % heads:
            raise ValueError(f"model width {d} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        B, T, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        split = lambda a: a.reshape(B, T, self.heads, d // self.heads)
        q, k, v = split(q), split(k), split(v)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(x.dtype)
        mask = jnp.tril(jnp.ones((T, T), bool))
        att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(B, T, d)
        return self.proj(out)


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = CausalSelfAttention(d, heads, rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPTStage(nnx.Module):
    def __init__(self, d: int, heads: int, blocks: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(blocks)])

    def __call__(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


class Embed(nnx.Module):
    def __init__(self, vocab: int, d: int, seq_len: int, rngs: nnx.Rngs):
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d)))

    def __call__(self, tokens):
        return self.tok(tokens) + self.pos[...][: tokens.shape[-1]]


class LMHead(nnx.Module):
    def __init__(self, d: int, vocab: int, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, x):
        return self.out(self.ln(x))


def gpt(num_stages: int, vocab: int = 256, d_model: int = 64, heads: int = 4, blocks_per_stage: int = 1,
        seq_len: int = 64, seed: int = 0) -> PipelineModel:
    """A byte-level GPT cut into ``num_stages`` stages; ``model.head(post_params, h)`` gives logits."""
    stage_fn, stage_params = stacked_stages(lambda r: GPTStage(d_model, heads, blocks_per_stage, r),
                                            num_stages, seed)
    emb_def, emb_params = split_pure(Embed(vocab, d_model, seq_len, nnx.Rngs(seed * 1000)))
    head_def, head_params = split_pure(LMHead(d_model, vocab, nnx.Rngs(seed * 1000 + 999)))
    embed, head = module_apply(emb_def), module_apply(head_def)
    return PipelineModel(
        stage_fn=stage_fn, stage_params=stage_params,
        pre=lambda p, b: embed(p, b["x"]), pre_params=emb_params,
        post_loss=lambda p, h, b: softmax_xent(head(p, h), b["y"]), post_params=head_params,
        head=head)


def sample(model: PipelineModel, params, prompt: bytes, length: int, seq_len: int, key,
           temperature: float = 0.8) -> bytes:
    """Generate ``length`` bytes after ``prompt`` with the unpipelined model (for the train runner)."""
    stage_p, pre_p, post_p = params

    @jax.jit
    def next_logits(tokens):
        h = model.forward(params, {"x": tokens[None]})
        return model.head(post_p, h)[0]

    toks = list(prompt[-seq_len:]) or [10]
    out = bytearray()
    for _ in range(length):
        window = toks[-seq_len:]
        padded = jnp.asarray(window + [0] * (seq_len - len(window)), jnp.int32)
        logits = next_logits(padded)[len(window) - 1]
        key, sub = jax.random.split(key)
        nxt = int(jax.random.categorical(sub, logits / max(temperature, 1e-6)))
        toks.append(nxt)
        out.append(nxt)
    return bytes(out)
