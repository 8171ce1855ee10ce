"""The asynchronous 1F1B family: PipeDream, PipeDream-2BW, SpecTrain, PipeOptim (PipeOptim §II-C2, §III).

All four run the same no-flush 1F1B order (PipeOptim Fig. 1(d)-(e)): stage ``d`` runs ``D - d`` forwards,
then alternates one backward and one forward.  They differ in which weight version each op reads and when
updates land (``jaxpipe.optim.policies``), and so in the weight memory each stage holds, PipeOptim Table II
(units of one stage's weights).  The IR shows one step's micro-batches with fill and drain; in training
the pipeline fills once and drains once (``Pipeline.drain``).
"""
from __future__ import annotations

from typing import Callable, Dict, List

from .ir import Schedule
from .one_f_one_b import one_f_one_b_order

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
        D, M = num_stages, num_microbatches
        return Schedule(name, D, M, [one_f_one_b_order(d, D, M) for d in range(D)],
                        weight_versions=WEIGHT_VERSIONS[name](D))

    return build


ASYNC_BUILDERS = {name: builder(name) for name in WEIGHT_VERSIONS}
