"""Checks of what users feed the pipelines: batch values (NaN/Inf, integer ids in range), shared by
``jp.Pipeline`` and ``jp.CyclicDataParallel``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError


def check_finite(batch):
    """Key paths and counts of the floating-point *host* (numpy) batch leaves holding NaN/Inf, or float64
    values beyond float32's range.  Device arrays are checked inside the step's program, never read back here
    (:mod:`jaxpipe.checks.on_device`)."""
    bad = []
    for k, v in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if isinstance(v, jax.Array):
            continue
        v = np.asarray(v)
        if not jnp.issubdtype(v.dtype, jnp.floating):  # (NumPy's issubdtype misses bfloat16)
            continue
        n = int(np.sum(~np.isfinite(v)))
        if v.dtype.itemsize > 4 and not jax.config.jax_enable_x64:
            # float64 becomes float32 on the way in: beyond its range a finite value turns into Inf
            big = int(np.sum(np.isfinite(v) & (np.abs(v) > np.finfo(np.float32).max)))
            if big:
                bad.append(
                    f"{jax.tree_util.keystr(k) or 'batch'} ({big} float64 value(s) beyond float32's "
                    f"range, |x| > 3.4e38: they become Inf on the device)"
                )
        if n:
            bad.append(f"{jax.tree_util.keystr(k) or 'batch'} ({n} value(s))")
    return bad


def check_dtypes(batch):
    """ConfigError naming a batch entry that is not numbers (strings, objects): JAX's own error names no
    key."""
    for k, v in jax.tree_util.tree_flatten_with_path(batch)[0]:
        dtype = getattr(v, "dtype", None)
        dtype = np.asarray(v).dtype if dtype is None else np.dtype(dtype)
        # (bfloat16 and the other ml_dtypes floats are kind "V" to NumPy, and numbers to JAX)
        if dtype.kind in "USOV" and not jnp.issubdtype(dtype, jnp.number):
            raise ConfigError(
                f"batch entry {jax.tree_util.keystr(k) or 'batch'} holds {dtype} values, not numbers: "
                f"encode them first (token ids as int32, features as float32)"
            )


def require_finite_on_host(batch, opt_out: str):
    """ConfigError if the batch's host arrays hold NaN or Inf (``opt_out``: how the caller's user turns the
    check off); its device arrays are the step program's to check."""
    bad = check_finite(batch)
    if bad:
        raise ConfigError(
            f"the batch holds NaN or Inf in {', '.join(bad)}: a pipeline would spread it into every "
            f"stage's weights. Clean the data (np.nan_to_num, drop the rows), or pass "
            f"{opt_out} if non-finite inputs are intended"
        )


def check_integer_inputs(model, batch, opt_out: str):
    """ConfigError unless every batch field the model declares in ``integer_inputs`` (key -> number of classes
    or vocabulary size, or None for "non-negative") holds integers in ``[0, bound)``: a label 99 of 5 classes
    gives a NaN loss, -1 silently reads the last class, a token id past the vocabulary poisons every
    weight."""
    for key, bound in (model.integer_inputs or {}).items():
        if not isinstance(batch, dict) or key not in batch:
            continue  # check_integer_keys says so
        v = batch[key]
        dtype = getattr(v, "dtype", None) or np.asarray(v).dtype
        if not jnp.issubdtype(dtype, jnp.integer):
            raise ConfigError(
                f"batch[{key!r}] is {dtype} but the model reads integer ids from it (class or token "
                f"ids{f' in [0, {bound})' if bound else ''}); a float 2.7 would be truncated to 2. "
                f"Convert it: batch[{key!r}].astype(np.int32)"
            )
        if isinstance(v, jax.Array):
            continue  # on the device: checked inside the step's program, never read here
        lo, hi = int(np.min(v)), int(np.max(v))
        if lo < 0 or (bound is not None and hi >= bound):
            bad = lo if lo < 0 else hi
            raise ConfigError(
                f"batch[{key!r}] holds {bad}, outside [0, {bound if bound is not None else 'inf'}) "
                "that the model accepts "
                f"({'negative ids read the last rows' if bad < 0 else 'past the table: a NaN loss'}). "
                "Fix the data, or declare the right size in integer_inputs= (of PipelineModel, from_nnx or "
                "from_linen); "
                f"{opt_out} turns the check off"
            )


def check_integer_keys(model, batch):
    """ConfigError naming a key of ``PipelineModel(integer_inputs=...)`` that the batch lacks: a misspelt key
    would otherwise turn the check off without a word."""
    declared = model.integer_inputs or {}
    missing = [k for k in declared if not isinstance(batch, dict) or k not in batch]
    if missing:
        have = list(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ConfigError(
            f"integer_inputs= names {missing}, which the batch lacks (it has "
            f"{have}); name the batch fields that hold integer ids, e.g. integer_inputs="
            f"{{'label': num_classes}}"
        )


def refuse_traced(leaves, call: str, what: str):
    """ConfigError if one of ``leaves`` is a tracer: ``call`` ran inside a JAX transformation, where the
    pipeline can neither run its own compiled program nor check values on the host."""
    if any(isinstance(v, jax.core.Tracer) for v in leaves):
        raise ConfigError(
            f"{call} got a traced {what}: it was called inside jax.jit, jax.grad, jax.vmap or another JAX "
            f"transformation. A Pipeline compiles its own program over its mesh and checks each batch on "
            f"the host, so call it from Python, outside any transformation (state, metrics = "
            f"pipe.step(state, batch) in a loop); for the gradient alone, pipe.loss_and_grad(state, batch)"
        )


def require_live(state, call: str):
    """ConfigError if ``state`` holds an array an earlier ``step``/``drain`` consumed (donated): JAX would say
    "Buffer has been deleted or donated", or crash where the array was sharded over several devices."""
    leaves = jax.tree.leaves(state)
    refuse_traced(leaves, call, "state")
    if not any(isinstance(v, jax.Array) and v.is_deleted() for v in leaves):
        return  # (the paths are for the message: a live state, the common case, builds none)
    dead = [
        jax.tree_util.keystr(k)
        for k, v in jax.tree_util.tree_flatten_with_path(state)[0]
        if isinstance(v, jax.Array) and v.is_deleted()
    ]
    if dead:
        raise ConfigError(
            f"{call} got a state that an earlier step() or drain() consumed ({len(dead)} array(s), "
            f"e.g. state{dead[0]}): step and drain donate the state they are given, reusing its "
            f"memory for the new one. Keep the state they return -- state, metrics = "
            f"pipe.step(state, batch) -- and use that one"
        )
