"""Pictures of a schedule: PNG timeline (devices as rows, like the papers' figures), text, Chrome trace.

``mode="event"`` draws the event-driven timeline with durations f, b, w; ``mode="lockstep"`` draws the
ticks the SPMD executor runs (each tick as wide as its slowest action).
"""

from __future__ import annotations

import json
from typing import Optional

from .ir import B, F, W, Schedule

_COLORS = {
    F: ["#4C8BF5", "#8FB8FF", "#2A5DB0", "#B9D3FF"],
    B: ["#34A853", "#8ED39E", "#1E7A38", "#C3EBCB"],
    W: ["#F4A340", "#FBD19A", "#B86E12", "#FDE6C6"],
}


def _boxes(s: Schedule, mode: str, f: float, b: float, w: float):
    """Yield (device, start, width, action)."""
    dur = {F: f, B: b, W: w}
    if mode == "event":
        p = s.place(f, b, w)
        for d, acts in enumerate(s.actions):
            for a in acts:
                k = (a.kind, a.stage, a.mb)
                yield d, p["start"][k], dur[a.kind], a
    elif mode == "lockstep":
        t0 = 0.0
        lanes = s.lanes() if s.has_pairs() else [[None] * s.D for _ in range(s.num_ticks)]
        for row, prow in zip(s.grid(), lanes):
            width = max(
                (
                    dur[a.kind] + (dur[F] if p is not None else 0.0)
                    for a, p in zip(row, prow)
                    if a is not None
                ),
                default=0.0,
            )
            for d, (a, p) in enumerate(zip(row, prow)):
                if a is not None:
                    yield d, t0, dur[a.kind], a
                if p is not None:
                    yield d, t0 + dur[a.kind], dur[F], p
            t0 += width
    elif mode in ("lanes", "ordered", "ordered2"):
        # what the executor runs: in every tick each device runs its lanes' actions one after the other, and
        # the tick lasts as long as its busiest device (the exchange follows): LanePlan.lockstep_makespan
        from .ir import kind_of
        from .lanes import plan

        p = plan(s, mode)
        ldur = [{F: f, B: b, W: w}[kind_of(lane)] for lane in p.lanes]
        t0 = 0.0
        for row in p.grid():
            width = 0.0
            for d in range(s.D):
                x = t0
                for li, a in enumerate(row[d]):
                    if a is not None:
                        yield d, x, ldur[li], a
                        x += ldur[li]
                width = max(width, x - t0)
            t0 += width
    else:
        raise ValueError(f"mode must be 'event', 'lockstep', 'lanes', 'ordered' or 'ordered2', got {mode!r}")


def render_png(
    s: Schedule,
    path: Optional[str] = None,
    f: float = 1.0,
    b: float = 2.0,
    w: Optional[float] = None,
    mode: str = "event",
    title: Optional[str] = None,
):
    """A timeline of ``s``, devices as rows, each op a box of its duration labelled with its micro-batch.

    Args:
        s: the schedule.
        path: where to write the PNG (None: not written).
        f: a forward's duration.
        b: a whole backward's; a split one is drawn as its input part and ``w``.
        w: the weight part of a split backward (default: the schedule's own split of ``b``).
        mode: ``"event"`` (each op as soon as its inputs arrive), ``"lockstep"`` (one op per device per tick),
            ``"lanes"``, ``"ordered"`` or ``"ordered2"`` (the executor's placements).
        title: the figure's title (default: the schedule, its total time and idle share).

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: an unknown ``mode``.
    """
    import logging

    # matplotlib logs its font cache's first build at INFO ("font_manager: generating new fontManager"): a
    # stray line in a user's run (absl's handler prints INFO)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .simulate import split_backward

    whole = b  # the whole backward; a split one is drawn as its B and W parts
    b, w = split_backward(s, whole, w)
    boxes = list(_boxes(s, mode, f, b, w))
    end = max(st + wd for _, st, wd, _ in boxes)
    fig, ax = plt.subplots(figsize=(max(6.0, min(28.0, 0.35 * end + 2)), 0.55 * s.D + 1.4))
    for d, st, wd, a in boxes:
        ax.add_patch(
            plt.Rectangle(
                (st, d - 0.42),
                wd,
                0.84,
                facecolor=_COLORS[a.kind][a.chunk % 4],
                edgecolor="black",
                linewidth=0.6,
            )
        )
        ax.text(st + wd / 2, d, str(a.mb), ha="center", va="center", fontsize=7 if s.M < 40 else 5)
    ax.set_xlim(0, end)
    ax.set_ylim(s.D - 0.5, -0.5)
    ax.set_yticks(range(s.D))
    ax.set_yticklabels([f"device {d}" for d in range(s.D)])
    ax.set_xlabel(_time_axis(s, mode, f, whole, b, w))
    span, bubble = _span_and_idle(s, mode, f, whole, b, w)
    ax.set_title(
        title or f"{s.name}  D={s.D}  M={s.M}  ({_MODE_WORDS[mode]}): total time {span:g}, idle {bubble:.1%}"
    )
    _legend(ax, s, 1 + max(a.chunk for _, _, _, a in boxes))
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=130)
        plt.close(fig)
    return fig


