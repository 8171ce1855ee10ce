"""One stage's F, B, B-input and W as the executor runs them: residuals written to a stash and read back cold.

Timed back to back on the same data (what the search did before), a stage's residuals never leave the cache.
The executor writes each micro-batch's residuals into a stash slot (:class:`~jaxpipe.runtime.stage.StageOps`)
and its backward reads them ticks later, after other micro-batches' work went through the cache.  Measured on
one pinned core (GPT d 128, 2 blocks a stage): a stage stashing every residual of 8-sequence micro-batches
(20 MiB a slot) cost 16.2 + 26.3 ms a micro-batch through a stash against 6.1 + 20.6 back to back; with
4-sequence ones (10 MiB) both ways cost the same.  The two-process testbed's steps were 194 against 130 ms --
the order the back-to-back costs predicted the other way round.

Here one program writes ``slots`` micro-batches' residuals into a stash (F), then runs the backward of each
from its slot (B); under zero-bubble's split, B-input keeps each slot's frontier and W reads it, with the
executor's own split (:func:`jaxpipe.runtime.wsplit.split_backward`: W is priced as it runs, a recomputed
backward where the stage cannot be split); B is the whole backward as a flushing schedule runs it (where the
stage splits, the input part and then W's added into the gradient sums in place).  The op is a runtime
argument of a ``lax.switch`` (one compile; each branch runs the forwards first): F = t(F), B = t(F, B) - t(F),
B-input = t(F, B-input) - t(F), W = t(F, B-input, W) - t(F, B-input).  Seconds per micro-batch, the least of
``calls`` timed calls of each, taken in turns.
"""

from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
from jax import lax

from .microbench import time_branches


def _unit(t):
    """The next iteration's input: bounded, so no value drifts into denormals."""
    return jax.tree.map(lambda a: (a / (jnp.max(jnp.abs(a)) + 1.0)).astype(a.dtype), t)


def _slot(stash, i):
    return [lax.dynamic_index_in_dim(s, i, 0, keepdims=False) for s in stash]


def _put(stash, i, values):
    return [lax.dynamic_update_index_in_dim(s, v, i, 0) for s, v in zip(stash, values)]


def _whole_backward(sop, w, res, dy, avals, acc):
    """``(dx, acc + dw)`` as a flushing schedule's summing B runs it: where the stage scans its layers, the
    input part and then W's added into the sums in place (``runtime.lanes_backward.bwd``); else the fused
    backward."""
    from ..runtime.wsplit import split_backward

    sp = split_backward(sop.backward, w, res, dy, avals)
    if sp is not None and sp.in_place:
        dx, fr = sp.input_part(w, res, dy)
        return dx, sp.weight_part_into(w, res, dy, fr, acc, jnp.add)
    dw, dx = sop.backward(w, res, dy)
    return dx, jax.tree.map(jnp.add, acc, dw)


