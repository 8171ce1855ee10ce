"""A balanced cut: how many blocks each stage gets, chosen from measured costs.

An even cut is not a balanced one: the first stage also runs the embedding, the last the head and the loss,
and in lockstep lanes (:mod:`jaxpipe.tune.lockstep`) every lane-tick lasts as long as its slowest active
device.  Here a stage's op costs

    F_s = n_s f_block + [s first] f_pre + [s last] f_post        (B alike with the backward costs)

(plus what each of a short stage's ``max(cut) - n_s`` padding slots costs, and in B one forward per real
block past ``min(cut)``: those slots run in a ``lax.cond`` that rematerialises its block) from one block's, a
padding slot's, the embedding's and the head-plus-loss's forward and backward measured on the running backend
(:func:`measure_parts`), and a cut's step time is the schedule's compute on D devices: the sum over ticks of
the slowest device's own actions in the tick (:func:`predict_cut`, on the plan ``Pipeline`` runs; the
executor's fixed cost per lane-tick is the same for every cut of one schedule and left out).
:func:`balanced_cut` searches the cuts by moving one block at a time from the most even cut while the
prediction falls.  Zero-bubble's B and W are taken as half the backward each (its W carries the embedding's
weight gradient, its B the head's).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import jax
import numpy as np

from .layout import even_cut, split_cut
from .part_costs import PartCosts
from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class CutChoice:
    """The chosen cut, its predicted step compute (seconds), the most even cut's, and the gain (even /
    chosen)."""

    cut: Tuple[int, ...]
    predicted: float
    even_cut: Tuple[int, ...]
    even_predicted: float
    costs: PartCosts
    #: (measured rounds whose own costs choose this cut, rounds): how sure the choice is
    agreement: Tuple[int, int] = (1, 1)
    #: "measured", or the file of kept costs it was read from
    source: str = "measured"

    @property
    def gain(self) -> float:
        return self.even_predicted / self.predicted if self.predicted else 1.0

    def __str__(self):
        return (
            f"balanced cut {list(self.cut)}: predicted {self.predicted * 1e3:.3f} ms of compute per step, "
            f"against {self.even_predicted * 1e3:.3f} ms for the even cut {list(self.even_cut)} "
            f"({self.gain:.3f}x); best in {self.agreement[0]} of {self.agreement[1]} measured rounds"
            + (
                ""
                if self.source == "measured"
                else f" (costs kept in {self.source}; remeasure=True measures again)"
            )
        )


def _stage_costs(cut: Sequence[int], c: PartCosts) -> np.ndarray:
    """``[stage, kind]`` seconds of one op, kinds F, B, W, F2 (B and W: half the backward each)."""
    n = np.asarray(cut, float)
    pad = max(cut) - n  # every stage scans max(cut) slots; the short ones skip the rest
    remat = n - min(cut)  # real blocks in the cond'ed slots recompute their forward in B
    f = n * c.f_block + pad * c.f_pad
    b = n * c.b_block + pad * c.b_pad + remat * c.f_block
    f[0] += c.f_pre
    f[-1] += c.f_post
    b_in, w = b / 2, b / 2
    b[0] += c.b_pre
    b[-1] += c.b_post
    w[0] += c.b_pre
    b_in[-1] += c.b_post
    return np.stack([f, b, b_in, w, 2 * f], axis=1)


def _plan_arrays(schedule):
    """``(active [tick, device, lane], stage [tick, device, lane], kind index per lane, compiled [tick,
    lane])``."""
    from ..schedules.lanes import L
    from ..tune.lockstep import _compiled_lane_ticks, running_plan

    p = running_plan(schedule)
    split = schedule.has_w()
    col = {"F": 0, "B": 2 if split else 1, "W": 3, "F2": 4}
    kinds = np.array([col[k if k == "F2" else k[0]] for k in p.lanes])  # k[0]: a second lane's kind
    active = p.table[..., L["op"]] > 0
    stage = np.where(active, p.table[..., L["stage"]], 0)
    return active, stage, kinds, _compiled_lane_ticks(schedule)


def predict_cut(schedule, cut: Sequence[int], costs: PartCosts, _plan=None) -> float:
    """The step's compute on ``schedule.D`` devices with stages cut as ``cut`` (module docstring).  A schedule
    of ``v`` model stages per device runs each stage's blocks split into ``v`` chunks."""
    active, stage, kinds, _ = _plan if _plan is not None else _plan_arrays(schedule)
    v = schedule.num_model_stages // len(cut)
    table = _stage_costs(split_cut(cut, v) if v > 1 else cut, costs)
    ops = np.where(active, table[stage, kinds[None, None, :]], 0.0)
    return float(ops.sum(axis=2).max(axis=1).sum())  # per tick: the slowest device's own actions


