"""A user's own synchronous schedule: per-device action lists, or PyTorch's CSV format.

``torch.distributed.pipelining`` writes a schedule as one row per rank, one cell per step: ``0F1`` is the
forward of micro-batch 1 on stage 0, ``1I0`` / ``1W0`` a split backward's input and weight gradients, ``1B0``
a whole backward, ``(0F3;3B1)OVERLAP_F_B`` DualPipeV's overlapped forward and backward, a blank cell an idle
step (its ``_dump_csv`` / ``_load_csv``). :func:`from_actions` takes
the same cells (or ``(kind, micro-batch, stage)`` tuples, or :class:`~jaxpipe.schedules.Action`) per device,
:func:`from_csv` the file. The result is a :class:`~jaxpipe.schedules.Schedule` like a built-in one: validated
(a broken one names the action and the dependency it breaks), simulated, drawn, and run by ``jp.Pipeline``
exactly (the ``"custom"`` method: a flushing schedule, one update a step).

Model stages are spread over the devices as the actions say: device d holds every stage its actions compute,
each stage on one device, every device the same number (its chunks, in ascending stage order). A schedule
that splits some backwards (``I``/``W``) runs a whole ``B`` as its two halves, one after the other. Only
computation is read: PyTorch's communication actions (``SEND_F``, ``RECV_B``, ``UNSHARD``, ...) are skipped,
since jaxpipe's executor moves every message at the end of the tick that produced it.
"""

from __future__ import annotations

import csv
import io
import os
import re
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from .ir import B, F, W, Action, Schedule, ScheduleError

#: PyTorch's computation types -> jaxpipe's kinds (``I``, the input gradient, is a split backward's B)
TORCH_KINDS = {"F": F, "I": "I", "W": W, "B": "whole"}
#: PyTorch's communication and sharding actions: read and skipped
TORCH_COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD")
_CELL = re.compile(r"(\d+)(%s|F|I|W|B)(\d*)" % "|".join(TORCH_COMMS))
_NAMES = {F: "forward", B: "backward", W: "weight gradient"}
_LETTERS = {F: "F", B: "B", W: "W", "I": "I", "whole": "B"}

ActionLike = Union[str, Tuple[str, int, int], Action, None]


_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")


def _parse(cell: ActionLike, device: int, position: int) -> List[Tuple[str, int, int]]:
    """The ``(kind, stage, micro-batch)`` actions of one cell: none where idle or a communication action; two
    for PyTorch's overlapped forward-and-backward step (``(0F3;3B1)OVERLAP_F_B``: the two in turn)."""
    where = f"device {device}, position {position}"
    overlap = _OVERLAP.fullmatch(cell.strip()) if isinstance(cell, str) else None
    if overlap:
        return [action for part in overlap.group(1).split(";") for action in _parse(part, device, position)]
    if cell is None:
        return []
    if isinstance(cell, Action):
        return [(cell.kind, cell.stage, cell.mb)]
    if isinstance(cell, tuple) and len(cell) == 3:
        kind, mb, stage = cell
        if kind not in (F, B, W) or not all(isinstance(v, int) and v >= 0 for v in (mb, stage)):
            raise ScheduleError(
                f"{where}: {cell!r} is not an action: give (kind, micro-batch, stage) with kind 'F', 'B' or "
                f"'W' and non-negative integers"
            )
        return [(kind, stage, mb)]
    if not isinstance(cell, str):
        raise ScheduleError(f"{where}: {cell!r} is not an action (a string such as '0F1', a tuple, or None)")
    text = cell.strip()
    if not text or text.lower() == "none":
        return []
    match = _CELL.fullmatch(text)
    if match is None:
        raise ScheduleError(
            f"{where}: {text!r} is not an action: write stage, kind, micro-batch, as PyTorch does ('0F1', "
            f"'1I0', '1W0', '1B0'; a blank cell is idle)"
        )
    stage, kind, mb = match.groups()
    if kind in TORCH_COMMS:
        return []
    if mb == "":
        raise ScheduleError(f"{where}: {text!r} names no micro-batch (write e.g. '{stage}{kind}0')")
    return [(TORCH_KINDS[kind], int(stage), int(mb))]


