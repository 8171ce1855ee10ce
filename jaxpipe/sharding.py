"""Where weights live: a stage's parameters sharded over the mesh's *model axes* (``fsdp``, ``tensor``, a
user's own), left to XLA's SPMD partitioner inside the stages (jaxpipe's programs are manual over the pipeline
axes only, :func:`jaxpipe.axes.manual`).

A model states its layout with ``PipelineModel(param_specs=(stage_specs, pre_specs, post_specs))``: pytrees of
``PartitionSpec`` over model axes, ``stage_specs`` for ONE stage's leaves (jaxpipe adds the stage axis in
front), ``pre_specs`` / ``post_specs`` for ``pre``'s and ``post_loss``'s parameters (``None``: replicated).
The optimizer state, weight stashes, accumulators and gradients follow the sharding of the parameters they
belong to.  Checked here, once, with an error naming the leaf, the axis and what would work.
"""

from __future__ import annotations

import re
from typing import Any, Tuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .axes import AXES, STAGE, model_axes
from .errors import ConfigError

is_spec = lambda x: isinstance(x, P) or x is None  # a user's spec tree (None: replicated)
is_P = lambda x: isinstance(x, P)  # a resolved spec tree (None only at a tied copy's path: no array)


def _path(kp) -> str:
    return jax.tree_util.keystr(kp) or "(root)"


def _spec_tree(specs, params, what: str):
    """``specs`` as a tree with one PartitionSpec per leaf of ``params`` (None / a missing part:
    replicated)."""
    if specs is None:
        return jax.tree.map(lambda _: P(), params)
    if isinstance(specs, P):  # one spec for every leaf
        return jax.tree.map(lambda _: specs, params)
    try:
        # specs may be a prefix of the parameters: a spec (or None) for a whole subtree applies to every leaf
        whole = lambda s, sub: jax.tree.map(lambda _: P() if s is None else s, sub)
        return jax.tree.map(whole, specs, params, is_leaf=is_spec)
    except (ValueError, TypeError) as e:
        want = jax.tree.structure(jax.tree.map(lambda _: 0, params))
        raise ConfigError(
            f"param_specs for {what}: its structure differs from the parameters' ({e}); give one "
            f"PartitionSpec (or None) per leaf of {want}"
        ) from None


def _check_leaf(spec, shape, where: str, mesh) -> None:
    axes = model_axes(mesh)
    if not isinstance(spec, P):
        raise ConfigError(f"param_specs{where}: {spec!r} is not a PartitionSpec")
    if len(spec) > len(shape):
        raise ConfigError(
            f"param_specs{where}: {spec} has {len(spec)} entries for an array of shape {tuple(shape)}"
        )
    for dim, entry in enumerate(spec):
        for name in (entry,) if isinstance(entry, str) else (entry or ()):
            if name in AXES:
                raise ConfigError(
                    f"param_specs{where}: {spec} uses the pipeline axis {name!r}; jaxpipe places a "
                    f"stage's weights on 'stage' itself -- shard within a stage over model axes "
                    f"({', '.join(axes) or 'none in this mesh: jp.make_mesh(..., tensor=2)'})"
                )
            if name not in mesh.axis_names:
                raise ConfigError(
                    f"param_specs{where}: {spec} names axis {name!r}, which the mesh lacks (its axes: "
                    f"{mesh.axis_names}); build the mesh with it, e.g. jp.make_mesh(stages=..., "
                    f"{name}=2) for fsdp/tensor"
                )
        n = int(np.prod([mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else (entry or ()))]))
        if shape[dim] % n:
            raise ConfigError(
                f"param_specs{where}: dimension {dim} of shape {tuple(shape)} is {shape[dim]}, not "
                f"divisible by {entry!r} ({n} devices); use a size divisible by {n} or another "
                f"dimension"
            )


