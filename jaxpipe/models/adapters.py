"""Flax adapters: a :class:`~jaxpipe.PipelineModel` from a model someone else wrote as Flax modules.

A transformer is an embedding, a stack of identical blocks and a head.  Give the pieces; the adapter stacks
the blocks' parameters into ``num_stages`` stages of ``len(blocks) / num_stages`` blocks each (leading axes
``[stage, block]``; a stage runs its blocks with ``lax.scan``), and gives back a function that turns trained
parameters into the modules' own layout again.

* :func:`from_nnx` takes NNX module instances (the blocks must share one graph structure);
* :func:`from_linen` takes Linen modules with their parameter dicts (``module.apply({"params": p}, ...)``).

``loss(outputs, batch)`` gets the head's output (logits) and the micro-batch, and returns a scalar mean or a
``(sum, count)`` pair (docs/design.md §5); ``inputs(batch)`` picks what the embedding reads (default
``batch["x"]``).  Blocks called with the block's input only; blocks that need masks or dropout keys take
``block_call=lambda apply, p, x, ctx: ...`` (a context model: ``stage_inputs=`` names the batch fields).

Sharding: the modules' own partitioning metadata becomes the model's ``param_specs``
(:mod:`jaxpipe.sharding`): ``nnx.with_partitioning`` (NNX, variables created with
``nnx.use_eager_sharding(False)`` or under a mesh) or ``nn.with_logical_partitioning`` (Linen: pass the boxed
parameters), with ``rules=[("embed", "fsdp"), ("mlp", "tensor"), ...]`` mapping logical axis names to mesh
axes (names without a rule are replicated; no rules: the names are mesh axes).  A stage's spec gets ``None``
for its block axis.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from ..errors import ConfigError
from ..model import PipelineModel


def _stack_blocks(per_block: Sequence[Any], num_stages: int, cut=None):
    """The blocks' parameters stacked: ``[num_stages, n / num_stages, ...]`` for an even cut, or the blocks'
    own ``[n, ...]`` for a ``cut`` (the pipeline pads them: :mod:`jaxpipe.cuts`)."""
    from ..cuts import check_cut, even_cut

    n = len(per_block)
    if cut is None and (num_stages < 1 or n % num_stages):
        suggestion = (
            f"cut={list(even_cut(n, num_stages))} (uneven stages), or " if 1 <= num_stages <= n else ""
        )
        raise ConfigError(
            f"{n} blocks cannot be cut into {num_stages} equal stages: give {suggestion}a number of "
            f"stages dividing {n} (e.g. {[d for d in range(1, n + 1) if n % d == 0]})"
        )
    if cut is not None:
        check_cut(cut, n, num_stages)
    ref = jax.tree.structure(per_block[0])
    for i, p in enumerate(per_block[1:], 1):
        if jax.tree.structure(p) != ref or any(
            jnp.shape(a) != jnp.shape(b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(per_block[0]))
        ):
            raise ConfigError(
                f"block {i}'s parameters differ in structure or shape from block 0's: a pipeline "
                f"stage runs identical blocks (put differing layers into the embedding or head)"
            )
    if cut is not None:
        return jax.tree.map(lambda *xs: jnp.stack(xs), *per_block)
    per = n // num_stages
    return jax.tree.map(lambda *xs: jnp.stack(xs).reshape((num_stages, per) + jnp.shape(xs[0])), *per_block)


def _block_fn(apply_block: Callable, block_call: Optional[Callable]):
    """One block: ``apply_block(p, x)``, or ``block_call(apply_block, p, x, ctx)`` (a context model); a stage
    runs its blocks in order (``lax.scan``: :func:`jaxpipe.cuts.stage_of_blocks`)."""
    if block_call is None:
        return apply_block, False
    return (lambda p, x, ctx: block_call(apply_block, p, x, ctx)), True


def _mesh_spec(spec, rules):
    """A logical PartitionSpec mapped to mesh axes by ``rules`` (logical name -> mesh axis or None)."""
    from jax.sharding import PartitionSpec as P

    if rules is None:
        return P(*spec)
    table = dict(rules)
    one = lambda n: (
        table.get(n) if isinstance(n, str) else (tuple(table.get(x) for x in n if table.get(x)) or None)
    )
    return P(*(None if e is None else one(e) for e in spec))


def _param_specs(block_specs, embed_specs, head_specs, rules):
    """``param_specs`` from the modules' partition specs (trees of PartitionSpec); None where nothing is
    sharded."""
    from jax.sharding import PartitionSpec as P

    is_p = lambda x: isinstance(x, P)
    conv = lambda t, lead=(): jax.tree.map(lambda s: P(*lead, *_mesh_spec(s, rules)), t, is_leaf=is_p)
    out = (conv(block_specs, (None,)), conv(embed_specs), conv(head_specs))
    if not any(any(e is not None for e in s) for s in jax.tree.leaves(out, is_leaf=is_p)):
        return None
    return out


def _shared_variables(embed, head):
    """``[(embed path, head path)]`` of the NNX Variables the embedding and the head share (one object
    reachable from both: a head reusing the token embedding), in ``to_pure_dict`` paths."""
    from flax import nnx

    mine = {id(n): tuple(p) for p, n in nnx.iter_graph(embed) if isinstance(n, nnx.Variable)}
    return [
        (mine[id(n)], tuple(p))
        for p, n in nnx.iter_graph(head)
        if isinstance(n, nnx.Variable) and id(n) in mine
    ]


def _same_arrays(a, b):
    """``[(path in a, path in b)]`` of the leaves ``a`` and ``b`` hold as one object (paths of dict keys)."""
    key = lambda path: tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
    mine = {id(v): key(p) for p, v in jax.tree_util.tree_flatten_with_path(a)[0]}
    return [(mine[id(v)], key(p)) for p, v in jax.tree_util.tree_flatten_with_path(b)[0] if id(v) in mine]


def _share(module, path, variable):
    """``module`` with the Variable at ``path`` replaced by ``variable`` (the tie restored)."""
    node = module
    for k in path[:-1]:
        node = node[k] if isinstance(k, int) else getattr(node, k)
    setattr(node, path[-1], variable) if not isinstance(path[-1], int) else node.__setitem__(
        path[-1], variable
    )
    return module


class _ModelParts(NamedTuple):
    """What an adapter's :class:`~jaxpipe.PipelineModel` is made of at any stage count: how a block, the
    embedding and the head run, their parameters (the blocks' one entry a block), specs and ties."""

    apply_block: Callable
    per_block: List[Any]
    apply_embed: Callable
    embed_params: Any
    apply_head: Callable
    head_params: Any
    param_specs: Any
    tied: Sequence[Tuple[Tuple, Tuple]]


def _builder(parts: _ModelParts, loss, inputs, block_call, stage_inputs, integer_inputs):
    """``build(num_stages, cut=None)``: the model of ``parts`` cut into that many stages (its ``recut``)."""
    block_fn, context = _block_fn(parts.apply_block, block_call)
    pick = inputs or (lambda b: b["x"])

    def build(num_stages, cut=None):
        return PipelineModel(
            block_fn=block_fn,
            stage_params=_stack_blocks(parts.per_block, num_stages, cut),
            cut=None if cut is None else tuple(cut),
            pre=lambda p, b: parts.apply_embed(p, pick(b)),
            pre_params=parts.embed_params,
            post_loss=lambda p, h, b: loss(parts.apply_head(p, h), b),
            post_params=parts.head_params,
            head=parts.apply_head,
            context=context or bool(stage_inputs),
            stage_inputs=tuple(stage_inputs),
            param_specs=parts.param_specs,
            tied=tuple(parts.tied),
            recut=None if cut is not None else build,
            integer_inputs=integer_inputs,
        )

    return build


def _flat_blocks(stage_p, cut):
    """Stage parameters as ``pipe.params`` gives them -> leaves ``[n_blocks, ...]``."""
    return stage_p if cut is not None else jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), stage_p)


