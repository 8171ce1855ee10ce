"""``PipelineModel``: a model cut into ``pre`` -> ``stage_fn`` x num_stages -> ``post_loss`` (docs/design.md
§5)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from .errors import ConfigError


def _default_pre(_, batch):
    if not isinstance(batch, dict) or "x" not in batch:
        raise ConfigError(
            "the default pre(pre_params, batch) returns batch['x'], but the batch has no key "
            "'x'; pass pre=... to PipelineModel or give the batch an 'x' entry"
        )
    return batch["x"]


def stack_stages(per_stage):
    """Stack a list of per-stage parameter pytrees (one per stage, same structure, shapes and dtypes) on a
    leading stage axis -- the ``stage_params`` layout ``PipelineModel`` wants."""
    per_stage = list(per_stage)
    if not per_stage:
        raise ConfigError("stack_stages got no stages: give one parameter pytree per stage")
    ref = jax.tree.structure(per_stage[0])
    ref_avals = [(jnp.shape(l), jnp.result_type(l)) for l in jax.tree.leaves(per_stage[0])]
    for i, p in enumerate(per_stage[1:], 1):
        if jax.tree.structure(p) != ref:
            raise ConfigError(
                f"stage {i}'s parameters have another pytree structure than stage 0's "
                f"({jax.tree.structure(p)} vs {ref}): every stage runs the same stage_fn, so "
                f"every stage needs the same parameter structure (pad or share layers so they agree)"
            )
        avals = [(jnp.shape(l), jnp.result_type(l)) for l in jax.tree.leaves(p)]
        for j, (a, b) in enumerate(zip(avals, ref_avals)):
            if a != b:
                raise ConfigError(
                    f"stage {i}'s parameter leaf {j} is {a[1]}{list(a[0])} but stage 0's is "
                    f"{b[1]}{list(b[0])}: stacking needs equal shapes and dtypes per leaf"
                )
    return jax.tree.map(lambda *ls: jnp.stack(ls), *per_stage)


def loss_terms(out):
    """``(value, count)`` of what ``post_loss`` returned: a scalar mean loss is ``(mean, 1)``; a
    ``(sum, count)`` pair (a masked or variable-length loss) is itself.  Raises ConfigError otherwise."""
    if isinstance(out, (tuple, list)):
        if len(out) != 2 or any(jnp.shape(o) != () for o in out):
            raise ConfigError(
                f"post_loss returned {type(out).__name__} of {len(out)} value(s) with shapes "
                f"{[tuple(jnp.shape(o)) for o in out]}: return a scalar mean loss, or a pair of "
                f"scalars (sum of the per-token/per-example losses, their count) for an exact "
                f"masked mean over the whole batch"
            )
        return out[0], (
            out[1] if isinstance(out[1], jax.ShapeDtypeStruct) else jnp.asarray(out[1], jnp.float32)
        )
    if jnp.shape(out) != ():
        raise ConfigError(
            f"post_loss returned shape {tuple(jnp.shape(out))}: return a scalar mean loss over "
            f"the micro-batch, or a (sum, count) pair of scalars"
        )
    return out, jnp.ones((), jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StageContext:
    """What a context-taking ``stage_fn(params, x, ctx)`` receives besides its activation.

    Attributes:
        inputs: the micro-batch's fields named in ``PipelineModel.stage_inputs`` (attention masks,
            positions, segment ids), sliced to the micro-batch, never sent between stages.
        key: a PRNG key (raw ``uint32[2]``) that depends only on (step, micro-batch, stage) --
            :func:`stage_key` -- so dropout is the same in every schedule and in the unpipelined reference;
            ``None`` when the model is evaluated without a key (``model.loss(params, batch)`` /
            ``forward``): a stage_fn should then skip dropout.
        stage: the model stage index (int32)."""

    inputs: Any
    key: Any
    stage: Any


def microbatch_key(seed: int, step, microbatch):
    """The key of one micro-batch of one step, as every schedule draws it.

    ``model.loss(params, mb, key=microbatch_key(...))`` reproduces what the pipeline computed for that
    micro-batch.

    Args:
        seed: the pipeline's ``seed``.
        step: the step (the number of updates before it).
        microbatch: ``replica * M + j`` for micro-batch ``j`` of data replica ``replica`` (the flat
            data-parallel index).

    Returns:
        ``fold_in(fold_in(PRNGKey(seed), step), microbatch)``."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), step), microbatch)