#: the title's words for each mode
_MODE_WORDS = {
    "event": "as soon as inputs arrive",
    "lockstep": "one op per tick",
    "lanes": "executor, lanes",
    "ordered": "executor, ordered",
    "ordered2": "executor, ordered2",
}


def _time_axis(s: Schedule, mode: str, f: float, whole: float, b: float, w: float) -> str:
    """The time axis's label: what a tick is in ``mode``, or the op durations of an event timeline."""
    return {
        "lockstep": "time (one op per device per tick; a tick lasts its slowest op)",
        "lanes": "time (each tick: a device's F then its B; a tick lasts as long as its busiest device)",
        "ordered": "time (the executor's ordered placement: lanes of one op per device per tick)",
        "ordered2": "time (the ordered order in ticks of two rounds of lanes: F, B, W, F', B', W')",
    }.get(
        mode,
        f"time (forward = {f:g}, backward = {whole:g}"
        + (f": input grad {b:g} + weight grad {w:g})" if s.has_w() else ")"),
    )


def _span_and_idle(s: Schedule, mode: str, f: float, whole: float, b: float, w: float):
    """``(total time, idle share)`` of ``s`` drawn in ``mode``."""
    r = s.simulate(f=f, b=whole, w=w if s.has_w() else None)
    if mode in ("ordered", "ordered2"):
        from .lanes import plan

        span = plan(s, mode).lockstep_makespan(f, b, w if s.has_w() else 0.0)
        return span, 1.0 - (r.makespan * (1.0 - r.bubble_ratio)) / span
    return {
        "lockstep": (r.lockstep_makespan, r.lockstep_bubble_ratio),
        "lanes": (r.lane_makespan, r.lane_bubble_ratio),
    }.get(mode, (r.makespan, r.bubble_ratio))


def _legend(ax, s: Schedule, nchunk: int) -> None:
    """One legend entry per (kind, chunk) drawn, in the colour it is drawn with, plus idle time."""
    from matplotlib.patches import Patch

    kinds = [F, B] + ([W] if s.has_w() else [])
    names = {F: "forward", B: "backward" if not s.has_w() else "backward (input grad)", W: "weight grad"}
    chunk_names = _chunk_names(s, nchunk)
    handles = [
        Patch(
            facecolor=_COLORS[k][c % 4],
            edgecolor="black",
            label=names[k] + (f", {chunk_names[c]}" if nchunk > 1 else ""),
        )
        for k in kinds
        for c in range(nchunk)
    ]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="idle"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=7,
        frameon=False,
        borderaxespad=0.0,
    )


def _chunk_names(s: Schedule, nchunk: int):
    """Legend words for a device's chunks: Chimera's pipelines, interleaved's virtual stages."""
    if "pipelines" in s.options:  # bidirectional pipelines (Chimera)
        p = s.options["pipelines"]
        f = p // 2
        return [
            (f"down pipeline {c}" if c < f else f"up pipeline {c - f}")
            if f > 1
            else ("down pipeline" if c == 0 else "up pipeline")
            for c in range(nchunk)
        ]
    return [f"chunk {c}" for c in range(nchunk)]


def render_text(s: Schedule, width: int = 0) -> str:
    """One row per device, one column per lockstep tick: ``F3`` forward of micro-batch 3 (``F3s5``: of model
    stage 5, where a device holds several), ``.`` idle; columns as wide as the widest label plus a space."""
    grid = s.grid()
    lanes = s.lanes() if s.has_pairs() else [[None] * s.D for _ in grid]
    lines = [f"{s.name} D={s.D} M={s.M} ({len(grid)} lockstep ticks)"]
    label = lambda a, p: (str(a) if a is not None else ".") + (f"+{p.mb}" if p is not None else "")
    width = width or 1 + max(
        (len(label(a, p)) for row, pr in zip(grid, lanes) for a, p in zip(row, pr)), default=1
    )
    for d in range(s.D):
        cells = [label(row[d], pr[d]).ljust(width) for row, pr in zip(grid, lanes)]
        lines.append(f"dev{d:<3d}" + "".join(cells).rstrip())
    return "\n".join(lines)


def chrome_trace(
    s: Schedule,
    path: Optional[str] = None,
    f: float = 1.0,
    b: float = 2.0,
    w: Optional[float] = None,
    mode: str = "event",
) -> dict:
    """Chrome/Perfetto trace-event JSON (open in ui.perfetto.dev or chrome://tracing); 1 time unit = 1 ms.
    ``b``: the whole backward; ``w``: a split backward's weight part (:func:`~.simulate.split_backward`)."""
    from .simulate import split_backward

    b, w = split_backward(s, b, w)
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"{s.name} D={s.D} M={s.M}"}}]
    for d in range(s.D):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": f"device {d}"}})
    for d, st, wd, a in _boxes(s, mode, f, b, w):
        events.append(
            {
                "name": f"{a.kind}{a.mb}",
                "cat": a.kind,
                "ph": "X",
                "pid": 0,
                "tid": d,
                "ts": st * 1000.0,
                "dur": wd * 1000.0,
                "args": {"microbatch": a.mb, "stage": a.stage, "chunk": a.chunk},
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path:
        with open(path, "w") as fh:
            json.dump(trace, fh)
    return trace