def from_nnx(
    blocks: Sequence[Any],
    embed: Any,
    head: Any,
    loss: Callable,
    num_stages: int,
    *,
    inputs: Optional[Callable] = None,
    block_call: Optional[Callable] = None,
    stage_inputs: Sequence[str] = (),
    rules=None,
    cut=None,
    balance: Optional[dict] = None,
    integer_inputs: Optional[dict] = None,
) -> Tuple[PipelineModel, Callable]:
    """A :class:`~jaxpipe.PipelineModel` from NNX modules: identical blocks stacked into stages, an embedding
    and a head.

    A stage scans its blocks.  A Variable the embedding and the head share (a head reusing the token
    embedding) is found and tied (``PipelineModel.tied``: one array, its two uses' gradients summed);
    ``to_modules`` gives a head sharing the embedding's Variable again.

    Args:
        blocks: the blocks, NNX module instances of one structure, in order.
        embed: the embedding module (the first stage's ``pre``): ``embed(batch["x"])``.
        head: the head module (the last stage): ``head(h)`` gives logits.
        loss: ``loss(logits, batch) -> scalar`` (or ``(sum, count)`` for an exact masked mean).
        num_stages: the model stages to cut the blocks into.
        inputs: ``inputs(batch)``: what the embedding is called on (default ``batch["x"]``).
        block_call: ``block_call(apply, p, x, ctx)``: how a block is called where it needs more than its input
            (``apply(p, x, *args)`` runs the block with parameters ``p``; ``ctx`` is the
            :class:`~jaxpipe.StageContext` with the ``stage_inputs`` and the block's dropout key).
        stage_inputs: batch fields the blocks read through ``ctx.inputs`` (an attention mask).
        rules: ``[(logical axis name, mesh axis)]`` for the modules' ``nnx.with_partitioning`` metadata, which
            becomes the model's ``param_specs``.
        cut: blocks per stage where they differ (``[8, 8, 8, 7]``; ``pipe.params`` then holds the blocks as
            ``[n_blocks, ...]``), or ``"balanced"``: chosen from measured costs
            (:func:`jaxpipe.cuts.balanced.balance`).
        balance: with ``cut="balanced"``: ``{"example": micro_batch, "schedule": "1f1b", "options": {...}}``.
        integer_inputs: the batch fields that hold integer ids and their bounds, checked before they train
            (``{"x": vocab, "y": vocab}``; ``PipelineModel.integer_inputs``).

    Returns:
        ``(model, to_modules)``: ``to_modules(params)`` (``pipe.params(state)``) returns ``(blocks, embed,
        head)``, new module instances holding those parameters.

    Raises:
        ConfigError: no blocks, blocks of different structures, or a cut that does not fit the blocks and
            stages.
    """
    from flax import nnx

    gdef, block_state, per_block = _split_blocks(blocks)
    e_def, e_state = nnx.split(embed)
    h_def, h_state = nnx.split(head)
    tied = _shared_variables(embed, head)

    def merged(gd, st):
        return lambda p, *a: nnx.merge(gd, _restore(st, p))(*a)

    spec = lambda st: nnx.to_pure_dict(nnx.get_partition_spec(st))
    specs = _param_specs(spec(block_state), spec(e_state), spec(h_state), rules)

    parts = _ModelParts(
        merged(gdef, block_state),
        per_block,
        merged(e_def, e_state),
        nnx.to_pure_dict(e_state),
        merged(h_def, h_state),
        nnx.to_pure_dict(h_state),
        specs,
        tied,
    )
    build = _builder(parts, loss, inputs, block_call, stage_inputs, integer_inputs)
    model = build(num_stages, _resolve_cut(cut, build, num_stages, len(per_block), balance))
    modules = _NnxParts(gdef, block_state, len(per_block), e_def, e_state, h_def, h_state, tied)
    return model, lambda params: modules.modules(params, model.cut)


