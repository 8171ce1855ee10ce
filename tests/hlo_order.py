"""Which collectives of a compiled XLA program no data dependency orders (test helper).

XLA's CPU runtime runs independent instructions of a program in whatever order its threads reach them, and
differently on each emulated device: two collectives that no data dependency orders -- a top-level all-reduce
and a loop whose body holds collective-permutes -- can deadlock, one device waiting in each (CI, WPipe on
stage x data x tensor).  This reads the optimised HLO text: the entry's instructions, their operands, and
which of them are collectives or hold collectives in the computations they call."""

import re
from typing import Dict, List, Set, Tuple

_COLLECTIVE = re.compile(
    r" (all-reduce|collective-permute|all-gather|reduce-scatter|all-to-all)(?:-start)?\("
)
_CALLED = re.compile(
    r"(?:branch_computations|body|condition|calls|true_computation|false_computation)="
    r"\{?(%?[\w.\-]+(?:, %[\w.\-]+)*)\}?"
)


def _computations(text: str) -> Tuple[Dict[str, List[str]], str]:
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[cur] = []
            entry = cur if line.startswith("ENTRY") else entry
        elif cur is not None and line.startswith("  "):
            comps[cur].append(line)
    return comps, entry


def _holds_collective(comps, name, memo) -> bool:
    if name not in memo:
        memo[name] = False
        memo[name] = any(
            _COLLECTIVE.search(l)
            or any(
                _holds_collective(comps, c.strip().lstrip("%"), memo)
                for m in _CALLED.finditer(l)
                for c in m.group(1).split(",")
            )
            for l in comps.get(name, [])
        )
    return memo[name]


def unordered_collectives(text: str) -> List[Tuple[str, str]]:
    """Pairs of top-level instructions of the entry computation, one a loop or conditional holding collectives
    and the other a collective or another such, that no chain of data dependencies orders.  (Two plain
    top-level collectives are not reported: the runtime has run such pairs -- the metrics' reductions --
    through every run of the suite without a hang; the hang came from a loop.)"""
    comps, entry = _computations(text)
    deps: Dict[str, Set[str]] = {}
    marked, holders, memo = [], set(), {}
    for line in comps[entry]:
        m = re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
        if not m:
            continue
        name, rest = m.groups()
        deps[name] = {o for o in re.findall(r"%([\w.\-]+)", rest) if o in deps}
        called = [c.strip().lstrip("%") for mm in _CALLED.finditer(rest) for c in mm.group(1).split(",")]
        if any(_holds_collective(comps, c, memo) for c in called):
            marked.append(name)
            holders.add(name)
        elif _COLLECTIVE.search(" " + rest.split(" ", 1)[-1]):
            marked.append(name)
    before: Dict[str, Set[str]] = {}
    for name in deps:  # HLO text lists operands before their users
        before[name] = set().union(*([{d} | before[d] for d in deps[name]] or [set()]))
    return [
        (a, b)
        for i, a in enumerate(marked)
        for b in marked[i + 1 :]
        if (a in holders or b in holders) and a not in before[b] and b not in before[a]
    ]


_INSTRUCTION = re.compile(r"\s+(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*\)|\S+) ([\w\-]+)\(([^)]*)\)(.*)$")


def _instructions(lines) -> Dict[str, Tuple[str, List[str], str]]:
    """``name -> (opcode, operand names, the rest of the line)`` of a computation's instructions."""
    out = {}
    for line in lines:
        m = _INSTRUCTION.match(re.sub(r"/\*.*?\*/", "", line))
        if m:
            name, op, operands, rest = m.groups()
            out[name] = (op, re.findall(r"%([\w.\-]+)", operands), rest)
    return out


def _passed_through(body_lines) -> Set[int]:
    """The tuple elements a loop body returns as it got them (``ROOT tuple(..., gte(param, k), ...)`` at
    ``k``): no instruction of the body writes them."""
    inst = _instructions(body_lines)
    root = next((l for l in body_lines if l.lstrip().startswith("ROOT ")), "")
    m = _INSTRUCTION.match(re.sub(r"/\*.*?\*/", "", root))
    if not m or m.group(2) != "tuple":
        return set()
    params = {n for n, (op, _, _) in inst.items() if op == "parameter"}
    out = set()
    for k, operand in enumerate(re.findall(r"%([\w.\-]+)", m.group(3))):
        op, args, rest = inst.get(operand, ("", [], ""))
        index = re.search(r"index=(\d+)", rest)
        if op == "get-tuple-element" and args and args[0] in params and index and int(index.group(1)) == k:
            out.add(k)
    return out


def orders_only_on_paper(text: str) -> List[Tuple[str, str]]:
    """``(loop, collective)`` pairs of the entry computation where the collective depends on the loop holding
    collectives only through tuple elements the loop passes through unchanged.  XLA's CPU runtime orders
    its instructions by the buffers they read and write, not by the program's data edges: a loop that never
    writes a value does not order what reads it after the loop, and the collective may start on one device
    while another still runs the loop (ZB-H1 on four devices: the loss's all-reduce beside the last loop's
    collective-permutes, a deadlock from a width of 192 on)."""
    comps, entry = _computations(text)
    inst = _instructions(comps[entry])
    memo: Dict[str, bool] = {}
    through = {}
    for name, (op, _, rest) in inst.items():
        body = re.search(r"body=%?([\w.\-]+)", rest)
        if op == "while" and body:
            through[name] = _passed_through(comps.get(body.group(1), []))
    loops = {  # the loops whose body or condition holds collectives
        n
        for n, (op, _, rest) in inst.items()
        if op == "while"
        and any(
            _holds_collective(comps, c.strip().lstrip("%"), memo)
            for mm in _CALLED.finditer(rest)
            for c in mm.group(1).split(",")
        )
    }
    memos: Dict[bool, Dict[str, Set[str]]] = {True: {}, False: {}}

    def loops_before(name, runtime: bool) -> Set[str]:
        """The loops ``name`` waits for: by the program's data edges, or (``runtime``) by the buffers the
        runtime sees -- a loop's passed-through element waits for whatever fed the loop that element."""
        known = memos[runtime]
        if name not in known:
            op, args, rest = inst.get(name, ("", [], ""))
            index = re.search(r"index=(\d+)", rest)
            if runtime and op == "get-tuple-element" and args and args[0] in through and index:
                k, loop = int(index.group(1)), args[0]
                fed = inst.get(inst[loop][1][0], ("", [], "")) if inst[loop][1] else ("", [], "")
                if k in through[loop] and fed[0] == "tuple" and k < len(fed[1]):
                    known[name] = loops_before(fed[1][k], runtime)
                    return known[name]
            known[name] = set().union(*(loops_before(a, runtime) for a in args if a in inst)) | (
                {name} if name in loops else set()
            )
        return known[name]

    pairs = []
    for name, (op, _, rest) in inst.items():
        if _COLLECTIVE.search(f" {op}(") or name in loops:
            late = loops_before(name, False) - loops_before(name, True) - {name}
            pairs += [(loop, name) for loop in sorted(late)]
    return pairs
