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

from typing import Callable, Dict, List

from .ir import Schedule
from .periodic import no_flush_1f1b

#: weight versions held per stage (Table II): PipeDream [1, D] (stage s: D - s), PipeDream-2BW 2,
#: SpecTrain 2 (weights + momentum step), PipeOptim [1, 2] (the last stage predicts nothing)
WEIGHT_VERSIONS: Dict[str, Callable[[int], List[int]]] = {
    "pipedream": lambda D: [D - s for s in range(D)],
    "pipedream_2bw": lambda D: [2] * D,
    "spectrain": lambda D: [2] * D,
    "pipeoptim": lambda D: [2] * (D - 1) + [1],
    "cdp_v1": lambda D: [2] * D,          # Cyclic Data Parallelism, pipeline form: CDP-v1 is 2BW's rule
    "cdp_v2": lambda D: [2] * D,          # CDP-v2: fresher reads, the same two versions
}


def builder(name: str):
    def build(num_stages: int, num_microbatches: int) -> Schedule:
        """One step's M micro-batches of the periodic no-flush 1F1B at the ticks the executor runs them (fill
        and drain included); ``.periodic`` is the steady-state pattern the executor reads."""
        return no_flush_1f1b(name, num_stages).expand(num_microbatches, WEIGHT_VERSIONS[name](num_stages))

    return build


ASYNC_BUILDERS = {name: builder(name) for name in WEIGHT_VERSIONS}
