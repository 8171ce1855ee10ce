"""Where a compiled step's time goes: a ``jax.profiler`` trace cut into operation categories.

:func:`trace_steps` records ``steps`` calls of a runner with ``jax.profiler`` (a Perfetto trace beside
the XPlane file); :func:`op_breakdown` reads the Perfetto trace back and sums each XLA operation's
*exclusive* time (its span minus the spans nested in it, per thread) into the categories of
:data:`CATEGORY_NAMES`, per step.  The numbers are thread time summed over XLA's worker threads: on
CPU-emulated devices every emulated device's operations run on one shared pool, so a category's share of the
pool's time -- and how it moves between a pipelined step and the plain step doing the same work -- is what the
profile says, not a per-device timeline.  On a GPU the same trace holds the device's kernels as well.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict

import jax

# first match wins; names are XLA's HLO instruction / thunk names as the CPU runtime records them
CATEGORIES = (
    (
        "collective",
        r"^(Rendezvous|ppermute|collective-permute|all-reduce|all-gather|reduce-scatter|all-to-all|"
        r"psum|pmean|pmax|collective)",
    ),
    ("pool wait", r"^Wait: pending_threads"),  # an op's parallel share waiting for pool threads
    ("control", r"^(conditional|while|call|ThunkExecutor::Execute$)"),
    ("matmul", r"(^ynn_fusion|^dot|dot_|convolution|gemm|cublas)"),
)
# a fusion is named after its operations ("select_dynamic-update-slice_fusion.7"): data movement when every
# one of them only moves or selects values, elementwise when any computes ("broadcast_multiply_fusion")
_MOVES = {
    "copy",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "bitcast",
    "bitcast-convert",
    "concatenate",
    "transpose",
    "broadcast",
    "pad",
    "gather",
    "scatter",
    "select",
    "reshape",
    "iota",
    "memcpy",
}
CATEGORY_NAMES = ("matmul", "elementwise", "data movement", "control", "collective", "pool wait")
_SKIP = re.compile(r"^(end: |ThreadpoolListener::|ThunkExecutor::Execute \(wait for completion\))")


def category(name: str) -> str:
    """The category of an operation named ``name`` in a trace: one of :data:`CATEGORIES`, 'data movement'
    or 'elementwise' (everything else: arithmetic fusions, the runtime's own small spans)."""
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    parts = {p for p in re.split(r"[_.]", name) if p and not p.isdigit()} - {"fusion", "wrapped"}
    return "data movement" if parts and parts <= _MOVES else "elementwise"


@dataclass
class Breakdown:
    """Per-step thread milliseconds by category (``ms``) and by operation (``ops``), how many times each
    category's (``calls``) and each operation's (``op_calls``) spans ran per step, and the step's wall
    time (``wall_ms``, median of the traced steps)."""

    ms: Dict[str, float]
    ops: Dict[str, float]
    calls: Dict[str, float]
    op_calls: Dict[str, float] = field(default_factory=dict)
    wall_ms: float = 0.0
    per_device: Dict[int, Dict[str, float]] = field(default_factory=dict)  # device ordinal -> ms by category

    def top(self, cat: str, n: int):
        """The ``n`` operations of category ``cat`` with the most thread time: ``(name, ms, calls)`` per
        step."""
        names = sorted((k for k in self.ops if category(k) == cat), key=lambda k: -self.ops[k])[:n]
        return [(k, self.ops[k], self.op_calls.get(k, 0.0)) for k in names]

    @property
    def total(self) -> float:
        return sum(self.ms.values())


def by_kind(b: Breakdown, n: int = 12):
    """The ``n`` operation kinds with the most thread time in ``b``: an operation's name less its numeric
    suffix (``dot.12`` and ``dot`` are the kind ``dot``), as ``(category, kind, ms per step, calls per
    step, ms a call)``, the most first: where two programs of the same model differ."""
    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for name, ms in b.ops.items():
        kind = re.sub(r"(\.(\d+|clone))+$", "", name)
        kinds[kind][0] += ms
        kinds[kind][1] += b.op_calls.get(name, 0.0)
    rows = sorted(kinds.items(), key=lambda kv: -kv[1][0])[:n]
    return [(category(k), k, ms, c, ms / c if c else 0.0) for k, (ms, c) in rows]


def _exclusive(events):
    """Each event's span minus the spans directly nested in it (events of one thread), and the device it
    ran for: its own ``device_ordinal`` argument, else the enclosing event's (-1: none)."""
    events.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []
    for e in events:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + 1e-6:
            stack.pop()
        e["_ex"] = e["dur"]
        own = (e.get("args") or {}).get("device_ordinal")
        e["_dev"] = int(own) if own is not None else (stack[-1]["_dev"] if stack else -1)
        if stack:
            stack[-1]["_ex"] -= e["dur"]
        stack.append(e)
    return events


def op_breakdown(trace_path: str, steps: int) -> Breakdown:
    """Read a Perfetto trace (``perfetto_trace.json.gz``) of ``steps`` steps into a :class:`Breakdown`.
    Only XLA's threads count (the Python thread and the client's wait-for-completion spans only wait for
    them)."""
    with gzip.open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    # the Python tracer's thread (its events are named "$file:line function") only waits for the others
    python = {(e.get("pid"), e.get("tid")) for e in spans if e["name"].startswith("$")}
    by_thread = collections.defaultdict(list)
    for e in spans:
        if (e.get("pid"), e.get("tid")) not in python:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    ms, ops, calls, op_calls = (collections.Counter() for _ in range(4))
    per_device = collections.defaultdict(collections.Counter)
    for evs in by_thread.values():
        for e in _exclusive(evs):
            if _SKIP.match(e["name"]):
                continue
            cat = category(e["name"])
            ms[cat] += e["_ex"] / 1e3 / steps
            ops[e["name"]] += e["_ex"] / 1e3 / steps
            calls[cat] += 1 / steps
            op_calls[e["name"]] += 1 / steps
            if e["_dev"] >= 0:
                per_device[e["_dev"]][cat] += e["_ex"] / 1e3 / steps
    return Breakdown(
        dict(ms),
        dict(ops),
        dict(calls),
        dict(op_calls),
        per_device={d: dict(c) for d, c in sorted(per_device.items())},
    )


def trace_steps(run: Callable[[], object], steps: int, log_dir: str, warmup: int = 2) -> Breakdown:
    """Run ``run`` ``warmup`` times, then trace ``steps`` calls under ``jax.profiler`` into ``log_dir``
    (a fresh sub-directory per call) and return their :class:`Breakdown`, with the median wall time."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    os.makedirs(log_dir, exist_ok=True)
    walls = []
    jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            walls.append(time.perf_counter() - t0)
    finally:
        jax.profiler.stop_trace()
    paths = sorted(
        glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime
    )
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no perfetto_trace.json.gz under {log_dir}")
    b = op_breakdown(paths[-1], steps)
    b.wall_ms = sorted(walls)[len(walls) // 2] * 1e3
    return b


def plot_breakdowns(rows, path: str, title: str = "") -> None:
    """A picture of traced steps: one horizontal bar per ``(label, Breakdown)`` row and per emulated device
    of it (a plain one-device step: one bar), stacked by category in exclusive milliseconds per step, with the
    step's wall time marked.  Written to ``path`` (PNG, SVG or PDF by its extension)."""
    import logging

    # matplotlib logs its font cache's first build at INFO ("font_manager: generating new fontManager"): a
    # stray line in a user's run (absl's handler prints INFO)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(CATEGORY_NAMES, ("#4477aa", "#66ccee", "#228833", "#ccbb44", "#ee6677", "#bbbbbb")))
    bars = []  # (label, ms by category, wall)
    for label, b in rows:
        devices = b.per_device or {0: b.ms}
        for d, ms in devices.items():
            bars.append((f"{label} · device {d}" if len(devices) > 1 else label, ms, b.wall_ms))
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(bars) + 1.4))
    for i, (label, ms, wall) in enumerate(bars):
        left = 0.0
        for cat in CATEGORY_NAMES:
            v = ms.get(cat, 0.0)
            ax.barh(i, v, left=left, color=colors[cat], label=cat if i == 0 else None)
            left += v
        if wall:
            ax.plot([wall, wall], [i - 0.4, i + 0.4], color="black", lw=1)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("exclusive ms per step (black tick: the step's wall time)")
    if title:
        ax.set_title(title, fontsize=9)
    fig.legend(ncol=len(CATEGORY_NAMES), fontsize=7, loc="lower center")
    fig.tight_layout(rect=(0, 0.6 / (0.32 * len(bars) + 1.4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
