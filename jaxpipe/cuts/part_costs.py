"""The measured costs behind a balanced cut: in rounds until the choice is stable, and kept per (model,
backend).

Measuring a block, a padding slot, the embedding and the head compiles eight small programs and times each;
on a busy 2-core machine that took 30-45 s on every ``from_nnx(cut="balanced")`` call, and the chosen cut
moved from run to run (25% between runs).  So:

* :func:`measure_rounds` compiles the eight programs once and times them in rounds, each round calling every
  program in turn (a drift of the machine touches every part alike); each round gives one
  :class:`~jaxpipe.cuts.balanced.PartCosts`.
* :func:`stable_costs` measures three rounds, chooses the cut from the rounds' median costs and from each
  round's own costs, and adds rounds (up to seven) while a round disagrees; the choice says in how many rounds
  it was the best (``CutChoice.agreement``) -- how sure it is.
* The rounds are kept in a JSON file per key (:func:`cost_key`: the traced programs of the block, the
  embedding and the head on the example's shapes, the backend and its device kind, the JAX version and the
  measuring code's own hash), under ``$JAXPIPE_CACHE_DIR/cuts`` (default ``~/.cache/jaxpipe/cuts``).  A later
  call with the same key reads them: no measuring, and the same cut.  ``balance={"remeasure": True}`` measures
  again and replaces them; ``balance={"cache_dir": ""}`` keeps nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import jax

#: rounds measured first, and at most (added while a round's costs choose another cut)
FIRST_ROUNDS, MAX_ROUNDS = 3, 7


@dataclasses.dataclass(frozen=True)
class PartCosts:
    """Seconds for one micro-batch: a block's forward and backward, the embedding's (``pre``) and the
    head-plus-loss's (``post``)."""

    f_block: float
    b_block: float
    f_pre: float = 0.0
    b_pre: float = 0.0
    f_post: float = 0.0
    b_post: float = 0.0
    #: a skipped padding slot's forward and backward: no block compute, but its share of the stage scan's
    #: activation-sized buffers (BUILD_NOTES, "Cuts": on XLA CPU up to a real block's time)
    f_pad: float = 0.0
    b_pad: float = 0.0


def cache_dir(given: Optional[str] = None) -> str:
    """Where measured costs are kept: ``given``, else ``$JAXPIPE_CACHE_DIR/cuts``, else ~/.cache/jaxpipe/cuts
    ('' keeps nothing)."""
    if given is not None:
        return given
    root = os.environ.get("JAXPIPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxpipe"
    )
    return os.path.join(root, "cuts")


def part_programs(model, microbatch) -> Tuple[List[Tuple[str, Callable, tuple]], str]:
    """The eight timed programs -- (name, jitted function, arguments) for each part's forward and its
    forward-and-backward (the pullback: residuals kept from the forward) -- and their traced text (the key's
    part that says what is computed)."""
    import jax.numpy as jnp
    from .layout import pad_blocks, stage_of_blocks

    stage_p, pre_p, post_p = model.params
    if model.cut is not None:  # one block as a stage of one slot
        w = jax.tree.map(lambda a: a[0], pad_blocks(jax.tree.map(lambda a: a[:1], stage_p), (1,)))
    else:
        w = jax.tree.map(lambda a: a[0], stage_p)
    one = (
        dataclasses.replace(model, cut=None, stage_params=jax.tree.map(lambda a: a[None], w), recut=None)
        if model.cut is not None
        else model
    )
    ctx = one.example_context(microbatch)
    x = jax.jit(model.pre)(pre_p, microbatch)
    # a stage of one real block and one padding slot (cut (1, 2), stage 0), over the one-block stage
    two = stage_of_blocks(model.block_fn, (1, 2), bool(model.block_context)) if model.block_fn else None
    w2 = jax.tree.map(lambda a: jnp.concatenate([a, a]), w)
    ctx2 = (
        dataclasses.replace(ctx, stage=jnp.int32(0))
        if ctx is not None
        else one.stage_context(microbatch, None, 0)
    )
    parts = [
        ("block", lambda w_, x_: one.apply_stage(w_, x_, ctx), (w, x)),
        ("two", (lambda w_, x_: two(w_, x_, ctx2)) if two else None, (w2, x)),
        ("pre", lambda p: model.pre(p, microbatch), (pre_p,)),
        ("post", lambda p, x_: model.post_loss(p, x_, microbatch), (post_p, x)),
    ]
    programs, text = [], []
    for name, f, args in parts:
        if f is None:
            continue
        ct = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), jax.eval_shape(f, *args))
        programs.append((f"f_{name}", jax.jit(f), args))
        programs.append((f"fb_{name}", jax.jit(lambda *a, f=f, ct=ct: jax.vjp(f, *a)[1](ct)), args))
        text.append(str(jax.make_jaxpr(f)(*args)))
    return programs, "\n".join(text)


