"""Reference model 2: a small GPT-style byte-level transformer (Flax NNX).

pre: token + position embedding; each stage: ``blocks_per_stage`` pre-LayerNorm transformer blocks (causal
multi-head self-attention, GELU MLP); post: final LayerNorm, linear head to the vocabulary, next-token
cross-entropy.  Batches are ``{"x": int[B, T], "y": int[B, T]}`` with y the next byte after each x.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from flax import nnx

from ..errors import ConfigError
from ..model import PipelineModel
from .common import module_apply, softmax_xent, split_pure, stacked_stages


class CausalSelfAttention(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        if d % heads:
            raise ValueError(f"model width {d} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, keep=None):
        B, T, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        split = lambda a: a.reshape(B, T, self.heads, d // self.heads)
        q, k, v = split(q), split(k), split(v)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(x.dtype)
        mask = jnp.tril(jnp.ones((T, T), bool))
        if keep is not None:  # key padding: no token attends to padding (the diagonal stays, no NaN)
            mask = mask & ((keep[:, None, None, :] > 0) | jnp.eye(T, dtype=bool))
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

    def __call__(self, x, key=None, rate=0.0, keep=None):
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        x = x + _dropout(self.attn(self.ln1(x), keep), k1, rate)
        return x + _dropout(self.down(jax.nn.gelu(self.up(self.ln2(x)))), k2, rate)


def _dropout(h, key, rate):
    """GPT-2's residual dropout (inverted: kept values scaled by 1 / (1 - rate))."""
    if key is None or not rate:
        return h
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
    return jnp.where(keep, h / (1.0 - rate), 0).astype(h.dtype)


class GPTStage(nnx.Module):
    def __init__(self, d: int, heads: int, blocks: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(blocks)])

    def __call__(self, x, key=None, rate=0.0, keep=None):
        keys = jax.random.split(key, len(self.blocks)) if key is not None else [None] * len(self.blocks)
        for blk, k in zip(self.blocks, keys):
            x = blk(x, k, rate, keep)
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


class TiedHead(nnx.Module):
    """The output head of a tied-embedding LM: logits = LN(h) @ E^T + b, E the input embedding."""

    def __init__(self, d: int, vocab: int, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((vocab,)))

    def __call__(self, x, emb):
        return self.ln(x) @ emb.T.astype(x.dtype) + self.bias[...].astype(x.dtype)


#: :func:`gpt`'s arguments that a balanced cut builds the same model with, at its measured cut
_SAME_MODEL = (
    "vocab",
    "d_model",
    "heads",
    "seq_len",
    "seed",
    "dropout",
    "tie_embeddings",
    "masked",
    "tensor",
    "fsdp",
)


