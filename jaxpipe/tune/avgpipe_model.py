"""AvgPipe's profiling-based tuning of (M, N) (Xu et al., §5.2, equations 1-8).  Pure Python, no JAX.

Profile one setting ``(m, n)`` -- per device ``k``: computation time per batch ``T_gpu^k``, utilisation
``phi^k`` while computing (taken as constant over the computation: the integral in eq. 2 becomes
``T_gpu^k * max(phi^* - 1, 0)``), total communication time per batch ``TT^k``, model memory ``F_mod^k``
(parameters, optimizer state, reference) and data memory ``F_dat^k`` -- then predict any ``(m*, n*)``:

    (2) T_gpu*  = m* n / (m n*) (T_gpu + T_gpu max(m n* / (m* n) phi - 1, 0))
    (4) T_com*  = n* / (m* n) TT + (m* - 1) / m* max(n* / n TT - T_gpu*, 0)
    (6) T_up^k* = T_up^{k-1}* + ((TT^{k-1})* + T_gpu^{k-1}*) / m*,   T_up^1* = 0
    (7) T_down^k* = T_down^{k+1}* + ((TT^{k+1})* + T_gpu^{k+1}*) / m*,   T_down^K* = 0
    (1,5) T^k* = T_gpu^k* + T_com^k* + T_up^k* + T_down^k*      per batch; a step of N pipelines is N batches
    (8) F^k*    = n* / n F_mod + m n* / (m* n) F_dat

and choose the fastest setting whose predicted memory fits.

The paper co-locates the N pipelines on the same K GPUs.  jaxpipe puts them on the mesh's ``pipe`` axis, so
two flags say what is shared: ``shared_compute`` (the pipelines compete for the same compute: the paper's
GPUs, and CPU-emulated devices, which share the host's cores) keeps the ``n*/n`` in the utilisation of eq. 2;
``shared_memory`` (the paper's co-location) keeps the ``n*/n`` of eq. 8 -- on separate devices each holds one
replica's partition whatever N is, and eq. 8 becomes ``F_mod + m/m* F_dat``.  The paper predicts AFAB's time
(advance forward propagation makes 1F1B about as fast, §5.2.2).  jaxpipe adds one term the paper does not
have: the executor's cost per lockstep tick (``tick_overhead``, calibrated on the profiled run itself by
:func:`calibrate_tick_overhead`), which dominates small models on CPU-emulated devices; ``scale`` is an
alternative, purely multiplicative calibration.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple


@dataclasses.dataclass
class AvgPipeProfile:
    m: int  # micro-batches per batch in the profiled run
    n: int  # parallel pipelines in the profiled run
    t_gpu: Sequence[float]  # per device: computation time per batch (s)
    phi: Sequence[float]  # per device: utilisation while computing (1.0 = the device saturated)
    t_comm: Sequence[float]  # per device: total communication time per batch (s)
    f_mod: Sequence[float]  # per device: parameter / optimizer / reference bytes
    f_dat: Sequence[float]  # per device: activation and temporary bytes
    scale: float = 1.0  # measured / predicted step time on the profiled setting (1.0: none)
    tick_overhead: float = 0.0  # seconds per lockstep tick and pipeline (executor cost, calibrated)
    shared_compute: bool = True  # pipelines share the devices' compute (paper; CPU-emulated devices)
    shared_memory: bool = True  # pipelines share the devices' memory (paper); False on the 'pipe' axis

    @property
    def K(self) -> int:
        return len(self.t_gpu)


@dataclasses.dataclass
class AvgPipePrediction:
    m: int
    n: int
    per_batch: float  # max_k T^k* (s per batch)
    step: float  # one step of n* pipelines = n* batches (s), times ``scale``
    memory: float  # max_k F^k* (bytes per device)
    parts: Dict[str, List[float]]


def lockstep_ticks(m: int, K: int) -> int:
    """Ticks of one AFAB step in jaxpipe's lockstep executor: 2 (m + K - 1)."""
    return 2 * (m + K - 1)


def calibrate_tick_overhead(p: AvgPipeProfile, measured_step: float) -> float:
    """The executor's per-tick cost that makes the profiled setting's prediction equal its measurement
    (jaxpipe's addition: the paper's equations have no per-operation overhead; CPU-emulated devices pay
    milliseconds per tick).  Uses only the profiled run."""
    q = dataclasses.replace(p, scale=1.0, tick_overhead=0.0)
    raw = predict(q, p.m, p.n).step
    per = lockstep_ticks(p.m, p.K) * (p.n if p.shared_compute else 1)
    return max(measured_step - raw, 0.0) / per


def predict(p: AvgPipeProfile, m_star: int, n_star: int) -> AvgPipePrediction:
    m, n, K = p.m, p.n, p.K
    nn = n_star / n if p.shared_compute else 1.0
    r = m_star / (m * nn)
    t_gpu = [r * (t + t * max(ph / r - 1.0, 0.0)) for t, ph in zip(p.t_gpu, p.phi)]  # (2)
    tt = [n_star / n * c for c in p.t_comm]  # (TT^k)*
    t_com = [c / m_star + (m_star - 1) / m_star * max(c - g, 0.0) for c, g in zip(tt, t_gpu)]  # (4)
    up = [0.0] * K
    for k in range(1, K):
        up[k] = up[k - 1] + (tt[k - 1] + t_gpu[k - 1]) / m_star  # (6)
    down = [0.0] * K
    for k in range(K - 2, -1, -1):
        down[k] = down[k + 1] + (tt[k + 1] + t_gpu[k + 1]) / m_star  # (7)
    total = [g + c + u + d for g, c, u, d in zip(t_gpu, t_com, up, down)]  # (1), (5)
    nm = n_star / n if p.shared_memory else 1.0
    mem = [nm * fm + (m * nm) / m_star * fd for fm, fd in zip(p.f_mod, p.f_dat)]  # (8)
    per_batch = max(total)
    # a step trains n* batches: in turn on shared compute (T is per batch, eq. 2's n/n*), at once otherwise
    step = per_batch * (n_star if p.shared_compute else 1) * p.scale
    step += p.tick_overhead * lockstep_ticks(m_star, K) * (n_star if p.shared_compute else 1)
    return AvgPipePrediction(
        m_star,
        n_star,
        per_batch,
        step,
        max(mem),
        {"t_gpu": t_gpu, "t_com": t_com, "t_up": up, "t_down": down, "total": total, "memory": mem},
    )


def choose(
    p: AvgPipeProfile,
    settings: Iterable[Tuple[int, int]],
    memory_limit: Optional[float] = None,
    batch_per_pipe: int = 1,
) -> Tuple[Optional[AvgPipePrediction], List[AvgPipePrediction]]:
    """Every setting's prediction, and the one with the highest predicted throughput (samples per second:
    ``n* batch / step``) whose predicted memory fits ``memory_limit`` (None: no limit)."""
    preds = [predict(p, m, n) for m, n in settings]
    fits = [q for q in preds if memory_limit is None or q.memory <= memory_limit]
    best = max(fits, key=lambda q: q.n * batch_per_pipe / q.step, default=None)
    return best, preds
