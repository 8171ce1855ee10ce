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
