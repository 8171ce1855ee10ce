"""Datasets that need no download (docs/design.md §5)."""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np


def digits(test_fraction: float = 0.2, seed: int = 0) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """scikit-learn's bundled 8x8 digits (1,797 images), split into a training and a test set.

    Args:
        test_fraction: the share of the images held out for the test set.
        seed: the seed of the shuffle before the split.

    Returns:
        ``(train, test)``, each ``{"x": float32[n, 64] in [0, 1], "y": int32[n]}``.
    """
    pixels, labels = _digits_table()
    x = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int32)
    idx = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    te, tr = idx[:n_test], idx[n_test:]
    return {"x": x[tr], "y": y[tr]}, {"x": x[te], "y": y[te]}


def _digits_table() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``digits.csv.gz`` read directly (what ``load_digits`` reads), without importing
    scikit-learn: its import costs 3 s, paid by every process a run starts.  Falls back to ``load_digits`` if
    the file moved."""
    import gzip
    import importlib.util
    import os

    spec = importlib.util.find_spec("sklearn")
    roots = spec.submodule_search_locations if spec is not None else None
    path = os.path.join(roots[0], "datasets", "data", "digits.csv.gz") if roots else ""
    if os.path.exists(path):
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",")
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.data, d.target


def byte_corpus(split: float = 0.9) -> Tuple[np.ndarray, np.ndarray]:
    """The Python standard library's documentation text (``pydoc_data.topics``) as bytes: no download.

    Args:
        split: the share of the bytes in the first (training) part.

    Returns:
        ``(train, held_out)``: two ``uint8`` arrays.
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = np.frombuffer(text, dtype=np.uint8)
    cut = int(len(data) * split)
    return data[:cut], data[cut:]


class _Stream:
    """An endless, seeded batch iterator whose position can be saved and restored (``state_dict`` is
    JSON-able: the numpy RNG's bit-generator state plus counters), so a resumed run sees the same batches."""

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "position": self.position, **self._extra_state()}

    def load_state_dict(self, state: dict):
        self.rng.bit_generator.state = state["rng"]
        self.position = int(state["position"])
        self._load_extra(state)

    def _extra_state(self):
        return {}

    def _load_extra(self, state):
        pass


class lm_batches(_Stream):
    """Endless random windows of a byte corpus: ``{"x": int32[batch, seq_len], "y": the next byte of each}``.

    The position is saved and restored by ``state_dict()`` / ``load_state_dict()`` (JSON-able), so a resumed
    run sees the batches it would have seen.

    Args:
        data: the corpus, ``uint8[n]`` (:func:`byte_corpus`).
        batch: windows per batch.
        seq_len: bytes per window.
        seed: the seed of the window starts.
        pad: variable-length sequences, as a real corpus of documents has: each window keeps a random length
            in ``[seq_len // 4, seq_len]`` (right-padded with byte 0) and the batch gets ``"mask"``
            (float32[batch, seq_len], 1 on real tokens), for a masked loss and attention.

    Raises:
        ValueError: the corpus is no longer than ``seq_len + 1``.
    """

    def __init__(self, data: np.ndarray, batch: int, seq_len: int, seed: int = 0, pad: bool = False):
        if len(data) <= seq_len + 1:
            raise ValueError(f"corpus of {len(data)} bytes is too short for seq_len={seq_len}")
        self.data, self.batch, self.seq_len, self.pad = data, batch, seq_len, pad
        self.rng = np.random.default_rng(seed)
        self.position = 0

    def __next__(self) -> Dict[str, np.ndarray]:
        starts = self.rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch)
        win = np.stack([self.data[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)
        self.position += 1
        out = {"x": win[:, :-1], "y": win[:, 1:]}
        if self.pad:
            lengths = self.rng.integers(max(1, self.seq_len // 4), self.seq_len + 1, size=self.batch)
            mask = np.arange(self.seq_len)[None] < lengths[:, None]
            out = {
                "x": np.where(mask, out["x"], 0),
                "y": np.where(mask, out["y"], 0),
                "mask": mask.astype(np.float32),
            }
        return out


class class_batches(_Stream):
    """Endless shuffled epochs of a classification set, dropping the last partial batch; saved and restored as
    :class:`lm_batches`.

    Args:
        ds: ``{"x": ..., "y": ...}`` arrays of one length (:func:`digits`).
        batch: examples per batch.
        seed: the seed of each epoch's shuffle.

    Raises:
        ValueError: ``batch`` is larger than the set.
    """

    def __init__(self, ds: Dict[str, np.ndarray], batch: int, seed: int = 0):
        self.ds, self.batch = ds, batch
        self.n = len(ds["y"])
        if batch > self.n:
            raise ValueError(f"batch {batch} is larger than the dataset ({self.n} examples)")
        self.rng = np.random.default_rng(seed)
        self.position = 0
        self.perm, self.offset = None, 0

    def __next__(self) -> Dict[str, np.ndarray]:
        if self.perm is None or self.offset + self.batch > self.n:
            self.perm, self.offset = self.rng.permutation(self.n), 0
        sel = self.perm[self.offset : self.offset + self.batch]
        self.offset += self.batch
        self.position += 1
        return {k: v[sel] for k, v in self.ds.items()}

    def _extra_state(self):
        return {"perm": None if self.perm is None else self.perm.tolist(), "offset": self.offset}

    def _load_extra(self, state):
        self.perm = None if state["perm"] is None else np.asarray(state["perm"])
        self.offset = int(state["offset"])
