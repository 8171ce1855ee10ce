"""Shared test helpers: small reference models and the comparison against unpipelined ``jax.grad``."""

import functools
import os

import jax
import numpy as np

import jaxpipe as jp

#: XLA_FLAGS for the tests' subprocesses (runners, launchers, multi-process jobs): XLA's backend optimisation
#: off, as in the suite itself (compiles ~20% faster from a cold cache: `experiments.train`'s quick run 26.7
#: -> 22.3 s); no device count -- each runner emulates its own; and XLA's older fusion emitters where jaxlib
#: has them, as the suite takes them (tests/conftest.py)
SUBPROCESS_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 " + os.environ.get("JAXPIPE_TEST_LEGACY_EMITTERS", "")
).strip()


def rel_err(a, b) -> float:
    """max over leaves of ||a - b|| / ||b|| (float64 on the host); the two pytrees must have one structure
    and one shape per leaf (a zip over mismatched trees would compare the wrong leaves, or too few)."""
    sa, sb = jax.tree.structure(a), jax.tree.structure(b)
    assert sa == sb, f"pytree structures differ: {sa} vs {sb}"
    shapes = [(np.shape(x), np.shape(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    assert all(x == y for x, y in shapes), f"leaf shapes differ: {[s for s in shapes if s[0] != s[1]]}"
    errs = []
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(b)[0]]
    for path, x, y in zip(paths, jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        # NaN/Inf anywhere, on either side, is a failure: a leaked bubble or a wrong slot shows as NaN, and
        # Python's max() would skip a NaN that is not first (max([1e-8, nan]) == 1e-8)
        for side, v in (("first", x), ("second", y)):
            assert np.all(np.isfinite(v)), (
                f"leaf {path or '(root)'} of the {side} argument holds "
                f"{int(np.sum(~np.isfinite(v)))} NaN/Inf value(s)"
            )
        errs.append(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
    return max(errs) if errs else 0.0


def assert_close(a, b, rtol=1e-7, atol=0.0):
    """``np.testing.assert_allclose`` that fails on NaN/Inf on either side (numpy's own treats NaN == NaN as
    equal, so a NaN leaked into both a result and its reference would pass) and on a shape mismatch
    (numpy broadcasts; a scalar ``b``, one expected value for every entry, is the one broadcast allowed)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape or b.ndim == 0, f"shapes differ: {a.shape} vs {b.shape}"
    for side, v in (("first", a), ("second", b)):
        assert np.all(np.isfinite(v)), (
            f"the {side} argument holds {int(np.sum(~np.isfinite(v)))} NaN/Inf value(s)"
        )
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, equal_nan=False)


def assert_same(a, b):
    """Bit-equal arrays, finite, one shape (:func:`assert_close` with no tolerance)."""
    assert_close(a, b, rtol=0.0, atol=0.0)


@functools.lru_cache(maxsize=None)
def small_model(kind: str, stages: int, seed: int = 0):
    """(model, batch_fn(n)) for ``kind`` in {"mlp", "gpt"}, sized for CPU tests.  One object per arguments
    for the whole run (a model is frozen, its parameters immutable arrays): the programs traced from it --
    its reference gradient above all -- are traced and compiled once, not once per test."""
    if kind == "mlp":
        model = jp.models.residual_mlp(stages, in_dim=12, num_classes=5, width=16, seed=seed)

        def batch(n, s=1):
            r = np.random.default_rng(s)
            return {"x": r.normal(size=(n, 12)).astype(np.float32), "y": r.integers(0, 5, n).astype(np.int32)}
    else:
        model = jp.models.gpt(stages, vocab=32, d_model=16, heads=2, seq_len=8, seed=seed)

        def batch(n, s=1):
            r = np.random.default_rng(s)
            t = r.integers(0, 32, (n, 9)).astype(np.int32)
            return {"x": t[:, :-1], "y": t[:, 1:]}

    return model, batch


_REFERENCES = {}


def reference(model, batch):
    """Plain ``jax.value_and_grad`` of the unpipelined loss, jitted once per model (kept beside it)."""
    key = id(model)
    if key not in _REFERENCES or _REFERENCES[key][0] is not model:
        _REFERENCES[key] = (model, jax.jit(jax.value_and_grad(model.loss)))
    return _REFERENCES[key][1](model.params, batch)


def change(p, p0):
    """``p - p0`` leaf by leaf in float64: what training did to the parameters (compared instead of the
    parameters themselves, whose least-moved leaves moved ~1% of their norm: an equality at 1e-5 on them is
    ~1e-3 on the update)."""
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), p, p0)


#: a "the rule matters" test asserts a difference at least this far above the equality tolerance (1e-5)
RULE_MARGIN = 100 * 1e-5


class read_only:
    """A directory made unwritable for this user, also as root (CI runs as root, who writes through 0o555):
    ``chmod 0o555`` for a user, the immutable attribute (``chattr +i``) for root. Undone on exit. Raises
    ``OSError`` if neither can be set here (a filesystem without the attribute, no CAP_LINUX_IMMUTABLE)."""

    def __init__(self, path):
        self.path = str(path)

    def __enter__(self):
        import os
        import subprocess

        if os.geteuid() != 0:
            os.chmod(self.path, 0o555)
        else:
            r = subprocess.run(["chattr", "+i", self.path], capture_output=True, text=True)
            if r.returncode:
                raise OSError(f"chattr +i {self.path}: {r.stderr.strip()}")
        return self

    def __exit__(self, *exc):
        import os
        import subprocess

        if os.geteuid() != 0:
            os.chmod(self.path, 0o755)
        else:
            subprocess.run(["chattr", "-i", self.path], capture_output=True)
        return False


def read_events(logdir):
    """``{tag: [(step, value)]}`` of every scalar in the event files of ``logdir`` (TFRecord framing: length,
    its CRC, the ``Event`` protobuf, its CRC)."""
    import os
    import struct

    from tensorboardX.proto import event_pb2

    out = {}
    for name in sorted(os.listdir(logdir)):
        data = open(os.path.join(logdir, name), "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out
