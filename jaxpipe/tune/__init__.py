"""Step-time models and configuration search, measured on the running backend.

One model and one search serve users: :func:`jaxpipe.configure` (:mod:`.configure`) searches stage x data
splits, schedules, micro-batch counts and residual policies and predicts each with the executor's own lockstep
model (:mod:`.lockstep`: the lane plan ``Pipeline`` compiles, tick by tick, at op costs measured on this
backend) and :mod:`.memory`.  ``Pipeline`` itself measures one stage's op costs and a tick's exchange at
its first step (:mod:`.running_costs`, :class:`RunningCosts`) and places its plan for them.

The other pair reproduces a paper and stays for that: :mod:`.perf_model` is Chimera's step-time model (Li and
Hoefler, "Chimera: Efficiently Training Large-Scale Neural Networks with Bidirectional Pipelines", SC 2021,
§3.4, equation (1): critical-path forward and backward counts of an event-driven MPMD runtime, with the
all-reduce that does not overlap) and :mod:`.search` its enumeration of (W, D, B, N, schedule).  They differ
from ``configure`` in what they model: an MPMD runtime where each op starts when its inputs arrive, not the
lockstep ticks jaxpipe's SPMD program pays; no residual policies, cuts or model axes.  ``experiments.tune``
runs them against measured steps; ``configure`` does not use them.
"""

from .lockstep import LayerCosts, Link, calibrate_step, calibrate_tick, predict_devices, predict_one_core
from .perf_model import Costs, critical_path_counts, lockstep_profile, predict
from .running_costs import RunningCosts
from .search import Candidate, enumerate_candidates, memory_estimate

__all__ = [
    "Candidate",
    "Costs",
    "LayerCosts",
    "Link",
    "calibrate_step",
    "calibrate_tick",
    "critical_path_counts",
    "enumerate_candidates",
    "lockstep_profile",
    "memory_estimate",
    "predict",
    "predict_devices",
    "predict_one_core",
    "RunningCosts",
]