def _descend(
    schedule, start: Tuple[int, ...], costs: PartCosts, least: int, plan=None
) -> Tuple[Tuple[int, ...], float]:
    """Steepest descent over single-block moves between any two stages from ``start``: ``(cut,
    predicted)``."""
    D = schedule.D
    plan = plan if plan is not None else _plan_arrays(schedule)
    cur, t = start, predict_cut(schedule, start, costs, plan)
    while True:
        moves = [
            tuple(c - (k == i) + (k == j) for k, c in enumerate(cur))
            for i in range(D)
            for j in range(D)
            if i != j and cur[i] > least
        ]
        scored = [(predict_cut(schedule, m, costs, plan), m) for m in moves]
        if not scored or min(scored)[0] >= t - 1e-15:
            return cur, t
        t, cur = min(scored)


def _search(schedule, n_blocks: int, costs: PartCosts, least: int) -> Tuple[Tuple[int, ...], float]:
    """The better of two descents (:func:`_descend`), from the most even cut and from its mirror."""
    plan = _plan_arrays(schedule)
    starts = sorted({even_cut(n_blocks, schedule.D), tuple(reversed(even_cut(n_blocks, schedule.D)))})
    return min((_descend(schedule, s, costs, least, plan) for s in starts), key=lambda ct: (ct[1], ct[0]))


def balanced_cut(
    n_blocks: int,
    num_stages: int,
    costs: PartCosts,
    schedule: str = "1f1b",
    num_microbatches: Optional[int] = None,
    options: Optional[dict] = None,
) -> CutChoice:
    """The cut of ``n_blocks`` over ``num_stages`` devices that minimises ``schedule``'s predicted step
    compute (``num_microbatches``: default 2 x devices), beside the most even cut's."""
    from .. import schedules

    if n_blocks < num_stages:
        raise ConfigError(f"{n_blocks} blocks cannot fill {num_stages} stages: every stage needs a block")
    M = num_microbatches or 2 * num_stages
    method = schedules.method(schedule)
    # a schedule of several model stages per device (interleaved 1F1B: virtual, default 2 as the Pipeline's)
    # is balanced over its chunks: v x num_stages model stages
    v = method.stages_per_device(options or {})
    opts = method.resolve(options or {}, v * num_stages, num_stages)
    s = schedules.build(schedule, num_stages=num_stages, num_microbatches=M, **method.builder_options(opts))
    v = s.num_model_stages // num_stages
    cut, t = _search(s, n_blocks, costs, least=max(v, 1))
    even = min(
        (even_cut(n_blocks, num_stages), tuple(reversed(even_cut(n_blocks, num_stages)))),
        key=lambda c: predict_cut(s, c, costs),
    )
    return CutChoice(tuple(int(c) for c in cut), t, even, predict_cut(s, even, costs), costs)


def measure_parts(model, microbatch, calls: int = 7) -> PartCosts:
    """:class:`PartCosts` of ``model`` (a :class:`~jaxpipe.PipelineModel`; a cut model's first block stands
    for every block) on one micro-batch, measured once on the default device: each part's forward, and its
    backward as a pullback (the executor's B: residuals kept from the forward).  :func:`balance` measures in
    rounds and keeps the costs (:mod:`jaxpipe.cuts.part_costs`)."""
    from .part_costs import measure_rounds, part_programs, to_costs

    return to_costs(measure_rounds(part_programs(model, microbatch)[0], 1, calls)[0])