def _split_blocks(blocks):
    """``(graph, state, pure dicts)``: the NNX blocks' one graph, the first's state, each one's parameters.

    Raises:
        ConfigError: no blocks, or blocks of different graph structures.
    """
    from flax import nnx

    blocks = list(blocks)
    if not blocks:
        raise ConfigError("from_nnx needs at least one block")
    defs = [nnx.split(b) for b in blocks]
    graph = defs[0][0]
    if any(d != graph for d, _ in defs[1:]):
        raise ConfigError("the blocks have different NNX graph structures; a stage runs identical blocks")
    return graph, defs[0][1], [nnx.to_pure_dict(s) for _, s in defs]


class _NnxParts(NamedTuple):
    """What :func:`from_nnx` split its modules into: a block's graph and state (and the blocks' count), the
    embedding's and the head's, and the Variables they share."""

    block_def: Any
    block_state: Any
    num_blocks: int
    embed_def: Any
    embed_state: Any
    head_def: Any
    head_state: Any
    tied: Any

    def modules(self, params, cut):
        """``(blocks, embed, head)``: new module instances holding ``params`` (``pipe.params(state)``), the
        head sharing the embedding's Variable again where they shared one."""
        from flax import nnx

        stage_p, pre_p, post_p = params
        flat = _flat_blocks(stage_p, cut)
        out = [
            nnx.merge(self.block_def, _restore(self.block_state, jax.tree.map(lambda a: a[i], flat)))
            for i in range(self.num_blocks)
        ]
        e_mod = nnx.merge(self.embed_def, _restore(self.embed_state, pre_p))
        h_mod = nnx.merge(self.head_def, _restore(self.head_state, post_p))
        for e_path, h_path in self.tied:
            node = e_mod
            for k in e_path:
                node = node[k] if isinstance(k, int) else getattr(node, k)
            _share(h_mod, h_path, node)
        return out, e_mod, h_mod