def _label(kind: str, stage: int, mb: int) -> str:
    """An action as PyTorch writes it: stage, kind, micro-batch."""
    return f"{stage}{_LETTERS[kind]}{mb}"


def _chunks(rows: List[List[Tuple[str, int, int]]]) -> Tuple[dict, int, int]:
    """``({stage: (device, chunk)}, stages, chunks a device)``, refusing a layout SPMD cannot hold."""
    owner = {}
    for d, row in enumerate(rows):
        for kind, stage, mb in row:
            if owner.setdefault(stage, d) != d:
                raise ScheduleError(
                    f"stage {stage} runs on devices {owner[stage]} and {d} ({_label(kind, stage, mb)}); "
                    "each model stage lives on one device"
                )
    if not owner:
        raise ScheduleError("the schedule runs no action")
    stages = 1 + max(owner)
    missing = sorted(set(range(stages)) - set(owner))
    if missing:
        raise ScheduleError(f"stages {missing} appear in no action (the actions name stages 0..{stages - 1})")
    held = [sorted(s for s, d in owner.items() if d == device) for device in range(len(rows))]
    counts = {len(h) for h in held}
    if len(counts) != 1:
        raise ScheduleError(
            "every device must hold the same number of model stages (SPMD: one program, the same chunk "
            f"slots on each); these hold {[len(h) for h in held]}: {held}"
        )
    return {s: (d, h.index(s)) for d, h in enumerate(held) for s in h}, stages, counts.pop()


def _describe(key) -> str:
    """``0F1 (forward of micro-batch 1 on stage 0)`` for a ``(kind, stage, micro-batch)`` key."""
    kind, stage, mb = key
    return f"{_label(kind, stage, mb)} ({_NAMES[kind]} of micro-batch {mb} on stage {stage})"


def _check_order(schedule: Schedule) -> None:
    """Each device's actions in an order their inputs allow; a broken one names the action and the input."""
    position = {}
    for d, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            position[(a.kind, a.stage, a.mb)] = (d, i)
    for d, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            key = (a.kind, a.stage, a.mb)
            for dep in schedule.deps(a):
                if dep not in position:
                    raise ScheduleError(
                        f"{_describe(key)} on device {d} needs {_describe(dep)}, which no device runs"
                    )
                dd, di = position[dep]
                if dd == d and di > i:
                    raise ScheduleError(
                        f"device {d} runs {_describe(key)} at position {i}, before {_describe(dep)} at "
                        f"position {di}, which it needs"
                    )
    try:
        schedule.place()
    except ScheduleError:
        raise ScheduleError(_deadlock(schedule)) from None


def _deadlock(schedule: Schedule) -> str:
    """Which devices wait on which: the first action each stuck device cannot run and its missing input."""
    done, nxt = set(), [0] * schedule.D
    progressed = True
    while progressed:
        progressed = False
        for d, acts in enumerate(schedule.actions):
            while nxt[d] < len(acts) and all(dep in done for dep in schedule.deps(acts[nxt[d]])):
                a = acts[nxt[d]]
                done.add((a.kind, a.stage, a.mb))
                nxt[d] += 1
                progressed = True
    waits = []
    for d, acts in enumerate(schedule.actions):
        if nxt[d] < len(acts):
            a = acts[nxt[d]]
            dep = next(dep for dep in schedule.deps(a) if dep not in done)
            waits.append(
                f"device {d} waits at {_label(a.kind, a.stage, a.mb)} for {_label(dep[0], dep[1], dep[2])}"
            )
    return "the schedule deadlocks: " + "; ".join(waits) + " (reorder one device's actions)"