def gpt(
    num_stages: int,
    vocab: int = 256,
    d_model: int = 64,
    heads: int = 4,
    blocks_per_stage: int = 1,
    seq_len: int = 64,
    seed: int = 0,
    dropout: float = 0.0,
    tie_embeddings: bool = False,
    masked: bool = False,
    tensor: Optional[str] = None,
    fsdp: Optional[str] = None,
    cut: Optional[Sequence[int]] = None,
    balance: Optional[dict] = None,
) -> PipelineModel:
    """A byte-level GPT cut into ``num_stages`` stages; ``model.head(post_params, h)`` gives logits.

    A model given a cut is a model of blocks: its checkpoints move between cuts and stage counts (the even
    form, without ``cut=``, is one module per stage; ``cut=[blocks_per_stage] * num_stages`` is the same model
    as blocks).

    Args:
        num_stages: model stages.
        vocab: the vocabulary (256: bytes).
        d_model: the width.
        heads: attention heads.
        blocks_per_stage: transformer blocks on every stage (without ``cut``).
        seq_len: the longest sequence (the positional embedding's length).
        seed: the parameters' seed.
        dropout: GPT-2's residual dropout inside the stages (keys from the stage context, so every schedule
            drops the same units).
        tie_embeddings: the head is ``LN(h) @ E^T + b`` with ``E`` the input embedding, declared tied (one
            array).
        masked: batches carry ``"mask"`` (1 on real tokens, ``jp.data.lm_batches(pad=True)``): padding is
            masked out of attention and the loss is the exact mean over real tokens (``post_loss`` returns
            ``(sum, count)``).
        tensor: a mesh axis to shard the stages over, Megatron-style (:func:`megatron_specs`).
        fsdp: a mesh axis to shard the weights over (FSDP).
        cut: blocks per stage (``[3, 3, 2, 2]``; ``blocks_per_stage`` unused), or ``"balanced"``: the
            ``num_stages x blocks_per_stage`` blocks cut from measured costs
            (:func:`jaxpipe.cuts.resolve_cut`).
        balance: with ``cut="balanced"``: ``{"example": micro_batch, "schedule": "1f1b"}``.

    Returns:
        The :class:`~jaxpipe.PipelineModel`.
    """
    kw = {name: value for name, value in locals().items() if name in _SAME_MODEL}  # what a re-cut keeps
    cut = _checked_cut(cut, balance, num_stages, blocks_per_stage, kw)
    if cut is not None:
        apply, stage_params = stacked_stages(lambda r: Block(d_model, heads, r), sum(cut), seed)
    else:
        apply, stage_params = stacked_stages(
            lambda r: GPTStage(d_model, heads, blocks_per_stage, r), num_stages, seed
        )
    emb_def, emb_params = split_pure(Embed(vocab, d_model, seq_len, nnx.Rngs(seed * 1000)))
    embed = module_apply(emb_def)
    head, head_params, tied = _head(d_model, vocab, seed, tie_embeddings, emb_params)
    context = bool(dropout) or masked
    stage_fn, block_fn = _layer_functions(apply, cut is not None, context, dropout)
    specs = _specs(stage_params, emb_params, head_params, tensor, fsdp, cut) if tensor or fsdp else None
    return PipelineModel(
        stage_fn=stage_fn,
        stage_params=stage_params,
        block_fn=block_fn,
        cut=cut,
        pre=lambda p, b: embed(p, b["x"]),
        pre_params=emb_params,
        post_loss=_post_loss(head, masked),
        post_params=head_params,
        head=head,
        context=context,
        stage_inputs=("mask",) if masked else (),
        tied=tied,
        integer_inputs={"x": vocab, "y": vocab},
        param_specs=specs,
    )


def _checked_cut(cut, balance, num_stages: int, blocks_per_stage: int, kw: dict):
    """``cut`` resolved (``"balanced"``: from measured costs) and checked; None for the even form."""
    if isinstance(cut, str):
        from ..cuts import resolve_cut

        n = num_stages * blocks_per_stage
        cut = resolve_cut(cut, lambda k: gpt(k, cut=(1,) * k, **kw), num_stages, n, balance)
    elif balance is not None:
        raise ConfigError("balance= goes with cut='balanced'")
    if cut is None:
        return None
    from ..cuts import check_cut

    n = _block_count(cut)  # (too few for the stages: the hint of check_cut's error uses the even count)
    return check_cut(cut, n if n >= num_stages else num_stages * blocks_per_stage, num_stages)


def _head(d_model: int, vocab: int, seed: int, tie_embeddings: bool, emb_params):
    """``(head(params, h), head params, tied pairs)``: the LM head, or the head tied to the input embedding
    (``LN(h) @ E^T + b``, ``E`` declared one array with the embedding's)."""
    rngs = nnx.Rngs(seed * 1000 + 999)
    if not tie_embeddings:
        head_def, head_params = split_pure(LMHead(d_model, vocab, rngs))
        return module_apply(head_def), head_params, ()
    head_def, head_own = split_pure(TiedHead(d_model, vocab, rngs))
    tied_head = module_apply(head_def)
    head_params = {"head": head_own, "emb": emb_params["tok"]["embedding"]}
    return (lambda p, h: tied_head(p["head"], h, p["emb"])), head_params, [(("tok", "embedding"), ("emb",))]


def _layer_functions(apply, blocks: bool, context: bool, dropout: float):
    """``(stage_fn, block_fn)``: ``apply`` (a stage's or, with a cut, a block's module) as the model's
    stage or block function, given the stage context (dropout key, mask) where the model uses one."""
    if context:
        apply_in = lambda w, x, ctx: apply(
            w, x, ctx.key if dropout else None, dropout, ctx.inputs.get("mask")
        )
    else:
        apply_in = apply
    return (None, apply_in) if blocks else (apply_in, None)


