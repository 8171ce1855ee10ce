"""The asynchronous 1F1B family: PipeDream, PipeDream-2BW, SpecTrain, PipeOptim (PipeOptim §II-C2, §III).

All four run the same periodic no-flush 1F1B (PipeOptim Fig. 1(d)-(e); :func:`.periodic.no_flush_1f1b`):
stage ``s`` runs F of micro-batch ``i`` at tick ``2i + s`` and its B at ``2i + 2D - 1 - s``, so it holds
``D - s`` micro-batches and applies ``D - 1 - s`` updates between a micro-batch's F and its B.  They differ
in which weight version each op reads and when updates land (``jaxpipe.optim.policies``), and so in the
weight memory each stage holds, PipeOptim Table II (units of one stage's weights).  The IR shows one
step's micro-batches with fill and drain at the ticks the executor runs them; in training the pipeline
fills once and drains once (``Pipeline.drain``).
"""

from __future__ import annotations

from typing import Callable, List

from .ir import Schedule, ScheduleError
from .periodic import no_flush_1f1b, no_flush_lanes

#: the weight versions each method holds per stage (Table II) and whether its rule is per batch are part of
#: its declaration (:mod:`.registry`).  A per-batch rule (a batch reads version b - 1 in F and B, its update
#: lands after its last B) does not depend on the ticks, so it may run the lanes timeline
#: (:func:`.periodic.no_flush_lanes`: F + B per tick on every device instead of F and B ticks alternating
#: across devices), which keeps two versions iff M >= 2D - 2 (batch b + 2's first F after batch b's update).
TIMELINES = ("auto", "lanes", "alternating")


def timeline(name: str, D: int, M: int, choice: str = "auto", per_batch: bool = False) -> str:
    """``"lanes"`` or ``"alternating"`` (the 2-tick no-flush 1F1B) for method ``name``: ``"auto"`` takes lanes
    where the method's numbers allow them; asking for lanes where they do not is a ScheduleError."""
    if choice not in TIMELINES:
        raise ScheduleError(f"{name}: timeline={choice!r}; choose one of {TIMELINES}")
    ok = per_batch and M >= 2 * D - 2
    if choice == "lanes" and not ok:
        why = (
            f"needs num_microbatches >= 2D - 2 = {2 * D - 2} (got {M}) so that two weight versions suffice"
            if per_batch
            else "its weight rule follows the ticks (lanes would double the "
            "updates between a micro-batch's F and its B)"
        )
        raise ScheduleError(f"{name}: timeline='lanes' {why}; use timeline='alternating' or 'auto'")
    return "lanes" if ok and choice != "alternating" else "alternating"


def builder(name: str, versions: Callable[[int], List[int]], per_batch: bool = False):
    """The schedule builder of the no-flush method ``name`` holding ``versions(D)`` weight versions per
    stage."""

    def build(num_stages: int, num_microbatches: int, timeline_choice: str = "auto") -> Schedule:
        """One step's M micro-batches of the method's periodic no-flush timeline at the ticks the executor
        runs them (fill and drain included); ``.periodic`` is the steady-state pattern the executor reads."""
        D, M = num_stages, num_microbatches
        make = (
            no_flush_lanes if timeline(name, D, M, timeline_choice, per_batch) == "lanes" else no_flush_1f1b
        )
        return make(name, D).expand(M, versions(D))

    return build