def from_actions(
    actions: Sequence[Iterable[ActionLike]],
    num_microbatches: Optional[int] = None,
    name: str = "custom",
) -> Schedule:
    """A user's own synchronous schedule from per-device action lists.

    Args:
        actions: one list per device of its actions in the order it runs them: PyTorch's cells (``"0F1"``:
            stage 0, forward, micro-batch 1; ``"1I0"`` / ``"1W0"``: a split backward's input and weight
            gradients; ``"1B0"``: a whole backward; ``"(0F3;3B1)OVERLAP_F_B"``: an overlapped forward and
            backward, run in turn; ``""`` or None: idle), ``(kind, micro-batch, stage)``
            tuples with kind ``"F"``, ``"B"`` or ``"W"``, or :class:`~jaxpipe.schedules.Action`.
        num_microbatches: M (default: one more than the largest micro-batch index).
        name: what the schedule is called in reports and pictures.

    Returns:
        The validated :class:`~jaxpipe.schedules.Schedule`; ``jp.Pipeline(model, schedule=it, ...)`` runs it.

    Raises:
        ScheduleError: a cell that is not an action; a stage on two devices, or devices holding different
            numbers of stages; an action missing, run twice, or before an input on its own device; a
            deadlock (naming what each device waits for).
    """
    rows = [[p for i, cell in enumerate(row) for p in _parse(cell, d, i)] for d, row in enumerate(actions)]
    if not rows:
        raise ScheduleError("from_actions needs one action list per device")
    where, stages, chunks = _chunks(rows)
    split = any(kind == W for row in rows for kind, _, _ in row)
    if not split:
        inputs = [(stage, mb) for row in rows for kind, stage, mb in row if kind == "I"]
        if inputs:
            stage, mb = inputs[0]
            raise ScheduleError(
                f"{stage}I{mb} computes an input gradient, but no action computes a weight gradient "
                f"({stage}W{mb}): write a whole backward as 'B', or give each 'I' its 'W'"
            )
    lists = []
    for row in rows:
        out = []
        for kind, stage, mb in row:
            chunk = where[stage][1]
            if kind == "whole":  # PyTorch's full backward: in a split schedule, its two halves in turn
                out.append(Action(B, mb, stage, chunk))
                if split:
                    out.append(Action(W, mb, stage, chunk))
            else:
                out.append(Action(B if kind == "I" else kind, mb, stage, chunk))
        lists.append(out)
    M = num_microbatches if num_microbatches is not None else 1 + max(m for row in rows for _, _, m in row)
    schedule = Schedule(
        name=name,
        num_devices=len(lists),
        num_microbatches=M,
        actions=lists,
        num_model_stages=stages,
        options={"chunks": chunks},
    )
    seen = {}
    for d, acts in enumerate(lists):
        for a in acts:
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                raise ScheduleError(
                    f"{_label(a.kind, a.stage, a.mb)} appears twice (device {seen[key]} and device {d})"
                )
            seen[key] = d
    _check_order(schedule)
    return schedule.validate()


def from_csv(source: str, num_microbatches: Optional[int] = None, name: Optional[str] = None) -> Schedule:
    """A schedule in PyTorch's CSV format: one row per rank, one cell per step (blank: idle).

    Args:
        source: a path to the file, or its text.
        num_microbatches: as for :func:`from_actions`.
        name: the schedule's name (default: the file's name without its extension, or ``"custom"``).

    Returns:
        The validated :class:`~jaxpipe.schedules.Schedule`.

    Raises:
        ScheduleError: as :func:`from_actions`.
        FileNotFoundError: ``source`` names a file (a path ending in ``.csv``, or one with a directory in it)
            that does not exist.
    """
    is_path = "\n" not in source and os.path.exists(source)
    if not is_path and "\n" not in source and (source.endswith(".csv") or os.sep in source):
        raise FileNotFoundError(
            f"from_csv({source!r}): no such file; give the path of a CSV file in PyTorch's format (one row "
            f"per device, cells such as 0F1, 1I0, 1W0, 1B0) or its text"
        )
    text = open(source).read() if is_path else source
    if name is None:
        name = os.path.splitext(os.path.basename(source))[0] if is_path else "custom"
    rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    return from_actions(rows, num_microbatches, name)


def to_csv(schedule: Schedule, path: Optional[str] = None) -> str:
    """A schedule in PyTorch's CSV format, one row per device in the order it runs its actions.

    Args:
        schedule: any schedule of F, B and W actions (a split backward's B written as ``I``).
        path: where to write it (None: not written).

    Returns:
        The CSV text.
    """
    letter = {F: "F", B: "I" if schedule.has_w() else "B", W: "W"}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for acts in schedule.actions:
        writer.writerow([f"{a.stage}{letter[a.kind]}{a.mb}" for a in acts])
    if path is not None:
        with open(path, "w") as f:
            f.write(out.getvalue())
    return out.getvalue()