def _time(fn, args, calls: int) -> float:
    """The median of ``calls`` timed calls (seconds)."""
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


#: times a part's forward and forward-and-backward are timed again, side by side, where the pair came out with
#: the forward-and-backward no longer than the forward alone (a loaded machine's noise, not a cost)
RETIMES = 3


def measure_rounds(programs, rounds: int, calls: int = 7) -> List[dict]:
    """Each round: every program's median over ``calls`` calls (seconds), the programs taken in turn.

    A part whose forward-and-backward timed no longer than its forward is timed again (both programs, up to
    :data:`RETIMES` times): a backward's cost is their difference, and a busy machine can otherwise make it 0.
    """
    for _, fn, args in programs:  # compile and warm up, once
        jax.block_until_ready(fn(*args))
    by_name = {name: (fn, args) for name, fn, args in programs}
    out = []
    for _ in range(rounds):
        r = {name: _time(fn, args, calls) for name, fn, args in programs}
        for name in [n for n in r if n.startswith("f_") and "fb_" + n[2:] in r]:
            pair = (name, "fb_" + name[2:])
            for _ in range(RETIMES):
                if r[pair[1]] > r[pair[0]]:
                    break
                for key in pair:
                    r[key] = _time(*by_name[key], calls)
        out.append(r)
    return out


#: the least share of its forward a part's backward is taken to cost, where every timing said less
MIN_BACKWARD_SHARE = 0.25


def to_costs(r: dict):
    """A round's timings as :class:`~jaxpipe.cuts.balanced.PartCosts`.

    A backward is the forward-and-backward's time less the forward's, and at least :data:`MIN_BACKWARD_SHARE`
    of the forward: a backward is never free, and a difference of two noisy timings can say it is.
    """
    back = lambda p: max(r[f"fb_{p}"] - r[f"f_{p}"], MIN_BACKWARD_SHARE * r[f"f_{p}"])
    f_two, b_two = (r["f_two"], back("two")) if "f_two" in r else (r["f_block"], back("block"))
    return PartCosts(
        r["f_block"],
        back("block"),
        r["f_pre"],
        back("pre"),
        r["f_post"],
        back("post"),
        max(f_two - r["f_block"], 0.0),
        max(b_two - back("block"), 0.0),
    )


