"""``jp.Pipeline``'s arguments checked before anything is built: each refusal a ``ConfigError`` (or, for a
keyword that does not exist, a ``TypeError``) naming the value, why, and what would work."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .. import schedules
from ..axes import DATA, PIPE, STAGE
from ..errors import ConfigError
from .values import is_int


#: keyword of the unreleased 0.1.0 -> the method whose options it carried (each method's declaration names it)
REMOVED = {m.legacy_keyword: name for name, m in schedules.METHODS.items() if m.legacy_keyword}


def refuse_removed(schedule, removed: dict) -> None:
    """A ``TypeError`` naming the new spelling of a keyword the unreleased 0.1.0 took (``chimera={...}``,
    ``virtual=2``, ``recompute=True``, ...), or Python's own for any other unknown keyword."""
    for kw, value in removed.items():
        if kw == "recompute":
            raise TypeError(
                f"Pipeline(recompute={value!r}) was removed: use residuals='inputs' (the stage input "
                f"only, the forward recomputed) or residuals='all' (the default)"
            )
        if kw in REMOVED:
            new = {"virtual": value} if kw == "virtual" else value
            raise TypeError(
                f"Pipeline({kw}={value!r}) was removed: use Pipeline(..., schedule={REMOVED[kw]!r}, "
                f"options={new!r})"
                + ("" if schedule == REMOVED[kw] else f"; {kw}= carried options of {REMOVED[kw]!r} only")
            )
        raise TypeError(f"Pipeline() got an unexpected keyword argument {kw!r}")


def checked_options(options: Optional[dict]) -> dict:
    """``options`` as a new dict (empty for None), or a ConfigError saying what it takes."""
    if options is not None and not isinstance(options, dict):
        raise ConfigError(
            f"options={options!r}: give a dict of the schedule's options, e.g. "
            f"options={{'concat': 'forward_doubling'}} for chimera"
        )
    return dict(options or {})


def check_optimizer(optimizer) -> None:
    if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        hint = (
            f"{getattr(optimizer, '__module__', '')}.{getattr(optimizer, '__name__', '')} is the function "
            f"that builds one; call it, e.g. optax.adam(1e-3)"
            if callable(optimizer)
            else "give an optax GradientTransformation, e.g. optax.adamw(1e-3)"
        )
        raise ConfigError(f"optimizer={optimizer!r} is not an optax optimizer: {hint}")


def checked_mesh(mesh, model):
    """The mesh (default: one 'stage' device per model stage), with the axes the executor needs."""
    if mesh is None:
        from ..runtime.mesh import make_mesh

        mesh = make_mesh(stages=model.num_stages)
    missing = [a for a in (PIPE, DATA, STAGE) if a not in mesh.axis_names]
    if missing:
        raise ConfigError(
            f"mesh needs axes ('pipe', 'data', 'stage'), it lacks {missing}; build it with "
            f"jp.make_mesh(stages=..., data=...)"
        )
    return mesh


def checked_costs(op_costs):
    """``op_costs`` as (f, b, w[, exchange]) floats (or None), or a ConfigError that says what it takes."""
    if op_costs is None:
        return None
    from ..schedules.lanes import check_costs

    try:
        return check_costs(op_costs, "op_costs")
    except schedules.ScheduleError as e:
        raise ConfigError(str(e)) from None


def check_scalars(num_microbatches, placement, seed) -> None:
    if not is_int(num_microbatches, 1):
        raise ConfigError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    from ..schedules.lanes import PLACEMENTS

    if placement not in PLACEMENTS:
        raise ConfigError(
            f"placement={placement!r}: use 'auto' (the fastest plan for the schedule), "
            f"'lanes' (an F and a B lane in every tick: a tick costs "
            f"f + b, stage 0 holds up to 2D - 1 micro-batches), 'ordered' (the schedule's own "
            f"one action per tick: its memory bound, e.g. D for 1F1B, at max(f, b) per tick) or "
            f"'ordered2' (the ordered plan's order and memory in fewer ticks: two rounds of lanes a tick)"
        )
    if not is_int(seed):
        raise ConfigError(f"seed={seed!r}: give an int (the stage keys of a context model derive from it)")


def check_residuals(residuals):
    """``residuals``: ``"all"`` (every residual of a stage's vjp is stashed until its backward), ``"inputs"``
    (the stage's input only; the backward recomputes the forward), or a ``jax.checkpoint`` policy
    (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``, ...: what it saves is stashed, the rest
    recomputed)."""
    if not (residuals in ("all", "inputs") or callable(residuals)):
        raise ConfigError(
            f"residuals={residuals!r}: give 'all' (stash every residual of a stage's backward: the "
            f"most memory, no recomputation), 'inputs' (the stage input only, the forward recomputed: "
            f"the least memory) or a jax.checkpoint policy, e.g. "
            f"jax.checkpoint_policies.dots_with_no_batch_dims_saveable (matmul outputs kept)"
        )
    if residuals not in ("all", "inputs"):
        probe_policy(residuals)
    return residuals


def probe_policy(policy) -> None:
    """A ``jax.checkpoint`` policy is called as ``policy(primitive, *avals, **params)`` while a backward is
    traced: try it on a small matmul now, so that an uncalled factory, ``print`` or a function of another
    signature is refused here by name rather than by JAX at the first step."""
    probe = lambda x: jnp.sum(jnp.sin(x @ x))
    try:
        jax.make_jaxpr(lambda x: jax.vjp(jax.checkpoint(probe, policy=policy), x)[1](1.0))(
            jax.ShapeDtypeStruct((2, 2), jnp.float32)
        )
    except Exception as e:  # whatever the policy raised when JAX called it
        name = getattr(policy, "__name__", repr(policy))
        raise ConfigError(
            f"residuals={name}: not a jax.checkpoint policy -- JAX calls a policy as "
            f"policy(primitive, *avals, **params) and it raised {type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else ''}. Give 'all', 'inputs' or a policy such as "
            f"jax.checkpoint_policies.dots_with_no_batch_dims_saveable; a policy factory must be "
            f"called first (e.g. jax.checkpoint_policies.save_only_these_names('name'))"
        ) from None


def check_fit(built, sched, model, D, num_microbatches, name) -> None:
    """A user-built Schedule matches the mesh and M; the schedule's model stages match the model's."""
    if built is not None and (built.D, built.num_microbatches) != (D, num_microbatches):
        raise ConfigError(
            f"the Schedule was built for {built.D} devices and {built.num_microbatches} "
            f"micro-batches; this pipeline has {D} 'stage' devices and num_microbatches="
            f"{num_microbatches}: pass num_microbatches={built.num_microbatches} and a mesh of {built.D} "
            f"'stage' devices, or build the schedule for these"
        )
    if sched.num_model_stages != model.num_stages and built is not None:
        raise ConfigError(
            f"the model has {model.num_stages} stages (leading axis of stage_params) but the Schedule's "
            f"actions name {sched.num_model_stages} model stages ({sched.num_model_stages // D} on each of "
            f"its {D} devices): stack {sched.num_model_stages} stages' parameters, or write the schedule "
            f"for {model.num_stages}"
        )
    if sched.num_model_stages != model.num_stages:
        per = sched.num_model_stages // D
        raise ConfigError(
            f"the model has {model.num_stages} stages (leading axis of stage_params) but the mesh's 'stage' "
            f"axis has {D} devices and {name} puts {per} stage(s) on each, {sched.num_model_stages} "
            f"in all; stack {sched.num_model_stages} stages' parameters or use "
            f"jp.make_mesh(stages={max(model.num_stages // max(per, 1), 1)}, ...)"
        )
