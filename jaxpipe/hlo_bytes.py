"""Bytes a compiled program moves per call, loops counted as often as they run.

XLA's ``compiled.cost_analysis()["bytes accessed"]`` counts a ``while`` loop's body **once**, whatever its
trip count, and a ``conditional`` as its dearest branch (``HloCostAnalysis::HandleWhile`` /
``HandleConditional``). Two programs doing the same work then compare by their *code*, not their traffic: the
plain step's accumulation is one loop body (one micro-batch) plus the update; 1F1B at D = 1 is one loop body
(one tick) plus the update; interleaved 1F1B at D = 1 has three phases -- a tick of forwards alone and a tick
of backwards alone, each run once and so inlined by XLA, and the steady phase's loop -- so XLA counts three
ticks where the others count one.  A ``1.66x`` figure read off XLA's count for interleaved 1F1B at D = 1 was
that.

:func:`account` reads the optimised HLO text (``compiled.as_text()``: the one place in jaxpipe that parses it)
and counts each instruction as ``HloCostAnalysis`` does for the instructions such programs hold -- an
instruction's operands and result, a fusion's operands and result, a dynamic slice the slice it reads twice
(read and written), a dynamic-update-slice its update twice, nothing for tuples, bitcasts, parameters and
constants -- and counts a ``while`` body ``known_trip_count`` times (XLA's own annotation), a conditional as
its dearest branch (as XLA does: an upper bound for a tick whose lanes branch).  Its ``static`` total (every
loop once) is checked against XLA's own figure by the tests; its ``per_call`` total is what the program
moves."""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Tuple

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s4": 1,
    "u4": 1,
}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_FREE = {
    "tuple",
    "get-tuple-element",
    "bitcast",
    "parameter",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
    "iota",
    "opt-barrier",
}


def _bytes(shape: str) -> int:
    """Bytes of every array in a shape string (a tuple's leaves summed)."""
    total = 0
    for dt, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _DTYPE_BYTES[dt]
    return total


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: List[str]
    attrs: str
    args: str = ""  # the text between the op's parentheses
    root: bool = False