def param_specs(model, mesh, ties) -> Tuple[Any, Any, Any]:
    """``(stage, pre, post)`` trees of PartitionSpec for the train state's parameters (stage leaves without
    the stage axis; post without its tied copies), checked against the mesh; all ``P()`` without
    ``param_specs``."""
    given = getattr(model, "param_specs", None)
    if given is not None and (not isinstance(given, (tuple, list)) or len(given) != 3):
        raise ConfigError(
            f"param_specs={given!r}: give a triple (stage_specs, pre_specs, post_specs), each a "
            f"pytree of PartitionSpec (or None: replicated)"
        )
    stage_one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), model.stage_params)
    parts = (stage_one, model.pre_params, model.post_params)
    names = ("the stage parameters", "pre_params", "post_params")
    specs = tuple(_spec_tree(None if given is None else given[i], parts[i], names[i]) for i in range(3))
    if given is not None:
        for i, (sp, pa) in enumerate(zip(specs, parts)):
            for (kp, s), a in zip(
                jax.tree_util.tree_flatten_with_path(sp, is_leaf=is_spec)[0], jax.tree.leaves(pa)
            ):
                _check_leaf(s, np.shape(a), f"[{i}]{_path(kp)} ({names[i]})", mesh)
    return ties.strip(specs)


def param_shardings(model, mesh, ties) -> Tuple[Any, Any, Any]:
    """The train state's parameter shardings: stage leaves ``P('stage', *spec)``, pre/post ``spec``."""
    s, pre, post = param_specs(model, mesh, ties)
    on = lambda spec: NamedSharding(mesh, spec)
    stage = jax.tree.map(lambda spec: on(P(STAGE, *spec)), s, is_leaf=is_P)
    return (stage, jax.tree.map(on, pre, is_leaf=is_P), jax.tree.map(on, post, is_leaf=is_P))


def check_model_axes_used(model, mesh, batch_axes) -> Tuple[str, ...]:
    """The batch axes (``data`` and, for FSDP, ``fsdp``: data parallelism with sharded weights), checked: each
    model axis of size > 1 must shard some parameter or the batch, or its devices would silently repeat the
    same work."""
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    axes = model_axes(mesh)
    bad = [a for a in batch_axes if a not in ("data",) + axes]
    if "data" not in batch_axes or bad:
        raise ConfigError(
            f"batch_axes={batch_axes!r}: the batch is split over 'data' and optionally model axes of "
            f"the mesh ({', '.join(axes) or 'none here'}), e.g. batch_axes=('data', 'fsdp') for FSDP"
        )
    used = set(batch_axes)
    for tree in getattr(model, "param_specs", None) or ():
        for spec in jax.tree.leaves(tree, is_leaf=is_spec):
            for entry in spec or ():
                used.update((entry,) if isinstance(entry, str) else (entry or ()))
    idle = [a for a in axes if mesh.shape[a] > 1 and a not in used]
    if idle:
        raise ConfigError(
            f"the mesh's model axis {idle[0]!r} ({mesh.shape[idle[0]]} devices) shards nothing: no "
            f"param_specs entry names it and the batch is not split over it, so its devices would "
            f"repeat the same work. Give the model param_specs over it (e.g. Megatron-style "
            f"P(None, '{idle[0]}') / P('{idle[0]}', None) for a weight pair), pass "
            f"batch_axes=('data', '{idle[0]}') for FSDP, or drop the axis from the mesh"
        )
    return tuple(a for a in ("data",) + axes if a in batch_axes)


def like_params(optimizer, state_shapes, param_shapes, shardings, mesh, other=P()):
    """Shardings for an optax state: every leaf that belongs to a parameter (Adam's moments, momentum) takes
    that parameter's sharding (``optax.tree_map_params``); the rest (counts, scalars) is replicated.  An
    optimizer whose state does not mirror the parameters falls back to matching leaves by shape and dtype.
    ``other``: the spec of the rest (per-stage state: ``P('stage')``)."""
    import optax

    rep = NamedSharding(mesh, other)
    is_sh = lambda x: isinstance(x, NamedSharding)
    try:
        return optax.tree_map_params(
            optimizer,
            lambda _, sh: sh,
            state_shapes,
            shardings,
            transform_non_params=lambda _: rep,
            is_leaf=is_sh,
        )
    except (ValueError, TypeError, KeyError):  # the state's structure does not mirror the parameters
        by_shape = {}
        for a, sh in zip(jax.tree.leaves(param_shapes), jax.tree.leaves(shardings, is_leaf=is_sh)):
            by_shape.setdefault((tuple(np.shape(a)), np.dtype(a.dtype)), sh)
        return jax.tree.map(
            lambda a: by_shape.get((tuple(np.shape(a)), np.dtype(a.dtype)), rep), state_shapes
        )


