"""Where a tick's ops come from: the stream's call table read for a device and a lane, chunk positions,
the versions a chunk's policy offers.  Functions of the executor's
:class:`~jaxpipe.runtime.program.Program` and :class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .common import full


# small readers shared by the lanes
def view(prog, tr, stack, c):
    return jax.tree.map(lambda a: a[c], stack)


def views(prog, tr, stack):
    return tuple(view(prog, tr, stack, c) for c in range(prog.K))


def zero_like(prog, tr, t):
    return jax.tree.map(jnp.zeros_like, t)


def blank(prog, tr):
    return full(prog.x_aval, jnp.nan if prog.nan_bubbles else 0)


def blank_tie(prog, tr):
    return full(prog.tie_avals, jnp.nan if prog.nan_bubbles else 0)


def x_like(prog, tr):
    return full(prog.x_aval, 0)


def slot_of(prog, tr, c, g):
    return tr.s_off[c] + g % tr.s_cap[c]


def stage_of(prog, tr, c):
    """The model stage of this device's chunk ``c``."""
    return jnp.asarray(prog.stg)[c, tr.me]


def is_first(prog, tr, c):
    return stage_of(prog, tr, c) == 0


def is_last(prog, tr, c):
    return stage_of(prog, tr, c) == prog.n_st - 1


def op_of(prog, tr, t, d, kind, r=None):
    """(runs, chunk, g): device ``d``'s op ``kind`` (0: F, 1: B) at tick ``t``, of micro-batch ``g``, on
    replica ``r`` (default: this one; it runs ``r * replica_delay`` ticks late)."""
    if prog.periodic.replica_delay:
        t = t - (tr.replica if r is None else r) * prog.periodic.replica_delay
    u, shift = tr.ctab[t % prog.T, d, kind, 0], tr.ctab[t % prog.T, d, kind, 1]
    q = t // prog.T - shift
    row = tr.unit_tab[jnp.maximum(u, 0)]
    g = (q + jnp.where(kind in (0, prog.KF2), row[1], row[2])) * prog.M + row[3]  # W: the B's micro-batch
    return (u >= 0) & (q >= 0) & (g >= 0) & (g < tr.n_fed), row[0], g


def position(prog, tr, c: int):
    """The position code of this device's chunk ``c``: 1 first (pre), 2 last (loss), 3 both."""
    return is_first(prog, tr, c).astype(jnp.int32) + 2 * is_last(prog, tr, c).astype(jnp.int32)


def pick(prog, tr, c, values):
    """``values[c]`` for a traced chunk index (scalars)."""
    out = values[0]
    for cc in range(1, prog.K):
        out = jnp.where(c == cc, values[cc], out)
    return out


def choices(prog, tr, g, lps, pss):
    """Per chunk: (version index, candidates) the policy chooses for micro-batch ``g`` on this device."""
    return [p.choose(lp, ps, tr.base + g, tr.me) for p, lp, ps in zip(prog.policies, lps, pss)]


def operands(prog, tr, ch, lps, pss):
    """The version switch's weight operands (``Program.grads``: each chunk's candidates, or a ring's
    stacks)."""
    return prog.grads.operands(prog, tr, ch, lps, pss)


def per_chunk(prog, tr, lps, pss):
    """The chunks' (weights, policy state) (``Program.grads``: as they are, or views of a ring's stacks)."""
    return prog.grads.per_chunk(prog, tr, lps, pss)


def candidate(prog, tr, cs, cc, w):
    return prog.grads.candidate(prog, tr, cs, cc, w)


def errors_of(prog, tr, c, g, runs, pss):
    """1 where the op would read a version its chunk's policy no longer holds."""
    ok = [
        p.held(ps, tr.base + g, tr.me) if p.held is not None else jnp.asarray(True)
        for p, ps in zip(prog.policies, pss)
    ]
    return (runs & ~pick(prog, tr, c, ok)).astype(jnp.int32)