def _post_loss(head, masked: bool):
    """The head's loss: mean cross-entropy, or (masked) ``(sum over real tokens, count)``."""

    def post_loss(p, h, b):
        if not masked:
            return softmax_xent(head(p, h), b["y"])
        logp = jax.nn.log_softmax(head(p, h).astype(jnp.float32), axis=-1)
        ce = -jnp.take_along_axis(logp, b["y"][..., None].astype(jnp.int32), axis=-1)[..., 0]
        m = b["mask"].astype(jnp.float32)
        return jnp.sum(ce * m), jnp.sum(m)

    return post_loss


def _block_count(cut) -> int:
    """The blocks a cut places (0 where it is not a list of counts: ``check_cut`` then says what is wrong)."""
    try:
        return sum(int(c) for c in cut)
    except (TypeError, ValueError):
        return 0


def _specs(stage_params, emb_params, head_params, tensor, fsdp, cut):
    """:func:`megatron_specs`; with a cut, ``stage_params`` are the blocks' and a stage's spec gets its block
    axis in front (unsharded)."""
    stage, pre, post = megatron_specs(stage_params, emb_params, head_params, tensor, fsdp)
    if cut is not None:
        stage = jax.tree.map(lambda s: P(None, *s), stage, is_leaf=lambda x: isinstance(x, P))
    return stage, pre, post


#: the layers whose kernel is split by output columns (then the next by input rows): Megatron-LM's MLP pair.
#: The attention's fused q/k/v kernel is laid out [q | k | v]: a column split would cut across heads and make
#: XLA reshard inside the stage with collective-permutes, which deadlock inside a lane's conditional on XLA
#: CPU (BUILD_NOTES, "Sharding inside stages"); so is an fsdp split of the attention's kernels: attention
#: stays replicated
COLUMN, ROW = ("up",), ("down",)


def megatron_specs(
    stage_params, pre_params, post_params, tensor: Optional[str] = "tensor", fsdp: Optional[str] = None
):
    """``(stage, pre, post)`` PartitionSpecs (``PipelineModel.param_specs``) of a GPT stage, Megatron-style
    (Shoeybi et al. 2019) for the MLP: the up projection split by output columns over ``tensor`` (its bias
    too), the down projection by input rows, one all-reduce per block; ``fsdp`` additionally shards every
    kernel's other dimension (ZeRO-3 style: gathered for use, gradients reduce-scattered) and the token
    embedding's rows.  The attention, layer norms and position embedding stay replicated (see ``COLUMN``)."""

    def stage_spec(path, a):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        layer, leaf = (names[-2] if len(names) > 1 else None), names[-1]
        if layer in COLUMN:
            return P(fsdp, tensor) if leaf == "kernel" else P(tensor)
        if layer in ROW:
            return P(tensor, fsdp) if leaf == "kernel" else P()
        return P()

    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stage_params)
    stage = jax.tree_util.tree_map_with_path(stage_spec, one)
    pre = jax.tree_util.tree_map_with_path(
        lambda path, a: P(fsdp, None) if fsdp and "tok" in str(path) else P(), pre_params
    )
    return stage, pre, jax.tree.map(lambda a: P(), post_params)


def sample(
    model: PipelineModel, params, prompt: bytes, length: int, seq_len: int, key, temperature: float = 0.8
) -> bytes:
    """Generate bytes after a prompt with the unpipelined model (no dropout), one at a time.

    Args:
        model: a GPT of :func:`gpt`.
        params: its ``(stage, pre, post)`` parameters (``pipe.params(state)``).
        prompt: the bytes to continue (the last ``seq_len`` are read).
        length: bytes to generate.
        seq_len: the model's window.
        key: a PRNG key for the draws.
        temperature: the logits' divisor (lower: more likely bytes).

    Returns:
        The ``length`` generated bytes.
    """
    stage_p, pre_p, post_p = params

    @jax.jit
    def next_logits(tokens):
        batch = {"x": tokens[None]}
        if "mask" in model.stage_inputs:
            batch["mask"] = jnp.ones((1, tokens.shape[0]), jnp.float32)
        h = model.forward(params, batch)  # no key: evaluation, no dropout
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
