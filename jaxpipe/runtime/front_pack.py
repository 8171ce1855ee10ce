"""Zero-bubble's frontier kept in the stash slot it frees.

ZB-H1's B hands W the per-layer output gradients (the *frontier*, :mod:`.wsplit`); W also reads the layer
inputs stashed at F.  The executor used to keep the frontier in slots of its own, beside the stash slot the
micro-batch holds until W: on GPT d1024 T1024 (one block a stage, D = 4) four frontier slots of 384 MiB
beside four stash slots of 2,177 MiB, 1.28x the plain step's temp.  But once B has run, most of the
micro-batch's stashed residuals are dead -- the attention probabilities, the GELU's inputs: B's own reads --
and the slot stays held only for what W reads.  So B writes the frontier *into* those dead residuals of its
own slot, and W reads it back from there: the paper's accounting (Qi et al. 2024, §2: B frees what only B
needed; what W needs stays), with the stash's slots as the only B-to-W storage.

:func:`pack` places each frontier array, as whole rows of one axis, inside one stashed residual of the
same dtype that W does not read; where they do not all fit (a stage whose W reads most of its residuals), it
returns None and the frontier keeps slots of its own, as before.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
from jax import lax

#: a frontier array's place: the stashed residual it lives in, the axis of that residual it is stacked along,
#: its offset on that axis and its extent there (the array, reshaped, is a box of the residual's shape but for
#: that axis: written and read with a dynamic slice, no reshape of the stash -- a reshaped loop buffer in a
#: conditional made XLA copy the stash, 128 MiB a leaf a tick on GPT d256)
Place = Tuple[int, int, int, int]


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _fits(n_front: int, shape, axis: int):
    """The extent along ``axis`` of a box of ``shape`` (but for that axis) holding ``n_front`` elements, or
    None where they do not make whole rows."""
    other = _size(shape) // shape[axis] if shape[axis] else 0
    return n_front // other if other and n_front % other == 0 else None


def pack(front_avals: Sequence, stash_avals: Sequence, w_reads: Sequence[int]) -> Optional[List[Place]]:
    """Where each frontier array lives inside the stash's residuals that W does not read (``w_reads``: the
    indices W does), largest first into the residual with the most room left (same dtype, whole rows of one
    axis); None if one does not fit."""
    dead = [j for j, a in enumerate(stash_avals) if j not in set(w_reads) and _size(a.shape)]
    axis, used = {}, {}  # per residual: the axis it is filled along, how far
    places: List[Optional[Place]] = [None] * len(front_avals)
    for i in sorted(range(len(front_avals)), key=lambda i: -_size(front_avals[i].shape)):
        need, best = _size(front_avals[i].shape), None
        for j in dead:
            shape = tuple(stash_avals[j].shape)
            if np.dtype(stash_avals[j].dtype) != np.dtype(front_avals[i].dtype):
                continue
            for k in [axis[j]] if j in axis else range(len(shape)):
                n = _fits(need, shape, k)
                room = shape[k] - used.get(j, 0) if n is not None else -1
                if (
                    n is not None
                    and n <= room
                    and (best is None or room * _size(shape) // shape[k] > best[0])
                ):
                    best = (room * _size(shape) // shape[k], j, k, n)
        if best is None:
            return None
        _, j, k, n = best
        axis[j] = k
        places[i] = (j, k, used.get(j, 0), n)
        used[j] = used.get(j, 0) + n
    return places


def _box(shape, k, n):
    return tuple(shape[:k]) + (n,) + tuple(shape[k + 1 :])


def put(stash: list, slot, front: Sequence, places: Sequence[Place]) -> list:
    """The stash buffers with ``front`` written into slot ``slot`` at its places."""
    out = list(stash)
    for f, (j, k, off, n) in zip(front, places):
        b = out[j]
        box = f.reshape((1,) + _box(b.shape[1:], k, n)).astype(b.dtype)
        start = [slot] + [np.int32(0)] * (b.ndim - 1)
        start[1 + k] = np.int32(off)
        out[j] = lax.dynamic_update_slice(b, box, start)
    return out


def get(stash: Sequence, slot, front_avals: Sequence, places: Sequence[Place]) -> list:
    """The frontier of slot ``slot``, read back from its places."""
    out = []
    for a, (j, k, off, n) in zip(front_avals, places):
        b = stash[j]
        start = [slot] + [np.int32(0)] * (b.ndim - 1)
        start[1 + k] = np.int32(off)
        part = lax.dynamic_slice(b, start, (1,) + _box(b.shape[1:], k, n))
        out.append(part.reshape(a.shape).astype(a.dtype))
    return out


#: the frontier slots' bytes a device must save before the frontier moves into the stash: the move costs a
#: conditional and a frontier-sized fill a tick, which on a small stage outweighs what it saves (two pinned
#: processes, an MLP of 8 x 1024^2, zb_h1 D = 2: 1.10-1.31x 1F1B's step packed, 0.91-1.04x with its 2 MiB of
#: frontier slots kept; GPT d1024: 1.5 GB saved)
MIN_SAVING = 64 << 20


def placed_in_stash(wsp, stash_avals, slots: int) -> Optional[List[Place]]:
    """:func:`pack` for a split backward whose ``slots`` frontier slots would hold at least :data:`MIN_SAVING`
    bytes (None where it does not pay)."""
    if slots * sum(_size(a.shape) * np.dtype(a.dtype).itemsize for a in wsp.frontier_avals) < MIN_SAVING:
        return None
    return pack(wsp.frontier_avals, stash_avals, wsp.w_reads)