def balance(
    model,
    num_stages: int,
    example,
    schedule: str = "1f1b",
    num_microbatches: Optional[int] = None,
    options: Optional[dict] = None,
    verbose: bool = True,
    cache_dir: Optional[str] = None,
    remeasure: bool = False,
):
    """``(model with the balanced cut, CutChoice)`` for a model of blocks (``block_fn``; stage parameters
    stacked per stage or, with a cut, per block), measured on ``example`` (one micro-batch) in rounds until
    the choice is stable, or read from the costs an earlier call kept in ``cache_dir``
    (:mod:`jaxpipe.cuts.part_costs`; ``remeasure=True`` measures again).  Prints the choice unless
    ``verbose=False``."""
    per_block_model = per_block(model)
    n = len(per_block_model.cut)
    from .part_costs import stable_costs

    choose = lambda c: balanced_cut(n, num_stages, c, schedule, num_microbatches, options).cut
    costs, agreement, source = stable_costs(per_block_model, example, choose, cache_dir, remeasure)
    choice = dataclasses.replace(
        balanced_cut(n, num_stages, costs, schedule, num_microbatches, options),
        agreement=agreement,
        source=source,
    )
    if verbose:
        print(f"jaxpipe: {choice}")
    return dataclasses.replace(per_block_model, cut=choice.cut, stage_fn=None), choice


def per_block(model):
    """``model`` (a model of blocks: ``block_fn``, stage parameters stacked per stage or, with a cut, per
    block) with one block a stage: what :func:`measure_parts` and :func:`recut` start from."""
    if model.block_fn is None:
        raise ConfigError(
            "a balanced cut moves blocks between stages: give the model as block_fn + blocks "
            "(PipelineModel(block_fn=..., stage_params=blocks, cut=...)) or use the Flax adapters"
        )
    blocks = (
        model.stage_params
        if model.cut is not None
        else jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), model.stage_params)
    )
    n = int(jax.tree.leaves(blocks)[0].shape[0])
    return dataclasses.replace(
        model, stage_params=blocks, cut=(1,) * n, stage_fn=None, context=bool(model.block_context), recut=None
    )


def recut(model, cut: Sequence[int]):
    """``model``'s blocks cut as ``cut`` says (one block count per model stage)."""
    return dataclasses.replace(per_block(model), cut=tuple(int(c) for c in cut), stage_fn=None)


def resolve_cut(cut, build, num_stages: int, n_blocks: int, options: Optional[dict]):
    """``cut`` as given (None, a list of block counts) or, for ``"balanced"``, the cut
    :func:`jaxpipe.cuts.balanced.balance` picks from the parts' measured costs on ``options["example"]`` (one
    micro-batch) for ``options.get("schedule", "1f1b")`` and ``options.get("options")`` (printed, with the
    even cut's prediction and how sure the choice is); the measured costs are kept per (model, backend) and
    read back by later calls (``options["cache_dir"]``, ``options["remeasure"]``:
    :mod:`jaxpipe.cuts.part_costs`).  ``options``: the model's ``balance={...}``; ``build(n)``: the model of
    ``n`` blocks."""
    if not isinstance(cut, str):
        return cut
    if cut != "balanced":
        try:
            hint = f" (as a list: cut={[int(c) for c in cut.split(',')]})"
        except ValueError:
            hint = ""
        raise ConfigError(
            f"cut={cut!r}: give a list of block counts per stage{hint}, or 'balanced' (with "
            f"balance={{'example': one_microbatch}})"
        )
    if not options or "example" not in options:
        raise ConfigError(
            "cut='balanced' measures one block, the embedding and the head on a micro-batch: give "
            "balance={'example': one_microbatch} (and optionally 'schedule', 'num_microbatches', "
            "'options', e.g. {'virtual': 3} for interleaved_1f1b)"
        )
    unknown = sorted(
        set(options) - {"example", "schedule", "num_microbatches", "options", "cache_dir", "remeasure"}
    )
    if unknown:
        raise ConfigError(
            f"balance={{...}} has unknown key(s) {unknown}: it takes 'example', 'schedule', "
            f"'num_microbatches', 'options', 'cache_dir' (where measured costs are kept; '' keeps "
            f"none) and 'remeasure'"
        )
    extra = {k: v for k, v in options.items() if k != "example"}
    return balance(build(n_blocks), num_stages, options["example"], **extra)[1].cut
