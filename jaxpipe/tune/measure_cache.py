"""Measurements kept per (model, backend) on disk (a configuration search decides in seconds
once its measurements exist).

:func:`jaxpipe.tune.configure.configure` measures a stage's F / B per micro-batch size and residual policy,
the link and the all-reduce, and compiles a few steps for XLA's memory figures.  Each result is stored here
under a key made of the backend (:func:`backend_key`: platform, device kind and count, jax and jaxlib
versions), the model (:func:`model_key`: the jaxprs of its parts on one micro-batch, its parameter shapes and
the optimizer state's shapes) and what was measured.  A model whose code or shapes change gets new keys; a
stale entry is never read for another model.  The file is JSON (``$JAXPIPE_CACHE_DIR/measurements.json``, by
default ``~/.cache/jaxpipe/``), written whole through a temporary file, so an interrupted write leaves the old
one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Callable, Optional

import jax
import numpy as np

from ..errors import ConfigError


def default_path() -> Optional[str]:
    """``$JAXPIPE_CACHE_DIR/measurements.json`` (default ``~/.cache/jaxpipe/``).  None in a multi-process job:
    there every process must make the same measurements in the same order (some hold collectives), which a
    cache one process has and another lacks would break."""
    if jax.process_count() > 1:
        return None
    root = os.environ.get("JAXPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxpipe")
    return os.path.join(root, "measurements.json")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def backend_key() -> str:
    """What a measurement depends on besides the model: the devices and the compiler."""
    import jaxlib

    d = jax.devices()
    return _digest(
        f"{d[0].platform}|{d[0].device_kind}|{len(d)}|{jax.process_count()}|{jax.__version__}|"
        f"{getattr(jaxlib, '__version__', '')}|{os.environ.get('XLA_FLAGS', '')}"
    )


def _shapes(tree) -> str:
    return str([(tuple(np.shape(a)), str(getattr(a, "dtype", type(a)))) for a in jax.tree.leaves(tree)])


def shapes_key(tree) -> str:
    """A digest of ``tree``'s leaves' shapes and dtypes (a message a measurement sends)."""
    return _digest(_shapes(tree))


def model_key(model, mb, optimizer=None) -> str:
    """A digest of the model as the search measures it: the jaxprs of ``pre``, one stage and ``post_loss`` on
    the micro-batch ``mb``, the parameters' shapes and the optimizer state's shapes (a cut model's as the
    executor holds them: padded, ``[stages, max(cut), ...]``)."""
    model = model.padded()
    w = jax.tree.map(lambda a: a[0], model.stage_params)
    x = jax.eval_shape(model.pre, model.pre_params, mb)
    # the context built inside the trace from the traced micro-batch: its inputs (a mask) are tracers, never
    # the shape placeholders ``mb`` may hold (a user's ``mask > 0`` on a placeholder is a TypeError)
    stage = lambda w, x, b: model.apply_stage(w, x, model.example_context(b))
    parts = [
        str(jax.make_jaxpr(model.pre)(model.pre_params, mb)),
        str(jax.make_jaxpr(stage)(w, x, mb)),
        str(jax.make_jaxpr(model.post_loss)(model.post_params, x, mb)),
        _shapes((model.stage_params, model.pre_params, model.post_params)),
    ]
    if optimizer is not None:
        parts.append(
            _shapes(jax.eval_shape(optimizer.init, (model.stage_params, model.pre_params, model.post_params)))
        )
    return _digest("\n".join(parts))


def check_path(path: str, what: str) -> None:
    """A ConfigError, before anything is measured, where ``path`` cannot be a cache file: a directory, or
    under a file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(
            f"{what}: {path} is a directory; the measurements are kept in one JSON file: give a file "
            f"path (e.g. {os.path.join(path, 'measurements.json')}), or None to keep nothing"
        )
    from ..checks.values import file_in_the_way

    parent = file_in_the_way(path)
    if parent:
        raise ConfigError(
            f"{what}: {path} lies under {parent}, which is a file, not a directory: give a path in a "
            f"directory (set $JAXPIPE_CACHE_DIR to a directory), or None to keep nothing"
        )


def set_aside(path: str, why: str) -> None:
    """Move a bad cache file to ``path.bad`` (kept for a look, never read again) and say so."""
    try:
        os.replace(path, path + ".bad")
        where = f"moved to {path}.bad"
    except OSError:
        where = "left in place (it could not be moved) and not read"
    warnings.warn(f"jaxpipe: the cache file {path} {why}: {where}; measuring again", stacklevel=3)


class MeasureCache:
    """``get(key, measure)``: the stored value of ``key`` (a tuple of strings and numbers), or
    ``measure()``'s, stored.  ``path=None``: nothing is stored (every value measured).  ``hits`` / ``misses``
    count the calls. A file that is not this cache's (unreadable, not JSON, JSON of another shape) is set
    aside with a warning and the values measured again; so is one entry that does not convert (``get``'s
    ``use``)."""

    def __init__(self, path: Optional[str] = None):
        if path is not None:
            check_path(path, "the measurements cache")
        self.path = None if path is None else os.fspath(path)
        self.hits = self.misses = 0
        self._data = {}
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                set_aside(self.path, f"cannot be read as JSON ({type(e).__name__})")
                return
            if not isinstance(data, dict):
                set_aside(
                    self.path, f"holds a JSON {type(data).__name__}, not this cache's table of measurements"
                )
                return
            self._data = data

    def get(self, key, measure: Callable[[], Any], use: Callable[[Any], Any] = lambda v: v):
        """``use(value)`` of the stored value, or of ``measure()``'s (stored).  A stored value that ``use``
        refuses (TypeError, KeyError, ValueError: an entry of another shape) is measured again, with a
        warning."""
        found, value = self.lookup(key)
        if found:
            try:
                return use(value)
            except (TypeError, KeyError, ValueError) as e:
                warnings.warn(
                    f"jaxpipe: the cache file {self.path} holds an entry of another shape for "
                    f"{json.dumps(key, default=str)[:120]} ({type(e).__name__}: {e}); measuring again",
                    stacklevel=2,
                )
        value = measure()
        self.put(key, value)
        return use(value)

    def lookup(self, key):
        """``(True, value)`` where ``key`` is stored, else ``(False, None)`` (counted as a hit or a miss)."""
        k = json.dumps(key, default=str)
        if k in self._data:
            self.hits += 1
            return True, self._data[k]
        self.misses += 1
        return False, None

    def put(self, key, value) -> None:
        self._data[json.dumps(key, default=str)] = value
        self._write()

    def _write(self):
        if not self.path:
            return
        directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self._data, f)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: the search goes on, its measurements are not kept
            warnings.warn(
                f"jaxpipe: the measurements cache {self.path} cannot be written ({e.strerror}); "
                f"measurements are not kept",
                stacklevel=3,
            )
            self.path = None