def _split_operands(rest: str) -> Tuple[List[str], str, str]:
    """``(operand names, attributes, the text between the parentheses)`` from the text after ``op(``."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return re.findall(r"%([\w.\-]+)", rest[: i - 1]), rest[i:], rest[: i - 1]


def parse(text: str) -> Tuple[Dict[str, List[_Instr]], str, Dict[str, Dict[str, str]]]:
    """``(computations, entry name, shapes)``: each computation's instructions in order, and per computation
    the shape of every name (its parameters' and instructions')."""
    comps: Dict[str, List[_Instr]] = {}
    shapes: Dict[str, Dict[str, str]] = {}
    entry, cur = "", None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            cur = h.group(2)
            comps[cur], shapes[cur] = [], {}
            if h.group(1):
                entry = cur
            for pname, pshape in re.findall(
                r"([\w.\-]+):\s*((?:\([^)]*\))|[^,()]+\[[0-9,]*\](?:\{[0-9,]*\})?|[^,()]+)", h.group(3)
            ):
                shapes[cur][pname] = pshape
            continue
        if cur is None:
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if m:
            operands, attrs, args = _split_operands(m.group(5))
            ins = _Instr(m.group(2), m.group(3), m.group(4), operands, attrs, args, bool(m.group(1)))
            comps[cur].append(ins)
            shapes[cur][ins.name] = ins.shape
    return comps, entry, shapes


def _called(attrs: str, key: str) -> List[str]:
    m = re.search(key + r"=\{([^}]*)\}", attrs) or re.search(key + r"=%?([\w.\-]+)", attrs)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


def _trips(attrs: str) -> int:
    m = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', attrs)
    return int(m.group(1)) if m else 1


class _Counter:
    def __init__(self, text: str):
        self.comps, self.entry, self.shapes = parse(text)
        self.lines: List[Tuple[str, str, float, int]] = []  # (computation, instruction, bytes, times run)

    def instr(self, comp: str, ins: _Instr) -> int:
        """Bytes of one instruction, run once (its called computations apart)."""
        op = ins.op
        if op in _FREE or op in ("while", "conditional", "call"):
            return 0
        out = _bytes(ins.shape)
        if op == "dynamic-slice":
            return 2 * out
        if op == "dynamic-update-slice":
            upd = _bytes(self.shapes[comp].get(ins.operands[1], "")) if len(ins.operands) > 1 else 0
            return 2 * upd
        read = [_bytes(self.shapes[comp].get(o, "")) for o in ins.operands]
        if op == "fusion":
            read = self._fusion_reads(ins, read)
            out = self._fusion_writes(ins, out)
        return out + sum(read)

    def _fusion_writes(self, ins: _Instr, out: int) -> int:
        """A fusion whose result is a dynamic-update-slice of one of its parameters updates that buffer in
        place: it writes the update, not the buffer (and :meth:`_fusion_reads` does not count the buffer
        read)."""
        called = _called(ins.attrs, "calls")
        body = self.comps.get(called[0], []) if called else []
        root = next((i for i in body if i.root), None)
        params = {i.name for i in body if i.op == "parameter"}
        if (
            root is not None
            and root.op == "dynamic-update-slice"
            and root.operands[:1]
            and root.operands[0] in params
            and len(root.operands) > 1
        ):
            return _bytes(self.shapes[called[0]].get(root.operands[1], ""))
        return out

    def _fusion_reads(self, ins: _Instr, read: List[int]) -> List[int]:
        """A fusion's operand read only through (dynamic) slices inside it counts what those slices read (as
        XLA's operand utilisation does): a layer's weights sliced out of the stacked stage weights read one
        layer."""
        called = _called(ins.attrs, "calls")
        body = self.comps.get(called[0], []) if called else []
        out = list(read)
        for p in body:
            if p.op != "parameter" or not p.args.strip().isdigit() or int(p.args) >= len(out):
                continue
            users = [u for u in body if p.name in u.operands]
            sliced = [u for u in users if u.op in ("slice", "dynamic-slice") and u.operands[0] == p.name]
            updated = [
                u for u in users if u.root and u.op == "dynamic-update-slice" and u.operands[0] == p.name
            ]
            if users and len(sliced) + len(updated) == len(users):
                # read through its slices only; a buffer updated in place (the root's dynamic-update-slice,
                # a scatter-add into one slice as XLA fuses it) reads just the slices it adds to
                out[int(p.args)] = min(out[int(p.args)], sum(_bytes(u.shape) for u in sliced))
        return out

    def total(self, comp: str, weighted: bool, times: int = 1, record: bool = False) -> float:
        """Bytes of ``comp`` run once; loops run ``known_trip_count`` times if ``weighted`` (else once)."""
        s = 0.0
        for ins in self.comps.get(comp, []):
            b = self.instr(comp, ins)
            if b and record:
                self.lines.append((comp, ins.name + " " + ins.op, b, times))
            s += b
            if ins.op == "while":
                n = _trips(ins.attrs) if weighted else 1
                for key in ("body", "condition"):
                    for c in _called(ins.attrs, key):
                        s += n * self.total(c, weighted, times * n, record)
            elif ins.op == "conditional":
                branches = _called(ins.attrs, "branch_computations") or (
                    _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation")
                )
                costs = [(self.total(c, weighted), c) for c in branches]
                if costs:
                    best = max(costs)
                    if record:
                        self.total(best[1], weighted, times, record)
                    s += best[0]
            elif ins.op == "call":
                for c in _called(ins.attrs, "to_apply"):
                    s += self.total(c, weighted, times, record)
        return s


@dataclasses.dataclass(frozen=True)
class Account:
    """``static``: bytes with every loop body once (what XLA's ``bytes accessed`` counts); ``per_call``: loops
    counted as often as they run; ``loops``: ``(trip count, body bytes)`` per while loop of the entry;
    ``top``: the instructions moving the most bytes per call, ``(computation, instruction, bytes per
    call)``."""

    static: float
    per_call: float
    loops: Tuple[Tuple[int, float], ...]
    top: Tuple[Tuple[str, str, float], ...]


def account(text: str, top: int = 12) -> Account:
    """The byte account of an optimised HLO module's text (``compiled.as_text()``), module docstring."""
    c = _Counter(text)
    static = c.total(c.entry, weighted=False)
    per_call = c.total(c.entry, weighted=True, record=True)
    loops = []
    for ins in c.comps.get(c.entry, []):
        if ins.op == "while":
            loops.append((_trips(ins.attrs), sum(c.total(b, False) for b in _called(ins.attrs, "body"))))
    lines = sorted(((comp, name, b * n) for comp, name, b, n in c.lines), key=lambda r: -r[2])[:top]
    return Account(static, per_call, tuple(loops), tuple(lines))
