"""Cutting a model into stages, in one room.

* :mod:`.layout` -- a cut as data: the even cut, checks, padding a short stage's block slots and the stage
  that skips them, the cut split into chunks, a state recut to another cut;
* :mod:`.part_costs` -- what a block, the embedding and the head cost, measured on the running backend and
  kept per model and backend;
* :mod:`.balanced` -- the balanced cut: the cut whose predicted lockstep step is the least
  (``cut="balanced"``);
* :mod:`.configure` -- the configuration search's cut of each candidate (``jp.configure``).

The layers import downward only (layout <- part_costs <- balance <- configure).
"""

from .balanced import CutChoice, balance, balanced_cut, measure_parts, predict_cut, resolve_cut
from .layout import (
    blocks_layout,
    check_cut,
    even_cut,
    pad_blocks,
    recut_state,
    slot_index,
    split_cut,
    stage_of_blocks,
    unpad_blocks,
)
from .part_costs import PartCosts

__all__ = [
    "CutChoice",
    "PartCosts",
    "balance",
    "balanced_cut",
    "blocks_layout",
    "check_cut",
    "even_cut",
    "measure_parts",
    "pad_blocks",
    "predict_cut",
    "recut_state",
    "resolve_cut",
    "slot_index",
    "split_cut",
    "stage_of_blocks",
    "unpad_blocks",
]
