"""The cut of the configuration :func:`jaxpipe.tune.configure.configure` picks, balanced (the balanced
cut of :mod:`jaxpipe.cuts.balanced`).

The search ranks even cuts (``make_model(n)`` as the user cuts it).  An even cut is not a balanced one: the
first stage also runs the embedding, the last the head and the loss, and a heavy head makes the last stage the
one every tick waits for.  So once the search has ranked them, the fastest fitting candidate of each stage
count has its blocks cut again from measured costs -- one block's, the embedding's and the head's forward and
backward on its micro-batch (:meth:`~jaxpipe.tune.config_bench.Bench.parts`) -- by
:func:`~jaxpipe.cuts.balanced.balanced_cut` for its schedule, stage count and micro-batches.  Where that cut
differs from the even one, it is a candidate of its own (its label says ``cut=...``):

* its step is the even candidate's predicted step times the cut model's ratio (balanced over even: the same
  schedule, the same micro-batches, only the stages' costs differ);
* its memory is compiled (XLA's ``memory_analysis()``: the longest stage holds more blocks, every stage as
  many slots);
* the pick is then the fastest that fits again; ``configure(measure=k)`` times it beside the others, so a cut
  that does not pay on the devices is not kept.

Only for models of blocks (``block_fn``: ``jp.models.gpt(n, cut=...)``, the Flax adapters); a model given as
one ``stage_fn`` cannot be cut again, and its table says so.
"""

from __future__ import annotations

import dataclasses

from .layout import even_cut
from ..errors import ConfigError


def balance_cuts(conf, budget: float) -> None:
    """For each stage count over one, the fastest fitting candidate of ``conf`` (a
    :class:`~jaxpipe.tune.configure.Configuration`) with its cut balanced, added to ``conf.candidates``; then
    ``conf.best`` is the fastest that fits again, and ``conf.cut_note`` says what each stage count's cut
    did."""
    fits = sorted((c for c in conf.candidates if not c.dropped), key=lambda c: c.step_s)
    heads = {}
    for c in fits:
        if c.stages > 1 and c.cut is None:
            heads.setdefault(c.stages, c)
    if not heads:
        conf.cut_note = "no candidate of several stages fits: no cut to balance"
        return
    if conf._bench.model_for(next(iter(heads.values()))).block_fn is None:
        conf.cut_note = (
            "the cut is not balanced: make_model returns a model without blocks (give block_fn + "
            "blocks, e.g. jp.models.gpt(n, cut=...), to let configure move blocks between stages)"
        )
        return
    conf.cut_note = "; ".join(f"{n} stages: {_twin(conf, c, budget)}" for n, c in sorted(heads.items()))
    conf.best = min((c for c in conf.candidates if not c.dropped), key=lambda c: c.step_s)


def _twin(conf, best, budget: float) -> str:
    """``best`` with its cut balanced, a candidate of ``conf`` where the cut differs from the even one and
    builds; what happened, in words."""
    from ..pipeline import Pipeline
    from .balanced import balanced_cut, per_block

    bench = conf._bench
    model = bench.model_for(best)
    even = (
        tuple(model.cut) if model.cut is not None else even_cut(len(per_block(model).cut), best.model_stages)
    )
    rows = bench.rows // (best.data * best.microbatches)
    choice = balanced_cut(
        sum(even), best.stages, bench.parts(rows), best.schedule, best.microbatches, best._options()
    )
    if tuple(choice.cut) == even:
        return f"the even cut {list(even)} is the balanced one for {best.label()}"
    twin = dataclasses.replace(
        best,
        cut=tuple(choice.cut),
        step_s=best.step_s * choice.predicted / max(choice.even_predicted, 1e-30),
        memory=float("nan"),
        compiled_memory=None,
        dropped="",
        measured_s=None,
    )
    if any(c.label() == twin.label() for c in conf.candidates):  # a search under another budget had it
        return f"balanced cut {list(choice.cut)} (a candidate already)"
    try:
        pipe = Pipeline(bench.model_for(twin), optimizer=bench.optimizer, **twin.pipeline_kwargs())
    except (ConfigError, ValueError) as e:
        return f"the balanced cut {list(choice.cut)} is not buildable: {str(e).splitlines()[0][:80]}"
    fp = bench.footprint(twin, pipe)
    bench.compile_memory([(twin, pipe)])
    twin.memory = twin.compiled_memory
    conf.candidates.append(twin)
    conf._built[id(twin)] = (pipe, fp)
    gain = f"predicted {choice.even_predicted / choice.predicted:.3f}x the even cut {list(even)}'s speed"
    if twin.memory > budget:
        twin.dropped = f"needs {twin.memory / 2**20:,.1f} MiB a device > the budget {budget / 2**20:,.1f}"
        return f"the balanced cut {list(choice.cut)} ({gain}) does not fit"
    return f"balanced cut {list(choice.cut)}: {gain}"
