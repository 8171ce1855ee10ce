"""Datasets that need no download (DESIGN.md §5)."""
from __future__ import annotations

from typing import Dict, Iterator, Tuple

import numpy as np


def digits(test_fraction: float = 0.2, seed: int = 0) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """scikit-learn's bundled 8x8 digits (1,797 images): ``({"x": float32[n, 64] in [0, 1], "y": int32[n]}, test)``."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    idx = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    te, tr = idx[:n_test], idx[n_test:]
    return {"x": x[tr], "y": y[tr]}, {"x": x[te], "y": y[te]}


def byte_corpus(split: float = 0.9) -> Tuple[np.ndarray, np.ndarray]:
    """The Python standard library's documentation text (``pydoc_data.topics``) as bytes, split 90/10."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = np.frombuffer(text, dtype=np.uint8)
    cut = int(len(data) * split)
    return data[:cut], data[cut:]


def lm_batches(data: np.ndarray, batch: int, seq_len: int, seed: int = 0) -> Iterator[Dict[str, np.ndarray]]:
    """Endless random windows: ``{"x": int32[batch, seq_len], "y": the next byte of each}``."""
    rng = np.random.default_rng(seed)
    if len(data) <= seq_len + 1:
        raise ValueError(f"corpus of {len(data)} bytes is too short for seq_len={seq_len}")
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        win = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)
        yield {"x": win[:, :-1], "y": win[:, 1:]}


def class_batches(ds: Dict[str, np.ndarray], batch: int, seed: int = 0) -> Iterator[Dict[str, np.ndarray]]:
    """Endless shuffled epochs of a classification set, dropping the last partial batch."""
    rng = np.random.default_rng(seed)
    n = len(ds["y"])
    if batch > n:
        raise ValueError(f"batch {batch} is larger than the dataset ({n} examples)")
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - batch + 1, batch):
            sel = perm[i:i + batch]
            yield {k: v[sel] for k, v in ds.items()}
