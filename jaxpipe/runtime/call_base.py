"""Where a tick's ops come from: the stream's call table read for a device and a lane, chunk positions,
the versions a chunk's policy offers.  Functions of the executor's
:class:`~jaxpipe.runtime.program.Program` and :class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .buffers import full


# small readers shared by the lanes
def view(prog, trace, stack, chunk):
    return jax.tree.map(lambda leaf: leaf[chunk], stack)


def views(prog, trace, stack):
    return tuple(view(prog, trace, stack, c) for c in range(prog.num_chunks))


def zero_like(prog, trace, tick):
    return jax.tree.map(jnp.zeros_like, tick)


def blank(prog, trace):
    return full(prog.x_aval, jnp.nan if prog.nan_bubbles else 0)


def blank_tie(prog, trace):
    return full(prog.tie_avals, jnp.nan if prog.nan_bubbles else 0)


def x_like(prog, trace):
    return full(prog.x_aval, 0)


def slot_of(prog, trace, chunk, mb_index):
    return trace.s_off[chunk] + mb_index % trace.s_cap[chunk]


def stage_of(prog, trace, chunk):
    """The model stage of this device's chunk ``c``."""
    return jnp.asarray(prog.stage_table)[chunk, trace.me]


def is_first(prog, trace, chunk):
    return stage_of(prog, trace, chunk) == 0


def is_last(prog, trace, chunk):
    return stage_of(prog, trace, chunk) == prog.num_stages - 1


def op_of(prog, trace, tick, d, kind, r=None):
    """(runs, chunk, g): device ``d``'s op in lane ``kind`` (an index into ``prog.kinds``) at tick ``t``, of
    micro-batch ``g``, on replica ``r`` (default: this one; it runs ``r * replica_delay`` ticks late)."""
    if prog.periodic.replica_delay:
        tick = tick - (trace.replica if r is None else r) * prog.periodic.replica_delay
    u, shift = trace.ctab[tick % prog.num_ticks, d, kind, 0], trace.ctab[tick % prog.num_ticks, d, kind, 1]
    q = tick // prog.num_ticks - shift
    row = trace.unit_tab[jnp.maximum(u, 0)]
    # an F lane reads the unit's F batch offset; B and W (the B's micro-batch) the B offset
    g = (q + jnp.where(prog.kinds[kind][0] == "F", row[1], row[2])) * prog.M + row[3]
    return (u >= 0) & (q >= 0) & (g >= 0) & (g < trace.n_fed), row[0], g


def position(prog, trace, chunk: int):
    """The position code of this device's chunk ``c``: 1 first (pre), 2 last (loss), 3 both."""
    return is_first(prog, trace, chunk).astype(jnp.int32) + 2 * is_last(prog, trace, chunk).astype(jnp.int32)


def pick(prog, trace, chunk, values):
    """``values[c]`` for a traced chunk index (scalars)."""
    out = values[0]
    for cc in range(1, prog.num_chunks):
        out = jnp.where(chunk == cc, values[cc], out)
    return out


def choices(prog, trace, mb_index, chunk_params, policy_states):
    """Per chunk: (version index, candidates) the policy chooses for micro-batch ``g`` on this device."""
    return [
        p.choose(params, pstate, trace.base + mb_index, trace.me)
        for p, params, pstate in zip(prog.policies, chunk_params, policy_states)
    ]


def operands(prog, trace, chunk, chunk_params, policy_states):
    """The version switch's weight operands (``Program.grads``: each chunk's candidates, or a ring's
    stacks)."""
    return prog.reduction.operands(prog, trace, chunk, chunk_params, policy_states)


def per_chunk(prog, trace, chunk_params, policy_states):
    """The chunks' (weights, policy state) (``Program.grads``: as they are, or views of a ring's stacks)."""
    return prog.reduction.per_chunk(prog, trace, chunk_params, policy_states)


def candidate(prog, trace, chunk_stack, chunk_choice, weights):
    return prog.reduction.candidate(prog, trace, chunk_stack, chunk_choice, weights)


def errors_of(prog, trace, chunk, mb_index, runs, policy_states):
    """1 where the op would read a version its chunk's policy no longer holds."""
    ok = [
        p.held(pstate, trace.base + mb_index, trace.me) if p.held is not None else jnp.asarray(True)
        for p, pstate in zip(prog.policies, policy_states)
    ]
    return (runs & ~pick(prog, trace, chunk, ok)).astype(jnp.int32)
