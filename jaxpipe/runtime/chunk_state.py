"""The train state of a schedule with several model chunks a device (interleaved 1F1B, ZB-V, DualPipeV): each
stage parameter held as one array per chunk.

Each device of such a schedule holds K model stages (its chunks).  Stacked as one ``[D * K, ...]`` array per
leaf, every step sliced the K chunks out at entry and stacked their gradient sums back at exit: XLA cannot
alias a slice into the call's ``while`` operands, so each was a copy of the device's stage weights (two stage
bytes of temp per device; 6.5-7 ms of a 92-ms step on the two-process testbed's MLP at D = 1, BUILD_NOTES).
Held as :class:`Chunks` -- K arrays ``[D, ...]``, array ``c`` holding chunk ``c`` of every device -- the step
hands them to the executor as they are and gets the gradients back the same way.

:class:`Chunks` is a pytree node under each stage *leaf*: a tree given in the model's structure (an optax
``masked`` / ``multi_transform`` mask or label tree, a weight-decay mask) is a prefix of the state's and
applies to every chunk of a leaf.  ``Pipeline.params(state)`` gives the stage parameters in the model's
order, as for every other schedule.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import SequenceKey


@jax.tree_util.register_pytree_with_keys_class
class Chunks:
    """One stage parameter as K arrays ``[D, ...]``: ``parts[c][d]`` is chunk ``c`` of device ``d``."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Any]):
        self.parts = tuple(parts)

    def __getitem__(self, chunk: int):
        return self.parts[chunk]

    def __len__(self) -> int:
        return len(self.parts)

    def __repr__(self) -> str:
        return f"Chunks{self.parts!r}"

    def tree_flatten_with_keys(self):
        return [(SequenceKey(c), p) for c, p in enumerate(self.parts)], None

    def tree_flatten(self):
        return self.parts, None

    @classmethod
    def tree_unflatten(cls, _, parts):
        return cls(parts)


def is_chunks(x) -> bool:
    return isinstance(x, Chunks)


def holds_chunks(tree) -> bool:
    """Whether ``tree``'s leaves are held as :class:`Chunks`."""
    return any(is_chunks(x) for x in jax.tree.leaves(tree, is_leaf=is_chunks))


def split_leaf(a, layout: np.ndarray, num_chunks: int) -> Chunks:
    """One leaf ``[D * K, ...]`` in the model's order as :class:`Chunks`: chunk ``c`` of device ``d`` is model
    stage ``layout[d * K + c]``."""
    per = np.asarray(layout).reshape(-1, num_chunks)
    return Chunks(a[per[:, c]] for c in range(num_chunks))


def join_leaf(chunk: Chunks, inverse: np.ndarray):
    """The inverse of :func:`split_leaf` (``inverse``: the layout's inverse permutation)."""
    return jnp.stack(chunk.parts, 1).reshape((-1,) + chunk.parts[0].shape[1:])[jnp.asarray(inverse)]


def layout_order(layout: Sequence[int], num_chunks: int):
    """``(to_model, from_model)`` for one stage leaf held in ``layout`` (the model stage of each held
    position; ``K`` chunks a device): :class:`Chunks` where ``K > 1``, else a permuted ``[stages, ...]``
    array."""
    lay = np.asarray(layout)
    inverse = np.argsort(lay)
    if num_chunks > 1:
        return (lambda ch: join_leaf(ch, inverse)), (lambda leaf: split_leaf(leaf, lay, num_chunks))
    return (lambda leaf: leaf[jnp.asarray(inverse)]), (lambda leaf: leaf[jnp.asarray(lay)])


def chunk(stage, chunk: int):
    """Chunk ``c`` of every device: the tree with each :class:`Chunks` leaf's array ``c``."""
    return jax.tree.map(lambda ch: ch[chunk], stage, is_leaf=is_chunks)


def gather(trees: Sequence[Any]):
    """K trees of the same structure (one per chunk) as one tree of :class:`Chunks` leaves."""
    return jax.tree.map(lambda *parts: Chunks(parts), *trees)


def repeat(tree, num_chunks: int):
    """Each leaf (a sharding, a spec, a mask entry) the same for each of K chunks."""
    return jax.tree.map(lambda x: Chunks((x,) * num_chunks), tree)