def _restore(state, pure):
    """An NNX state with the values of the pure dict ``pure`` (a copy; ``state`` is not changed)."""
    from flax import nnx

    st = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(st, pure)
    return st


def from_linen(
    block: Any,
    block_params: Sequence[Any],
    embed: Tuple[Any, Any],
    head: Tuple[Any, Any],
    loss: Callable,
    num_stages: int,
    *,
    inputs: Optional[Callable] = None,
    block_call: Optional[Callable] = None,
    stage_inputs: Sequence[str] = (),
    rules=None,
    tied: Sequence[Tuple[Tuple, Tuple]] = (),
    cut=None,
    balance: Optional[dict] = None,
    integer_inputs: Optional[dict] = None,
) -> Tuple[PipelineModel, Callable]:
    """A :class:`~jaxpipe.PipelineModel` from Linen modules: one block module with a parameter dict per layer,
    an embedding and a head.

    Parameters boxed by ``nn.with_logical_partitioning`` give the model's ``param_specs`` through ``rules``.
    An array object that the embedding's and the head's parameters both hold is tied (one array, its two uses'
    gradients summed).

    Args:
        block: the block module, applied as ``block.apply({"params": p}, x)``.
        block_params: one ``params`` dict per block, in order.
        embed: ``(module, params)`` of the embedding.
        head: ``(module, params)`` of the head, or ``(module, params, method)`` -- a tied LM head is
            ``(embed_module, embed_params, "attend")``.
        loss: ``loss(logits, batch) -> scalar`` (or ``(sum, count)``).
        num_stages: the model stages to cut the blocks into.
        inputs: as in :func:`from_nnx`.
        block_call: as in :func:`from_nnx` (``apply(p, x, *args)`` is ``block.apply({"params": p}, x,
            *args)``).
        stage_inputs: as in :func:`from_nnx`.
        rules: logical axis name -> mesh axis, for the boxed parameters' metadata.
        tied: ``[(embed_path, head_path)]`` (tuples of dict keys): ties between two arrays that are equal
            copies.
        cut: as in :func:`from_nnx`.
        balance: as in :func:`from_nnx`.
        integer_inputs: as in :func:`from_nnx`.

    Returns:
        ``(model, to_params)``: ``to_params(params)`` returns ``(block params list, embed params, head
        params)`` in Linen's layout (unboxed).

    Raises:
        ConfigError: a tie between arrays that differ, or a cut that does not fit.
    """
    import flax.linen as nn
    from flax.core import meta

    specs = [nn.get_partition_spec(p) for p in (list(block_params)[:1] or [{}]) + [embed[1], head[1]]]
    block_params = [meta.unbox(p) for p in block_params]
    h_mod, h_p, *h_method = head
    (e_mod, e_p), h_p = (embed[0], meta.unbox(embed[1])), meta.unbox(h_p)
    if not block_params:
        raise ConfigError("from_linen needs the parameters of at least one block")
    lin = lambda mod, *m: lambda p, *a: mod.apply({"params": p}, *a, **({"method": m[0]} if m else {}))
    ties = [(tuple(a), tuple(b)) for a, b in tied]
    ties += [t for t in _same_arrays(e_p, h_p) if t not in ties]

    specs = _param_specs(*specs, rules)
    parts = _ModelParts(lin(block), block_params, lin(e_mod), e_p, lin(h_mod, *h_method), h_p, specs, ties)
    build = _builder(parts, loss, inputs, block_call, stage_inputs, integer_inputs)
    model = build(num_stages, _resolve_cut(cut, build, num_stages, len(block_params), balance))

    def to_params(params):
        stage_p, pre_p, post_p = params
        flat = _flat_blocks(stage_p, model.cut)
        n = jax.tree.leaves(flat)[0].shape[0]
        blocks: List[Any] = [jax.tree.map(lambda a: a[i], flat) for i in range(n)]
        return blocks, pre_p, post_p

    return model, to_params


def _resolve_cut(cut, build, num_stages: int, n_blocks: int, balance: Optional[dict]):
    from ..cuts import resolve_cut

    return resolve_cut(cut, build, num_stages, n_blocks, balance)