def per_stage_shardings(tree, local_specs, mesh, lead=(STAGE,)):
    """Shardings for state held per stage (leading axis over ``lead``): a no-flush method's parameters,
    optimizer and policy state (stashes, shadow copies, accumulators, predictions).  A leaf whose trailing
    shape and dtype are those of a local parameter leaf ``(w, pre, post)`` takes that leaf's model-axis spec
    after the stage axis (and None for any axes between, e.g. a stash's versions); every other leaf is split
    over the stage axis only."""
    specs = {}
    shapes, spec_leaves = local_specs
    for a, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(spec_leaves, is_leaf=is_P)):
        specs.setdefault((tuple(np.shape(a)), np.dtype(a.dtype)), spec)

    def one(a):
        shape = tuple(np.shape(a))[1:]
        for k in range(len(shape), -1, -1):
            spec = specs.get((shape[len(shape) - k :], np.dtype(a.dtype))) if k else None
            if spec is not None and any(spec):
                return NamedSharding(
                    mesh, P(lead if len(lead) > 1 else lead[0], *([None] * (len(shape) - k)), *spec)
                )
        return NamedSharding(mesh, P(lead if len(lead) > 1 else lead[0]))

    return jax.tree.map(one, tree)


_REF = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=(%[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def permutes_in_branches(hlo_text: str) -> int:
    """Collective-permutes inside a conditional's branches (or what they call) in a compiled module's text.
    jaxpipe itself never puts a collective in a conditional; one there was inserted by XLA to reshard a
    stage's values over a model axis."""
    comps, name = {}, None
    for line in hlo_text.splitlines():
        m = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    refs = {
        n: set(_REF.findall("\n".join(t)))
        | {x.strip() for b in _BRANCHES.findall("\n".join(t)) for x in b.split(",")}
        for n, t in comps.items()
    }
    todo = set()
    for t in comps.values():
        text = "\n".join(t)
        todo |= {x.strip() for b in _BRANCHES.findall(text) for x in b.split(",")}
        todo |= set(re.findall(r"(?:true_computation|false_computation)=(%[\w.\-]+)", text))
    seen = set()
    while todo:
        n = todo.pop()
        if n in seen or n not in comps:
            continue
        seen.add(n)
        todo |= refs[n]
    return sum(len(re.findall(r" collective-permute(?:-start)?\(", "\n".join(comps[n]))) for n in seen)


def branches_refused(mesh) -> bool:
    """Whether a conditional holding collectives is refused on this mesh (model axes on XLA CPU, below)."""
    return bool(model_axes(mesh)) and jax.devices()[0].platform == "cpu"


def guard_collectives(fn, mesh):
    """``fn`` (a jitted program), checked at its first call where the mesh has model axes on XLA CPU: a
    collective-permute inside a lane's conditional deadlocks there (only the stage devices running the lane
    enter it, a CPU collective-permute waits for every device), so a ConfigError says which spec to change
    instead of a 40-second hang and an abort."""
    if not branches_refused(mesh):
        return fn
    checked = []

    def run(*args):
        if not checked:
            n = permutes_in_branches(fn.lower(*args).compile().as_text())
            if n:
                raise ConfigError(
                    f"with these param_specs XLA reshards a stage's values with {n} collective-permute(s) "
                    "inside "
                    "the pipeline's lane conditionals, which deadlock on XLA CPU (a CPU collective-permute "
                    "waits "
                    f"for every device; only the stage devices running the lane enter it). Shard so that a "
                    f"stage needs no resharding -- Megatron-style column then row splits of matmul pairs, an "
                    "fsdp split of kernels feeding plain matmuls -- and keep layers whose outputs are "
                    "split and "
                    f"reshaped (a fused q/k/v kernel split across heads) replicated; GPUs have no such limit"
                )
            checked.append(True)
        return fn(*args)

    run.lower = fn.lower
    return run
