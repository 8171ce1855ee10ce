"""Tied parameters: one array used by ``pre`` and by ``post_loss`` (a tied input embedding and output head).

``PipelineModel(..., tied=[(pre_path, post_path)])`` says that the leaf at ``post_path`` of ``post_params``
*is*
the leaf at ``pre_path`` of ``pre_params`` (paths: tuples of dict keys / sequence indices).  The pipeline then
holds it once: the train state's ``post_params`` has ``None`` at ``post_path`` (so the optimizer keeps one
state and applies one update), every program gets the full parameters with the pre leaf filled in at the
post path (bit-identical by construction), and the gradient of the tied array is the sum of its two uses,
reported at ``pre_path`` (``None`` at ``post_path``).

Synchronous schedules and AvgPipe do all of it outside the executor (``strip``/``fill``/``fold``).  The
asynchronous 1F1B family (pipedream, 2BW, spectrain, pipeoptim, CDP) keeps the array where ``pre`` is trained,
on stage 0, and gives it one rule (BUILD_NOTES "Users' models"): a micro-batch reads *one* version of a tied
array -- the version stage 0's forward read under the method's own rule, which travels with the activation
(``pre_leaves`` / ``post_with``) -- and the last stage's gradient of it travels back with dL/dy and joins
stage 0's gradient of the same micro-batch (``take_post`` / ``add_to_pre``): one gradient, one optimizer
state, one update, at stage 0's update time.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import jax
import jax.numpy as jnp

from .errors import ConfigError

Path = Tuple[Any, ...]


def _get(tree, path: Path, where: str):
    node = tree
    for i, k in enumerate(path):
        try:
            node = node[k]
        except (KeyError, IndexError, TypeError):
            have = sorted(node) if isinstance(node, dict) else type(node).__name__
            raise ConfigError(
                f"tied: {where} has no entry {list(path[: i + 1])} (at that level: {have}); give "
                f"paths as tuples of dict keys / indices, e.g. tied=[(('embedding',), "
                f"('embedding',))]"
            ) from None
    return node


def _set(tree, path: Path, value):
    if not path:
        return value
    k, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, k: _set(tree[k], rest, value)}
    if isinstance(tree, (list, tuple)):
        items = list(tree)
        items[k] = _set(items[k], rest, value)
        return type(tree)(items) if isinstance(tree, list) else tuple(items)
    raise ConfigError(f"tied: cannot replace an entry of a {type(tree).__name__}; use dicts, lists or tuples")


class Ties:
    """The model's tied (pre, post) pairs, checked once; pure functions on ``(stage, pre, post)`` triples."""

    def __init__(self, model):
        self.pairs: Sequence[Tuple[Path, Path]] = [(tuple(a), tuple(b)) for a, b in model.tied]
        for a, b in self.pairs:
            x, y = _get(model.pre_params, a, "pre_params"), _get(model.post_params, b, "post_params")
            for what, path, v in (("pre_params", a, x), ("post_params", b, y)):
                if not hasattr(v, "shape"):
                    kind = f"a dict with keys {sorted(v)}" if isinstance(v, dict) else f"a {type(v).__name__}"
                    raise ConfigError(
                        f"tied: {what}{list(path)} is {kind}, not an array; a tie names one array "
                        "on each side: extend the path to the leaf, e.g. "
                        f"{list(path) + [sorted(v)[0]] if isinstance(v, dict) and v else list(path)}"
                    )
            if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
                raise ConfigError(
                    f"tied: pre_params{list(a)} is {jnp.result_type(x)}{list(jnp.shape(x))} but "
                    f"post_params{list(b)} is {jnp.result_type(y)}{list(jnp.shape(y))}; a tied "
                    f"array is one array: use it in the same shape in both (transpose inside "
                    f"post_loss, e.g. logits = h @ E.T)"
                )

    def __bool__(self):
        return bool(self.pairs)

    def check_values(self, model) -> None:
        """ConfigError where a tie's two arrays hold different values: the pipeline holds the pre one only, so
        the post one would be dropped silently (abstract arrays -- shapes only -- are not compared)."""
        import numpy as np

        for a, b in self.pairs:
            x, y = _get(model.pre_params, a, "pre_params"), _get(model.post_params, b, "post_params")
            if x is y or not all(isinstance(v, (jax.Array, np.ndarray)) for v in (x, y)):
                continue
            if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
                continue
            xa, ya = np.asarray(x), np.asarray(y)
            if not np.array_equal(xa, ya, equal_nan=True):
                diff = float(np.max(np.abs(xa.astype(np.float64) - ya.astype(np.float64))))
                raise ConfigError(
                    f"tied: pre_params{list(a)} and post_params{list(b)} hold different values (largest "
                    f"difference {diff:.3g}); a tied array is one array and the pipeline keeps the pre one, "
                    "so "
                    f"the post one would be dropped silently. Give the same array on both sides (post_params "
                    f"built from pre_params), or remove the tie to train two arrays"
                )

    def strip(self, params):
        """The train state's form: ``None`` at every tied post path."""
        s, pre, post = params
        for _, b in self.pairs:
            post = _set(post, b, None)
        return (s, pre, post)

    def fill(self, params):
        """The model's form: the pre leaf at every tied post path."""
        s, pre, post = params
        for a, b in self.pairs:
            post = _set(post, b, _get(pre, a, "pre_params"))
        return (s, pre, post)

    def fold(self, grads):
        """One gradient per tied array: the post use's gradient added to the pre use's, ``None`` at the post
        path."""
        gs, gpre, gpost = grads
        for a, b in self.pairs:
            g = _get(gpost, b, "the post gradient")
            gpre = _set(gpre, a, jax.tree.map(jnp.add, _get(gpre, a, "the pre gradient"), g))
            gpost = _set(gpost, b, None)
        return (gs, gpre, gpost)

    # ------------------------------------------------------------- executor side (no-flush methods)
    def pre_leaves(self, pre) -> tuple:
        """The tied arrays as ``pre`` holds them (what travels with a micro-batch's activation)."""
        return tuple(_get(pre, a, "pre_params") for a, _ in self.pairs)

    def post_with(self, post, leaves):
        """``post`` (train-state form, ``None`` at tied paths) with ``leaves`` put at the tied paths."""
        for (_, b), v in zip(self.pairs, leaves):
            post = _set(post, b, v)
        return post

    def take_post(self, gpost):
        """Split a full post gradient into (train-state form, the tied arrays' gradients)."""
        got = tuple(_get(gpost, b, "the post gradient") for _, b in self.pairs)
        for _, b in self.pairs:
            gpost = _set(gpost, b, None)
        return gpost, got

    def add_to_pre(self, gpre, leaves):
        """``gpre`` with the tied arrays' other gradients added at their pre paths."""
        for (a, _), g in zip(self.pairs, leaves):
            gpre = _set(gpre, a, jax.tree.map(jnp.add, _get(gpre, a, "the pre gradient"), g))
        return gpre