def stage_key(mb_key, stage):
    """The key ``stage_fn`` gets on model stage ``stage`` for the micro-batch whose key is ``mb_key``."""
    return jax.random.fold_in(mb_key, stage)


@dataclasses.dataclass(frozen=True)
class PipelineModel:
    """A model cut into ``pre`` -> ``stage_fn`` x num_stages -> ``post_loss``, each part a pure function.

    Attributes:
        stage_fn: ``stage_fn(params_of_one_stage, x) -> x``: the same function on every stage; ``x`` (a
            float array or a pytree of them) keeps its shapes from stage to stage.  With
            ``context``/``stage_inputs`` it is ``stage_fn(params, x, ctx)`` (below).
        stage_params: one pytree for all stages, every leaf stacked on a leading axis of size num_stages
            (``jp.stack_stages([p0, p1, ...])`` builds it); stage ``s`` gets ``leaf[s]``.  A stage may hold
            several layers and ``lax.scan`` over them (the Flax adapters do): zero-bubble's B/W split works
            through the scan.
        pre: ``pre(pre_params, batch) -> x``: run on the first stage (embedding, input projection);
            default: ``batch["x"]``.  ``pre_params``: its parameters (any pytree; ``()`` for none).
        post_loss: ``post_loss(post_params, x, batch)``: run on the last stage; returns the micro-batch's
            scalar mean loss, or a ``(sum, count)`` pair (masked tokens: ``(jnp.sum(ce * mask),
            jnp.sum(mask))``), which the pipeline divides by the count summed over every micro-batch,
            replica and host -- the full-batch masked mean.  A micro-batch whose count is 0 contributes
            nothing.  ``post_params``: its parameters.
        head: ``head(post_params, x) -> outputs``: optional: the last stage's outputs without the loss
            (logits), for evaluation and sampling (``model.outputs``); not used in training.
        context: True: ``stage_fn`` takes a third argument, a :class:`StageContext` with ``ctx.inputs``
            (the micro-batch's ``stage_inputs`` fields, sliced on the device, never sent between stages),
            ``ctx.key`` (a PRNG key that depends only on step, micro-batch and stage: dropout) and
            ``ctx.stage`` (the model stage).
        stage_inputs: batch fields ``stage_fn`` reads from ``ctx.inputs`` (an attention mask, positions);
            giving any implies ``context=True``.  A field read but not listed is a ConfigError naming it.
        tied: ``[(pre_path, post_path), ...]``: the leaf at ``post_path`` of ``post_params`` *is* the leaf
            at ``pre_path`` of ``pre_params`` (a tied embedding and LM head; paths are tuples of dict keys
            / indices). The pipeline holds it once: one gradient (the sum of both uses, at the pre path),
            one optimizer state. Both sides must hold the same array (checked).  ``jp.models.from_nnx``
            finds ties itself.
        integer_inputs: ``{batch key: bound or None}``: fields holding integer ids (labels, tokens) checked
            to lie in ``[0, bound)`` at every step (``None``: non-negative) -- a label of -1 would
            otherwise read the last class silently.  Off unless given (the reference models give it).
        recut: optional ``recut(n) -> PipelineModel``: the same model in ``n`` stages (the Flax adapters
            give it: their stages scan whole blocks), so ``schedule="interleaved_1f1b"`` and the
            V-schedules can take the model as written with one stage per device and cut it into the chunks
            they need.
        block_fn: (with ``cut``) a model of identical blocks: ``block_fn(params_of_one_block, x)`` (``(p,
            x, ctx)`` with ``context``) and ``stage_fn`` left out (a stage scans its blocks).  ``cut=(8, 8,
            8, 7)``: stages of different lengths; ``stage_params`` are then the blocks' own, leaves
            ``[n_blocks, ...]``, and stay so in everything the pipeline gives back (``params``, gradients);
            inside, shorter stages are padded and the padding skipped (:mod:`jaxpipe.cuts`; the guide's
            \"Cutting a model into stages\").
        param_specs: ``(stage_specs, pre_specs, post_specs)``: ``PartitionSpec``s over the mesh's model
            axes (``fsdp``, ``tensor``) for ONE stage's leaves (jaxpipe adds the stage axis) and for
            ``pre``/``post_loss``'s parameters; ``None`` (or a ``None`` entry): replicated.  See
            :mod:`jaxpipe.sharding`."""

    stage_fn: Optional[Callable] = None
    stage_params: Any = None
    pre: Optional[Callable] = None
    pre_params: Any = ()
    post_loss: Optional[Callable] = None
    post_params: Any = ()
    head: Optional[Callable] = None  # optional head(post_params, x) -> outputs (logits), for eval/sampling
    context: bool = False  # stage_fn(params, x, ctx) with a StageContext (inputs, key, stage)
    stage_inputs: Tuple[str, ...] = ()  # batch fields stage_fn reads (ctx.inputs); implies context
    tied: Tuple = ()  # ((pre_path, post_path), ...): one array used by pre and post_loss
    integer_inputs: Any = None  # {batch key: bound or None}: integer ids checked in [0, bound)
    #: (stage_specs, pre_specs, post_specs): PartitionSpecs over the mesh's model axes (fsdp, tensor, ...) for
    #: ONE stage's leaves (jaxpipe adds the stage axis) and for pre/post_loss's parameters; None: replicated
    #: (:mod:`jaxpipe.sharding`)
    param_specs: Any = None
    #: ``recut(n)``: the same model cut into ``n`` stages (its stages scan whole blocks: the Flax adapters set
    #: it).  Interleaved 1F1B and the V-schedules use it when the model as written has one stage per device.
    recut: Optional[Callable[[int], "PipelineModel"]] = dataclasses.field(
        default=None, compare=False, repr=False
    )
    #: ``block_fn(params_of_one_block, x)`` (``(p, x, ctx)`` for a context model): a model of identical
    #: blocks; ``stage_fn`` then runs a stage's blocks in order (``lax.scan``) and may be left out
    block_fn: Optional[Callable] = dataclasses.field(default=None, compare=False, repr=False)
    #: ``cut=(8, 8, 8, 7)``: blocks per stage (uneven stages, :mod:`jaxpipe.cuts`); ``stage_params`` are then
    #: the blocks' own, leaves ``[n_blocks, ...]``, and ``block_fn`` is needed
    cut: Optional[Tuple[int, ...]] = None
    #: whether ``block_fn`` takes a ctx (set from ``context``/``stage_inputs`` when ``stage_fn`` is derived)
    block_context: Optional[bool] = dataclasses.field(default=None, compare=False, repr=False)
    #: the cut of the model :meth:`padded` made this one from: its ``loss``/``forward`` also take the blocks'
    #: layout (``pipe.params``), so ``pipe.model.loss(pipe.params(state), batch)`` works for any cut
    padded_cut: Optional[Tuple[int, ...]] = dataclasses.field(default=None, compare=False, repr=False)
    #: the stage runs ``block_fn`` over its blocks (set when ``stage_fn`` is derived): each block's key
    #: derives from the micro-batch's key and the block's index in the whole model, not from the stage holding
    #: it, so another cut or another number of stages draws the same dropout masks
    #: (:func:`~jaxpipe.cuts.stage_of_blocks`)
    block_keys: bool = dataclasses.field(default=False, compare=False, repr=False)

    def __post_init__(self):
        self._set_blocks()
        if isinstance(self.stage_inputs, str):
            object.__setattr__(self, "stage_inputs", (self.stage_inputs,))
        object.__setattr__(self, "stage_inputs", tuple(self.stage_inputs))
        if self.stage_inputs:
            object.__setattr__(self, "context", True)
        object.__setattr__(self, "tied", tuple((tuple(a), tuple(b)) for a, b in self.tied))
        if self.pre is None:
            object.__setattr__(self, "pre", _default_pre)
        if self.post_loss is None:
            raise ConfigError("PipelineModel needs post_loss(post_params, x, batch) -> scalar mean loss")
        leaves = jax.tree.leaves(self.stage_params)
        if not leaves:
            raise ConfigError(
                "stage_params has no arrays: give every stage its parameters, stacked on a "
                "leading axis of size num_stages"
            )
        sizes = {jnp.shape(l)[0] if jnp.ndim(l) else None for l in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ConfigError(
                f"every stage_params leaf needs the same leading (stage) axis; leading sizes "
                f"found: {sorted(map(str, sizes))}. Stack one parameter pytree per stage with "
                f"jp.stack_stages([params_of_stage_0, params_of_stage_1, ...]) (a list of per-layer "
                f"dicts is not a stacked pytree)"
            )

    def _set_blocks(self):
        """``block_fn`` and ``cut``: the stage function that runs a stage's blocks (skipping padding)."""
        if self.stage_params is None:
            raise ConfigError(
                "PipelineModel needs stage_params: the stages' parameters stacked on a leading "
                "stage axis (or, with cut=, the blocks' stacked on a leading block axis)"
            )
        if self.cut is not None:
            from .cuts import check_cut

            if self.block_fn is None:
                raise ConfigError(
                    "PipelineModel(cut=...) needs block_fn(params_of_one_block, x): stages of "
                    "different lengths run their blocks one by one, skipping the padding"
                )
            n = (
                jnp.shape(jax.tree.leaves(self.stage_params)[0])[0]
                if jax.tree.leaves(self.stage_params)
                else 0
            )
            object.__setattr__(self, "cut", check_cut(self.cut, n))
        if self.block_fn is not None and self.stage_fn is None:
            from .cuts import stage_of_blocks

            takes_ctx = (
                self.block_context
                if self.block_context is not None
                else (self.context or bool(self.stage_inputs))
            )
            object.__setattr__(self, "block_context", takes_ctx)
            object.__setattr__(self, "block_keys", True)
            object.__setattr__(self, "stage_fn", stage_of_blocks(self.block_fn, self.cut, takes_ctx))
            if self.cut is not None:
                object.__setattr__(self, "context", True)  # the stage reads ctx.stage to skip its padding
        if self.stage_fn is None:
            raise ConfigError(
                "PipelineModel needs stage_fn(params_of_one_stage, x) -> x, or block_fn for a "
                "model of identical blocks"
            )

    @property
    def num_stages(self) -> int:
        if self.cut is not None:
            return len(self.cut)
        return int(jnp.shape(jax.tree.leaves(self.stage_params)[0])[0])

    def padded(self) -> "PipelineModel":
        """The model the executor runs: a cut model's blocks padded to ``[stages, max(cut), ...]`` (zeros; the
        stage function skips them); an even model itself."""
        if self.cut is None:
            return self
        from .cuts import pad_blocks

        return dataclasses.replace(
            self,
            stage_params=pad_blocks(self.stage_params, self.cut),
            cut=None,
            recut=None,
            padded_cut=self.cut,
        )

    def stage_layout(self, stage_params):
        """A cut model's blocks as the executor holds them (padded); other models' stage parameters unchanged.

        Args:
            stage_params: the blocks ``[n_blocks, ...]`` (a cut model) or the stacked stages.

        Returns:
            The stage parameters, leaves ``[num_stages, max(cut), ...]`` for a cut model."""
        from .cuts import pad_blocks

        if self.cut is None and self.padded_cut is not None:  # the blocks' layout given to a padded model
            blocks = jnp.ndim(jax.tree.leaves(stage_params)[0]) < jnp.ndim(
                jax.tree.leaves(self.stage_params)[0]
            )
            return pad_blocks(stage_params, self.padded_cut) if blocks else stage_params
        return stage_params if self.cut is None else pad_blocks(stage_params, self.cut)

    def user_layout(self, stage_params):
        """The inverse of :meth:`stage_layout`: the padding dropped.

        Args:
            stage_params: the stage parameters as the executor holds them.

        Returns:
            The model's own layout (a cut model: its blocks ``[n_blocks, ...]``)."""
        from .cuts import unpad_blocks

        return stage_params if self.cut is None else unpad_blocks(stage_params, self.cut)

    def chunks(self, n: int) -> "PipelineModel":
        """The model in ``n`` stages.

        A cut model splits each stage's blocks into ``n / num_stages`` chunks (interleaved 1F1B, the
        V-schedules); other models use ``recut``.

        Args:
            n: the stages wanted.

        Returns:
            A :class:`PipelineModel` of ``n`` stages.

        Raises:
            ConfigError: the model cannot be cut so (no ``recut``, or blocks that do not split into ``n``
                stages)."""
        if self.cut is None:
            if self.recut is None:
                raise ConfigError(f"the model cannot be cut into {n} stages: it has no recut")
            return self.recut(n)
        from .cuts import split_cut

        if n % len(self.cut):
            raise ConfigError(f"{n} chunks is not a multiple of the cut's {len(self.cut)} stages")
        return dataclasses.replace(
            self, cut=split_cut(self.cut, n // len(self.cut)), stage_fn=None, context=bool(self.block_context)
        )

    @property
    def params(self):
        return (self.stage_params, self.pre_params, self.post_params)

    def loss(self, params, batch, key=None):
        """The unpipelined loss: ``post_loss(post, stage_fn(...stage_fn(pre(batch))), batch)``.

        Args:
            params: ``(stage_params, pre_params, post_params)``.
            batch: a batch (or one micro-batch).
            key: the micro-batch key of a context model (:func:`microbatch_key`); None (evaluation) gives
                ``ctx.key = None``: no dropout.

        Returns:
            The scalar loss (sum / count where ``post_loss`` returns a pair)."""
        total, count = self.loss_sum_count(params, batch, key)
        return total / count

    def loss_sum_count(self, params, batch, key=None):
        """The unpipelined loss as ``(value, count)`` (:func:`loss_terms`).

        Args:
            params: ``(stage_params, pre_params, post_params)``.
            batch: a batch (or one micro-batch).
            key: as for :meth:`loss`.

        Returns:
            ``(value, count)``: a mean loss's value and 1, or a ``(sum, count)`` loss's pair."""
        _, _, post_p = params
        return loss_terms(self.post_loss(post_p, self.forward(params, batch, key), batch))

    def stage_context(self, batch, mb_key, stage):
        """The :class:`StageContext` of model stage ``stage`` for one micro-batch.

        Args:
            batch: the micro-batch.
            mb_key: its key (:func:`microbatch_key`), or None.
            stage: the model stage index.

        Returns:
            The :class:`StageContext`."""
        missing = [k for k in self.stage_inputs if not isinstance(batch, dict) or k not in batch]
        if missing:
            have = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ConfigError(
                f"stage_inputs names {missing} but the batch has {have}: give the batch those "
                f"fields, or drop them from PipelineModel(stage_inputs=...)"
            )
        inputs = {k: batch[k] for k in self.stage_inputs}
        # a model of blocks: the blocks fold in their own index in the model (the stage only locates them)
        key = None if mb_key is None else (mb_key if self.block_keys else stage_key(mb_key, stage))
        return StageContext(inputs, key, jnp.asarray(stage, jnp.int32))

    def example_context(self, mb):
        """A context of the right structure for tracing ``stage_fn`` on one micro-batch.

        Args:
            mb: a micro-batch (arrays or avals).

        Returns:
            A :class:`StageContext`, or None for a context-free model."""
        return self.stage_context(mb, microbatch_key(0, 0, 0), 0) if self.context else None

    def stage_output_aval(self, w, x, mb):
        """The shape and dtype of one stage's output.

        Args:
            w: one stage's weights (avals or arrays).
            x: the activation it receives.
            mb: the micro-batch (for a context model's ``ctx.inputs``).

        Returns:
            The output's avals (``jax.ShapeDtypeStruct`` pytree)."""
        return jax.eval_shape(lambda w_, x_, b: self.apply_stage(w_, x_, self.example_context(b)), w, x, mb)

    def apply_stage(self, w, x, ctx=None):
        """One stage: ``stage_fn(w, x)``, or ``stage_fn(w, x, ctx)`` for a context model.

        Args:
            w: the stage's weights.
            x: its input activation.
            ctx: the :class:`StageContext` (context models).

        Returns:
            The stage's output activation."""
        return self.stage_fn(w, x, ctx) if self.context else self.stage_fn(w, x)

    def reduction(self, y_aval, mb_example) -> str:
        """How ``post_loss``'s value is reduced, found by tracing it.

        Args:
            y_aval: the last stage's output avals.
            mb_example: a micro-batch (arrays or avals).

        Returns:
            ``"sum"`` where ``post_loss`` returns ``(sum, count)``, else ``"mean"``."""
        out = jax.eval_shape(self.post_loss, self.post_params, y_aval, mb_example)
        loss_terms(out)
        return "sum" if isinstance(out, (tuple, list)) else "mean"

    def forward(self, params, batch, key=None):
        """The unpipelined activations after the last stage (before ``post_loss``).

        Args:
            params: ``(stage_params, pre_params, post_params)``.
            batch: a batch.
            key: as for :meth:`loss`.

        Returns:
            The last stage's output."""
        stage_p, pre_p, _ = params
        stage_p = self.stage_layout(stage_p)
        x = self.pre(pre_p, batch)
        for s in range(jnp.shape(jax.tree.leaves(stage_p)[0])[0]):
            ctx = self.stage_context(batch, key, s) if self.context else None
            x = self.apply_stage(jax.tree.map(lambda a: a[s], stage_p), x, ctx)
        return x

    def check_activation(self, x_aval, y_aval):
        """Refuse a ``stage_fn`` that changes its activation's structure: it is sent to the next stage into
        buffers of that structure.

        Args:
            x_aval: the activation a stage receives (any pytree of floating-point arrays).
            y_aval: what ``stage_fn`` returns for it.

        Raises:
            ConfigError: the structure, a shape or a dtype differs, or a leaf is not floating point."""
        show = lambda t: jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", t)
        if jax.tree.structure(x_aval) != jax.tree.structure(y_aval) or any(
            a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(jax.tree.leaves(x_aval), jax.tree.leaves(y_aval))
        ):
            raise ConfigError(
                f"stage_fn must map an activation to one of the same shape and dtype, leaf by leaf (it "
                f"is sent to the next stage): pre gives {show(x_aval)}, stage_fn returns "
                f"{show(y_aval)}"
            )
        bad = [
            f"{a.dtype}{list(a.shape)}"
            for a in jax.tree.leaves(x_aval)
            if not jnp.issubdtype(a.dtype, jnp.floating)
        ]
        if bad:
            raise ConfigError(
                f"the activation has non-floating leaves {bad}: activations are differentiated and "
                f"their gradients sent back, so every leaf must be a float array. Pass integer "
                f"per-example data (positions, segment ids, masks) to stage_fn as a side input "
                f"instead: PipelineModel(stage_inputs=('positions',)) -> ctx.inputs"
            )