def median_round(rounds: Sequence[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def cost_key(traced: str) -> str:
    """What a cost depends on: the traced programs, the backend and its device kind, JAX's version and the
    measuring code (this module and :mod:`jaxpipe.cuts.balanced`)."""
    d = jax.devices()[0]
    here = os.path.dirname(os.path.abspath(__file__))
    code = "".join(open(os.path.join(here, f)).read() for f in ("part_costs.py", "balanced.py"))
    text = "\n".join([traced, d.platform, getattr(d, "device_kind", ""), jax.__version__, code])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


#: what every measured round holds (seconds per program: the parts' forwards and forward-and-backwards)
ROUND_KEYS = ("f_block", "fb_block", "f_pre", "fb_pre", "f_post", "fb_post")


def check_directory(directory: str) -> None:
    """A ConfigError, before anything is measured, where ``directory`` cannot hold the cut costs: a file, or a
    path under a file."""
    from ..errors import ConfigError

    if not directory:
        return
    from ..checks.values import file_in_the_way

    mine = os.path.abspath(directory)
    path = mine if os.path.isfile(mine) else file_in_the_way(mine)
    if path:
        raise ConfigError(
            f"the cut costs' cache {directory} {'is' if path == mine else 'lies under'} "
            f"a file ({path}), not a directory: set $JAXPIPE_CACHE_DIR (or balance={{'cache_dir': ...}}) "
            f"to a directory, or balance={{'cache_dir': ''}} to keep nothing"
        )


def _valid_rounds(rounds) -> bool:
    return (
        isinstance(rounds, list)
        and bool(rounds)
        and all(
            isinstance(r, dict)
            and all(k in r for k in ROUND_KEYS)
            and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and 0 <= v < float("inf")
                for v in r.values()
            )
            for r in rounds
        )
    )


def load(directory: str, key: str) -> Optional[List[dict]]:
    """The rounds kept for ``key``, or None.  A file that is not such a record (unreadable, not JSON, JSON of
    another shape: an interrupted copy, a hand edit) is set aside as ``.bad`` with a warning, and the costs
    are measured again."""
    if not directory:
        return None
    path = os.path.join(directory, f"{key}.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        _set_aside(path, f"cannot be read as JSON ({type(e).__name__})")
        return None
    rounds = data.get("rounds") if isinstance(data, dict) else None
    if not _valid_rounds(rounds):
        _set_aside(
            path, f"is not a record of measured rounds (each a table of {', '.join(ROUND_KEYS)} in seconds)"
        )
        return None
    return rounds


def _set_aside(path: str, why: str) -> None:
    from ..tune.measure_cache import set_aside

    set_aside(path, why)


def store(directory: str, key: str, rounds: List[dict]) -> Optional[str]:
    """The rounds in ``directory/key.json`` (written whole, then renamed: a reader never sees half a file)."""
    if not directory:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{key}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(
                {
                    "rounds": rounds,
                    "device": str(jax.devices()[0].device_kind),
                    "jax": jax.__version__,
                    "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                },
                fh,
                indent=1,
            )
        os.replace(tmp, path)
        return path
    except OSError:  # a read-only home: the choice stands, it is only not kept
        return None


def stable_costs(
    model, microbatch, choose: Callable, directory: Optional[str] = None, remeasure: bool = False
) -> Tuple[object, Tuple[int, int], str]:
    """``(median PartCosts, (rounds agreeing with the median's choice, rounds), source)`` -- ``choose(costs)``
    gives the cut a PartCosts picks; source is "measured" or the cache file read (module docstring)."""
    directory = cache_dir(directory)
    check_directory(directory)
    programs, traced = part_programs(model, microbatch)
    key = cost_key(traced)
    rounds = None if remeasure else load(directory, key)
    source = os.path.join(directory, f"{key}.json") if rounds else "measured"
    if rounds is None:
        rounds = measure_rounds(programs, FIRST_ROUNDS)
        while _agreement(rounds, choose)[0] < len(rounds) and len(rounds) < MAX_ROUNDS:
            rounds += measure_rounds(programs, 1)
        store(directory, key, rounds)
    return to_costs(median_round(rounds)), _agreement(rounds, choose), source


def _agreement(rounds: Sequence[dict], choose: Callable) -> Tuple[int, int]:
    """(rounds whose own costs choose what the median costs choose, rounds)."""
    best = choose(to_costs(median_round(rounds)))
    return sum(choose(to_costs(r)) == best for r in rounds), len(rounds)
