"""What a synchronous schedule's lane plan costs on D real devices, and what it costs on one core (no JAX).

The executor runs a lane plan (:mod:`jaxpipe.schedules.lanes`, the placement ``Pipeline`` runs: ``"auto"``
picks the faster) in lockstep: every tick runs the lanes its phase compiles (F, B, W; F2 where Chimera pairs
forwards) one after the other on each device, and the tick's messages move in one exchange at its end.  On D
real devices a tick lasts as long as its slowest device's own actions in it (an idle device waits), plus the
executor's fixed cost of a compiled lane and the messages:

    T_devices = sum over ticks [ max_d sum over lanes op(d, lane) ] + tick * compiled lane-ticks
                + ppermutes * (alpha + beta * act_bytes) + layout exchange (Chimera: a replica's weights
                fetched and its gradient sent home)

On one core nothing runs side by side, so the same plan costs the *sum* of every device's work -- what the
one-core benchmark (``experiments.executor_cost --cores=1``) measures and what this model is checked against:

    T_core = sum over devices and ops of op(d) + D * tick * lane-ticks + messages copied on the core

``op`` is one micro-batch through one stage: layers per stage x the per-layer cost measured on one device
(:func:`jaxpipe.tune.microbench.layer_costs`): F, the whole backward B, and for the zero-bubble schedules
their B (input gradient) and W (weight gradient) apart.  ``tick`` -- the executor's own cost of one device's
compiled lane in one tick (slot reads and writes, the conditionals) -- is the one calibrated number
(:func:`calibrate_tick`, from one schedule's one-core measurement).  ``placement`` (every function): the plan
to cost, default ``"auto"`` as ``Pipeline``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Sequence, Tuple

import numpy as np

from ..schedules.ir import Schedule
from ..schedules.ir import kind_of
from ..schedules.lanes import L, fastest_placement


def running_plan(s: Schedule, placement: str = "auto"):
    """The lane plan the executor runs for ``placement`` (``"auto"``: the faster of the two)."""
    return s.plan(fastest_placement(s) if placement == "auto" else placement)


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """Seconds for one micro-batch through one layer on one device.

    Attributes:
        f: the forward.
        b: the whole backward.
        b_input: a split backward's input-gradient part (zero-bubble's B).
        w: a split backward's weight-gradient part (zero-bubble's W).
    """

    f: float
    b: float
    b_input: float
    w: float

    def scaled(self, k: float) -> "LayerCosts":
        """The same costs times a factor (layers per stage).

        Args:
            k: the factor.

        Returns:
            A new :class:`LayerCosts`.
        """
        return LayerCosts(self.f * k, self.b * k, self.b_input * k, self.w * k)

    def op(self, kind: str, split: bool) -> float:
        """One op's cost.

        Args:
            kind: a lane: ``"F"``, ``"F2"`` (two paired forwards), ``"B"`` or ``"W"`` (``"F'"``, ``"B'"``,
                ``"W'"``: a second lane of the kind, one op).
            split: whether the backward is split (B is then the input gradient only).

        Returns:
            Seconds.
        """
        if kind == "F2":
            return 2 * self.f
        return {"F": self.f, "B": self.b_input if split else self.b, "W": self.w}[kind_of(kind)]


@dataclasses.dataclass(frozen=True)
class Link:
    """What one ``ppermute`` costs: ``alpha + beta * n`` seconds for ``n`` bytes (every device sending at
    once), or the linear interpolation of measured points.

    Over a real link the cost per byte is not one number: two processes over Gloo moved 4 MiB at 1.5 GB/s and
    16 MiB at 1.3 GB/s, so a line through a small and a 4 MiB message priced Chimera's 16 MiB replica 40% low.

    Attributes:
        alpha: the latency, seconds.
        beta: seconds per byte.
        table: measured ``(bytes, seconds)`` points; where given, interpolated (beyond the last point, its
            last segment's slope).
    """

    alpha: float
    beta: float
    table: Tuple[Tuple[float, float], ...] = ()

    def __call__(self, nbytes: float) -> float:
        if len(self.table) < 2:
            return self.alpha + self.beta * nbytes
        xs, ys = zip(*sorted(self.table))
        if nbytes >= xs[-1]:
            return ys[-1] + (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-30) * (nbytes - xs[-1])
        return float(np.interp(nbytes, xs, ys))


@dataclasses.dataclass(frozen=True)
class EdgeCosts:
    """Seconds for one micro-batch of what only the first and the last model stage run: the embedding's
    (``pre``) forward and backward, the head-and-loss's (``post``).  A head of a large vocabulary costs
    several blocks: its stage is the slowest device of every tick it runs in.  Zero-bubble's split backward
    puts the head's backward in B and the embedding's weight gradient in W (as
    :mod:`jaxpipe.cuts.balanced`)."""

    f_pre: float = 0.0
    b_pre: float = 0.0
    f_post: float = 0.0
    b_post: float = 0.0

    def table(self, n_stages: int, lanes: Sequence[str], split: bool) -> np.ndarray:
        """``[model stage, lane]`` seconds each op adds."""
        out = np.zeros((n_stages, len(lanes)))
        for j, k in enumerate(lanes):
            if kind_of(k) == "F":
                n = 2.0 if k == "F2" else 1.0
                out[0, j] += n * self.f_pre
                out[-1, j] += n * self.f_post
            elif kind_of(k) == "B":
                out[-1, j] += self.b_post
                out[0, j] += 0.0 if split else self.b_pre
            elif kind_of(k) == "W":
                out[0, j] += self.b_pre
        return out


def _lane_ops(
    s: Schedule, layers_per_stage: float, costs: LayerCosts, placement: str = "auto", edges: EdgeCosts = None
) -> np.ndarray:
    """``[tick, device, lane]`` seconds of each planned op (0 where a device is idle in the lane)."""
    p = running_plan(s, placement)
    split = s.has_w()
    per_kind = np.array([costs.op(k, split) * layers_per_stage for k in p.lanes])
    active = p.table[..., L["op"]] > 0
    ops = active * per_kind[None, None, :]
    if edges is not None:
        extra = edges.table(s.num_model_stages, p.lanes, split)
        stage = np.where(active, p.table[..., L["stage"]], 0)
        ops = ops + np.where(active, extra[stage, np.arange(len(p.lanes))[None, None, :]], 0.0)
    return ops


def _compiled_lane_ticks(s: Schedule, placement: str = "auto") -> np.ndarray:
    """``[tick, lane]``: 1 where the tick's phase compiles the lane (a lane outside its phase costs
    nothing)."""
    p = running_plan(s, placement)
    out = np.zeros((p.num_ticks, len(p.lanes)))
    for t0, t1, lanes in p.phases:
        out[t0:t1, list(lanes)] = 1
    return out


def _messages(s: Schedule, placement: str = "auto") -> np.ndarray:
    """``[tick, lane]`` ppermutes of the tick's exchange: each compiled lane's channels, a channel the plan
    shares (:attr:`~jaxpipe.schedules.lanes.LanePlan.shared`: one message per device and tick) counted once,
    on the first lane posting on it."""
    p = running_plan(s, placement)
    compiled = _compiled_lane_ticks(s, placement)
    out = np.zeros_like(compiled)
    for t in range(compiled.shape[0]):
        seen = set()
        for li, chans in enumerate(p.channels):
            if compiled[t, li]:
                out[t, li] = sum(1 for ch in chans if ch not in seen)
                seen |= {ch for ch in chans if ch in p.shared}
    return out


def layout_bytes(s: Schedule, stage_bytes: float) -> float:
    """Bytes each device moves per step outside the ticks: Chimera's replica of another device's stage,
    fetched at the step's start and its gradient sent home at its end (the executor's identity layout)."""
    soc = s.stage_of_chunk()
    moved = sum(
        1
        for c in range(soc.shape[1])
        if s.num_model_stages == s.D and any(int(soc[d, c]) != d for d in range(s.D))
    )
    return 2.0 * moved * stage_bytes


def predict_devices(
    s: Schedule,
    costs: LayerCosts,
    layers_per_stage: float,
    tick: float,
    link: Link,
    act_bytes: float,
    stage_bytes: float,
    placement: str = "auto",
    scale: float = 1.0,
    fixed: float = 0.0,
    edges: EdgeCosts = None,
    rendezvous: float = 0.0,
) -> Dict[str, float]:
    """The step's seconds on ``s.D`` real devices (module docstring), and its parts.

    Args:
        s: the schedule.
        costs: one layer's :class:`LayerCosts`.
        layers_per_stage: layers on a model stage.
        tick: the executor's fixed cost of one compiled lane in one tick.
        link: the :class:`Link` between neighbours.
        act_bytes: one micro-batch's activation message.
        stage_bytes: one stage's weights (Chimera's layout exchange).
        placement: the plan to cost (``"auto"`` as ``Pipeline``'s).
        scale: the ops' measured costs are multiplied by it (:func:`calibrate_step`).
        fixed: seconds a step adds beyond its ticks (:func:`calibrate_step`).
        edges: the embedding's and the head's costs, on the first and last model stage's ops.
        rendezvous: seconds a tick's exchange adds beyond its messages' bytes, once per tick: the wait for
            the slower device and the link's wake-up (a tick's measured price,
            :class:`~jaxpipe.tune.running_costs.RunningCosts`, less one message's ``link`` cost).

    Returns:
        ``{"step", "compute", "busy", "fixed", "messages", "layout", "lane_ticks", "ticks", "ppermutes",
        "rendezvous"}``.
    """
    ops = _lane_ops(s, layers_per_stage, costs, placement, edges)
    lanes = _compiled_lane_ticks(s, placement)
    compute = float(ops.sum(axis=2).max(axis=1).sum())  # per tick: the slowest device's own actions
    busy = float(ops.sum() / s.D)  # one device's share of the work, the bubble-free bound
    lane_fixed = float(lanes.sum() * tick)
    msgs = float(_messages(s, placement).sum() * link(act_bytes))
    n_layout = layout_bytes(s, stage_bytes)
    layout = link(n_layout / 2) * 2 if n_layout else 0.0
    meet = float(rendezvous * lanes.shape[0])
    return {
        "step": scale * compute + lane_fixed + msgs + layout + fixed + meet,
        "compute": scale * compute,
        "busy": scale * busy,
        "fixed": lane_fixed + fixed,
        "messages": msgs,
        "layout": layout,
        "lane_ticks": float(lanes.sum()),
        "ticks": float(lanes.shape[0]),
        "ppermutes": float(_messages(s, placement).sum()),
        "rendezvous": meet,
    }


def predict_one_core(
    s: Schedule,
    costs: LayerCosts,
    layers_per_stage: float,
    tick: float,
    copy: Link,
    act_bytes: float,
    stage_bytes: float,
    placement: str = "auto",
) -> Dict[str, float]:
    """The step's seconds with every device's work on one core (module docstring).

    Args:
        s: the schedule.
        costs: one layer's :class:`LayerCosts`.
        layers_per_stage: layers on a model stage.
        tick: the executor's fixed cost of one compiled lane in one tick, per device.
        copy: one ``ppermute`` over the D emulated devices (D copies), as measured on that core.
        act_bytes: one micro-batch's activation message.
        stage_bytes: one stage's weights.
        placement: the plan to cost.

    Returns:
        ``{"step", "work", "fixed", "messages", "layout"}``.
    """
    work = float(_lane_ops(s, layers_per_stage, costs, placement).sum())
    lanes = _compiled_lane_ticks(s, placement)
    fixed = float(lanes.sum() * s.D * tick)
    msgs = float(_messages(s, placement).sum() * copy(act_bytes))
    n_layout = layout_bytes(s, stage_bytes)
    layout = 2 * copy(n_layout / 2) if n_layout else 0.0
    return {
        "step": work + fixed + msgs + layout,
        "work": work,
        "fixed": fixed,
        "messages": msgs,
        "layout": layout,
    }


def calibrate_tick(
    s: Schedule,
    costs: LayerCosts,
    layers_per_stage: float,
    copy: Link,
    act_bytes: float,
    stage_bytes: float,
    measured: float,
    baseline: float = 0.0,
    placement: str = "auto",
) -> float:
    """The per-device, per-lane-tick cost that makes :func:`predict_one_core` of ``s`` equal a measurement
    (clipped at 0).

    Args:
        s: the measured schedule.
        costs: one layer's :class:`LayerCosts`.
        layers_per_stage: layers on a model stage.
        copy: the one-core ``ppermute`` :class:`Link`.
        act_bytes: one micro-batch's activation message.
        stage_bytes: one stage's weights.
        measured: the measured step, seconds.
        baseline: what the measurement holds besides the plan (the plain step's own fixed cost).
        placement: the plan measured.

    Returns:
        Seconds per device and lane-tick.
    """
    rest = predict_one_core(s, costs, layers_per_stage, 0.0, copy, act_bytes, stage_bytes, placement)
    lane_ticks = float(_compiled_lane_ticks(s, placement).sum())
    return max((measured - baseline - rest["step"]) / (lane_ticks * s.D), 0.0)


def calibrate_step(
    parts: Sequence[Dict[str, float]], measured: Sequence[float], fit_scale: bool = False
) -> Tuple[float, float]:
    """``(scale, fixed)`` such that ``scale * compute + fixed + the rest`` of each run's parts meets its
    measured seconds.

    ``fixed`` is a step's own cost beyond its ticks (the update, the call's start on every process), the mean
    over the runs.  Measured on the two-process testbed the fitted scale moved by 10% between runs, so by
    default ``scale`` stays 1.

    Args:
        parts: :func:`predict_devices` of each run, predicted with ``scale=1, fixed=0``.
        measured: each run's measured seconds.
        fit_scale: fit ``scale`` too (least squares, kept within [0.5, 2]), from runs at two or more
            micro-batch counts: op costs derived from a plain step carry that step's own fixed cost.

    Returns:
        ``(scale, fixed)``.
    """
    compute = np.array([p["compute"] for p in parts])
    rest = np.array([p["step"] - p["compute"] for p in parts])
    y = np.asarray(measured, float) - rest
    k = 1.0
    if fit_scale and len(parts) > 1 and np.ptp(compute) > 1e-12:
        k = float(np.clip(np.polyfit(compute, y, 1)[0], 0.5, 2.0))
    return k, float(np.mean(y - k * compute))


def fastest(predictions: Dict[str, float]) -> Sequence:
    """``[(name, seconds, x the fastest)]`` sorted fastest first."""
    best = min(predictions.values())
    return [(k, v, v / best) for k, v in sorted(predictions.items(), key=lambda kv: kv[1])]
