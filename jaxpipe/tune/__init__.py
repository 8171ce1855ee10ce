"""Performance model and configuration search (Chimera §3.4), measured on the running backend."""

from .lockstep import LayerCosts, Link, calibrate_step, calibrate_tick, predict_devices, predict_one_core
from .perf_model import Costs, critical_path_counts, lockstep_profile, predict
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
]
