"""Uneven cuts: a model of ``n`` identical blocks on stages that hold different numbers of them.

A cut is a tuple of block counts, one per stage, summing to the number of blocks: ``(8, 8, 8, 7)`` puts 31
blocks on 4 stages.  Every stage runs the same program in an SPMD pipeline, so each stage holds as many block
slots as the longest one; a shorter stage's extra slots are *padding*:

* skipped, not multiplied by zero: the stage scans its slots and a ``lax.cond`` on ``ctx.stage`` runs a slot's
  block only where the slot is real (a padded slot passes the activation through; under ``vmap`` the cond
  becomes a select and both branches run -- only AvgPipe's shared-device runner vmaps stages).  Slots real on
  every stage (the first ``min(cut)``) run without the cond;
* never moved: padding holds zeros and its gradient is exactly zero (the untaken branch's cotangent), so SGD,
  momentum, Adam(W), weight decay and clipping leave it at zero -- an optimizer that moves a zero parameter
  with a zero gradient would move it (none of optax's standard ones does);
* never seen: the user's layout is the blocks' own, leaves ``[n_blocks, ...]`` in order; the pipeline pads on
  the way in (:func:`pad_blocks`) and drops the padding on the way out (:func:`unpad_blocks`): ``params``,
  ``loss_and_grad`` and the adapters' ``to_modules`` give the blocks only.

No JAX tracing here beyond the two layout maps and the scan; the cut itself is plain data.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import ConfigError


def even_cut(n_blocks: int, num_stages: int) -> Tuple[int, ...]:
    """The most even cut of ``n_blocks`` on ``num_stages`` stages (the first stages get the extra blocks)."""
    q, r = divmod(n_blocks, num_stages)
    return tuple(q + (s < r) for s in range(num_stages))


def check_cut(cut, n_blocks: int, num_stages: Optional[int] = None) -> Tuple[int, ...]:
    """``cut`` as a tuple of ints, or a ConfigError saying which entry is wrong and what would work."""
    try:
        out = tuple(int(c) for c in cut)
        if any(int(c) != c for c in cut):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(
            f"cut={cut!r}: give one block count per stage, e.g. {list(even_cut(n_blocks, num_stages or 2))}"
        ) from None
    if num_stages is not None and len(out) != num_stages:
        raise ConfigError(
            f"cut={list(out)} has {len(out)} entries for num_stages={num_stages}: give one block count "
            f"per stage, e.g. {list(even_cut(n_blocks, num_stages))}"
        )
    if any(c < 1 for c in out):
        raise ConfigError(
            f"cut={list(out)}: every stage needs at least one block (stage "
            f"{[i for i, c in enumerate(out) if c < 1][0]} has {min(out)}); use fewer stages"
        )
    if sum(out) != n_blocks:
        raise ConfigError(
            f"cut={list(out)} places {sum(out)} blocks but the model has {n_blocks}: the counts must "
            f"add up to {n_blocks}, e.g. {list(even_cut(n_blocks, len(out)))}"
        )
    return out


def split_cut(cut: Sequence[int], parts: int) -> Tuple[int, ...]:
    """Each stage of ``cut`` split into ``parts`` consecutive chunks of near-equal block counts (interleaved
    1F1B and the V-schedules run ``parts`` chunks per device)."""
    if parts == 1:
        return tuple(cut)
    small = [c for c in cut if c < parts]
    if small:
        raise ConfigError(
            f"cut={list(cut)} cannot give each stage {parts} chunks of at least one block (a stage "
            f"holds {min(small)}): give every stage at least {parts} blocks, or fewer chunks"
        )
    return tuple(k for c in cut for k in even_cut(c, parts))


def slot_index(cut: Sequence[int]) -> np.ndarray:
    """For each real block (in order), its flat slot ``stage * max(cut) + position`` in the padded layout."""
    width = max(cut)
    return np.array([s * width + i for s, c in enumerate(cut) for i in range(c)], np.int32)


def pad_blocks(blocks, cut: Sequence[int]):
    """Leaves ``[n_blocks, ...]`` -> ``[len(cut), max(cut), ...]``, padding slots zero."""
    S, width, idx = len(cut), max(cut), slot_index(cut)

    def one(a):
        flat = jnp.zeros((S * width,) + a.shape[1:], a.dtype).at[idx].set(a)
        return flat.reshape((S, width) + a.shape[1:])

    return jax.jit(lambda b: jax.tree.map(one, b))(blocks)  # one program, not three a leaf


def unpad_blocks(stages, cut: Sequence[int]):
    """Leaves ``[len(cut), max(cut), ...]`` -> ``[n_blocks, ...]``: the real blocks in order."""
    idx = slot_index(cut)
    return jax.jit(lambda t: jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:])[idx], t))(stages)


def stage_of_blocks(block_fn: Callable, cut: Optional[Sequence[int]], context: bool) -> Callable:
    """``stage_fn(w, x, ctx)`` running a stage's blocks in order: ``lax.scan`` over the block slots of ``w``
    (leaves ``[slots, ...]``).  With a ``cut``, the first ``min(cut)`` slots -- real on every stage -- run in
    a plain scan, and only the rest in a scan whose slots a ``lax.cond`` on ``cut[ctx.stage]`` skips: a
    skipped slot computes nothing but still moves its share of the scan's activation-sized buffers (the cond's
    residuals are those of its block branch, zero-filled when skipped; BUILD_NOTES, "Cuts").
    ``block_fn(p, x)``, or ``block_fn(p, x, ctx)`` for a context model, where the ctx's ``key`` is the block's
    own: ``fold_in(ctx.key, b)`` with ``b`` the block's index in the whole model (``ctx.key`` is the
    micro-batch's: ``PipelineModel.block_keys``), so a block draws the same masks on any cut and any number of
    stages.  Without a cut and context the stage is ``stage_fn(w, x)``."""
    counts = None if cut is None else np.asarray(cut, np.int32)
    # the index of each stage's first block in the model
    first_block = None if cut is None else np.concatenate([[0], np.cumsum(cut)[:-1]]).astype(np.int32)
    sure = 0 if cut is None or min(cut) == max(cut) else min(cut)  # slots real on every stage

    def run(p, h, ctx):
        return block_fn(p, h, ctx) if context else block_fn(p, h)

    def scan(h, w, keys, ctx, first, real):
        n = jax.tree.leaves(w)[0].shape[0]

        def one(h, ipk):
            i, p, k = ipk
            c = None if ctx is None else dataclasses.replace(ctx, key=k)
            if real is None:
                return run(p, h, c), None
            # the block rematerialised inside the cond: its residuals are the slot's inputs, so a skipped slot
            # moves no zero-filled activations (BUILD_NOTES, "Cuts")
            return lax.cond(i < real, jax.checkpoint(lambda h_: run(p, h_, c)), lambda h_: h_, h), None

        return lax.scan(one, h, (first + jnp.arange(n), w, keys))[0]

    def stage(w, x, ctx=None):
        n = jax.tree.leaves(w)[0].shape[0]
        keys = None
        if ctx is not None and ctx.key is not None:
            b0 = ctx.stage * n if first_block is None else jnp.asarray(first_block)[ctx.stage]
            keys = jax.vmap(lambda i: jax.random.fold_in(ctx.key, i))(b0 + jnp.arange(n))
        if counts is None or min(cut) == max(cut):
            return scan(x, w, keys, ctx, 0, None)
        real = jnp.asarray(counts)[ctx.stage]
        part = lambda t, a, b: None if t is None else jax.tree.map(lambda l: l[a:b], t)
        h = scan(x, part(w, 0, sure), part(keys, 0, sure), ctx, 0, None) if sure else x
        return scan(h, part(w, sure, n), part(keys, sure, n), ctx, sure, real)

    if counts is None and not context:
        return lambda w, x: stage(w, x)
    return stage


def blocks_layout(model) -> Tuple[Optional[list], Optional[Tuple[int, ...]]]:
    """A model of identical blocks (``block_fn``) as ``(shapes of its blocks' leaves [n_blocks, ...], cut)``:
    its own cut, or an even model's ``(k,) * stages`` read from ``stage_params [stages, k, ...]``; ``(None,
    None)`` for a model of other stages.  What a checkpoint records so it can move between cuts."""
    if getattr(model, "block_fn", None) is None or getattr(model, "padded_cut", None) is not None:
        return None, None  # (a padded model is the executor's copy of a cut one)
    leaves = jax.tree_util.tree_flatten_with_path(model.stage_params)[0]
    if model.cut is not None:
        return [(jax.tree_util.keystr(k), tuple(np.shape(a)), str(a.dtype)) for k, a in leaves], tuple(
            model.cut
        )
    if not leaves or any(np.ndim(a) < 2 for _, a in leaves):
        return None, None
    S, k = np.shape(leaves[0][1])[:2]
    return (
        [(jax.tree_util.keystr(p), (S * k,) + tuple(np.shape(a)[2:]), str(a.dtype)) for p, a in leaves],
        (int(k),) * int(S),
    )


def recut_state(state, optimizer, from_cut: Sequence[int], to_cut: Sequence[int], order=None):
    """A synchronous train state (``params=(stage, pre, post)``, ``opt_state``) held for ``from_cut`` as
    ``to_cut`` holds it: the stage parameters and every copy of them in the optimizer state (Adam's moments,
    ...; found by ``optax.tree_utils.tree_map_params``) moved block by block, padding zero.  Same blocks,
    same order: a checkpoint restores onto another cut of the same model.  ``order``: ``(to_model,
    from_model)`` for a state whose stage leaves are not in the model's order (the runner's ``stage_order()``:
    interleaved 1F1B's device order, the V-schedules' chunks)."""
    import optax
    from ..runtime.chunk_state import is_chunks

    to_model, from_model = order or ((lambda a: a), (lambda a: a))
    move = lambda a: from_model(pad_blocks(unpad_blocks(to_model(a), from_cut), to_cut))
    stage, pre, post = state.params
    mask = (
        jax.tree.map(lambda _: True, stage, is_leaf=is_chunks),
        jax.tree.map(lambda _: False, pre),
        jax.tree.map(lambda _: False, post),
    )
    opt_state = state.opt_state
    if optimizer is not None:
        opt_state = optax.tree_utils.tree_map_params(
            optimizer, lambda a, s: move(a) if s else a, opt_state, mask, is_leaf=is_chunks
        )
    return state._replace(
        params=(jax.tree.map(move, stage, is_leaf=is_chunks), pre, post), opt_state=opt_state
    )