class _StashedStage:
    """One stage's ops over a stash of ``slots`` micro-batches, as the executor runs them (module docstring);
    :meth:`program` runs one of the four timed combinations, picked by a runtime index."""

    def __init__(self, model, w, x, mb, split: bool, slots: int):
        from ..runtime.stage import StageOps

        self.ops, self.avals = StageOps.build(model, w, x, mb)
        self.context = model.example_context(mb) if model.context else None
        self.split, self.slots = split, slots
        self.found = []  # whether each traced backward split (W priced as it runs, not recomputed)

    def _empty(self, avals):
        return [jnp.zeros((self.slots,) + tuple(a.shape), a.dtype) for a in avals]

    def forwards(self, w, x):
        """``(h, stash)``: ``slots`` forwards in a chain, each one's residuals written to its slot."""

        def body(i, carry):
            h, stash = carry
            y, res, _ = self.ops.forward(w, h, context=self.context)
            return _unit(jax.tree.map(lambda a, b: a.astype(b.dtype), y, h)), _put(stash, i, res)

        return lax.fori_loop(0, self.slots, body, (x, self._empty(self.avals)))

    def _split(self, w, res, dy):
        from ..runtime.wsplit import split_backward

        return split_backward(self.ops.backward, w, res, dy, self.avals) if self.split else None

    def backwards(self, w, stash, dy, part: str):
        """``(dx, weight sums, frontiers, split)``: each slot's backward, the whole one (``part="B"``) or its
        input part (``"B_input"``: each slot's frontier kept for W)."""

        def body(i, carry):
            d, acc, front = carry
            res = _slot(stash, i)
            if part == "B":
                dx, acc = _whole_backward(self.ops, w, res, d, self.avals, acc)
            else:
                sp = self._split(w, res, d)
                self.found.append(sp is not None)
                if sp is None:
                    dx = self.ops.backward(w, res, d)[1]  # the input gradient alone (the rest dead code)
                else:
                    dx, fr = sp.input_part(w, res, d)
                    front = _put(front, i, fr)
            return _unit(jax.tree.map(lambda a, b: a.astype(b.dtype), dx, d)), acc, front

        sp0 = self._split(w, [jnp.zeros(a.shape, a.dtype) for a in self.avals], dy)
        front = self._empty(sp0.frontier_avals if sp0 else [])
        d, acc, front = lax.fori_loop(0, self.slots, body, (dy, jax.tree.map(jnp.zeros_like, w), front))
        return d, acc, front, sp0

    def weights(self, w, stash, dy, front, sp):
        """The weight sums of every slot's W (where the stage did not split: the recomputed backward's)."""

        def body(i, acc):
            res = _slot(stash, i)
            if sp is not None:  # added into the sums in place, as the executor's W lane does
                return sp.weight_part_into(w, res, dy, _slot(front, i), acc, jnp.add)
            return jax.tree.map(jnp.add, acc, self.ops.backward(w, res, dy)[0])

        return lax.fori_loop(0, self.slots, body, jax.tree.map(jnp.zeros_like, w))

    def program(self, kind, w, x):
        """Branch ``kind`` of F; F, B; F, B-input; F, B-input, W -- a scalar of everything each computed, so
        none of it is dead code."""

        def only_f(w, x):
            h, stash = self.forwards(w, x)
            return _total(h, [s[:, :1] for s in stash])

        def f_b(part, and_w):
            def go(w, x):
                h, stash = self.forwards(w, x)
                d, acc, front, sp = self.backwards(w, stash, h, part)
                if and_w:
                    acc = self.weights(w, stash, h, front, sp)
                return _total(d, acc, [f[:, :1] for f in front])

            return go

        branches = [only_f, f_b("B", False), f_b("B_input", False), f_b("B_input", True)]
        return lax.switch(kind, branches, w, x)


def _total(*trees):
    return sum(jnp.sum(l.astype(jnp.float32)) for t in trees for l in jax.tree.leaves(t))


def stashed_stage_costs(
    model, w, x, mb, split: bool = True, slots: int = 4, calls: int = 7
) -> Dict[str, float]:
    """``{"F", "B", "B_input", "W", "splits"}`` of one stage of ``model`` (weights ``w``, input activation
    ``x``, micro-batch ``mb`` for a context model's stage context) with ``slots`` micro-batches in the stash
    (module docstring).  Without ``split``, B_input is half of B and W the other half (unused)."""
    stage = _StashedStage(model, w, x, mb, split, slots)
    t = time_branches(jax.jit(stage.program), 4 if split else 2, (w, x), calls, slots)
    out = {"F": t[0], "B": max(t[1] - t[0], 0.0)}
    if split:
        out["B_input"] = max(t[2] - t[0], 0.0)
        out["W"] = max(t[3] - t[2], 0.0)
        out["splits"] = bool(stage.found and all(stage.found))
    else:
        out["B_input"] = out["W"] = out["B"] / 2
        out["splits"] = False
    return out
