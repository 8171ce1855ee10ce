"""Zero-bubble's B/W split without recomputation (ZB-H1, Qi et al. 2024, §2: B computes the input gradient,
W the weight gradient "from the stored output gradients of each layer").

A stage's backward ``bwd(w, res, dy) -> (dw, dx)`` is one jaxpr.  The equations ``dx`` needs run in B; the
equations only ``dw`` needs run in W.  Computed separately with two dead-code-eliminated copies of the
pullback (what the executor did before), W back-propagates through the stage a second time: the weight
gradient of layer ``l`` needs the gradient at layer ``l``'s output, which comes through layers ``l+1..L``
(one matmul per layer recomputed, ~17% more stage compute for two tanh layers).  Here B also returns the
values W's own equations read from B's part -- the per-layer output gradients, the *frontier* -- and the
executor keeps them in a slot beside the stashed residuals until W.  W then runs only the weight-gradient
equations: together B and W compute what the fused backward computes, no more.

The split is made on the flat jaxpr of the pullback (calls of jitted functions inlined).  A stage whose
layers are inside one equation (a ``lax.scan`` over layers, a ``remat``) cannot be split there: its
frontier would hold that equation's outputs -- the weight gradients themselves.  :func:`split_backward`
returns None when the frontier is larger than the stashed residuals (or W has nothing of its own), and the
executor keeps recomputing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import jax
import numpy as np

from ..jax_internals import UnknownJaxprLayout, scan_layout

_CALLS = ("pjit", "jit", "closed_call", "core_call")


def _is_literal(v) -> bool:
    return hasattr(v, "val")


def _read(env, v):
    return v.val if _is_literal(v) else env[v]


def _eval_eqns(eqns, env, inline: bool = False):
    """Bind ``eqns`` in order on the values in ``env`` (a dict var -> value, updated); ``inline``: evaluate
    calls of jitted functions equation by equation (so that tracing this gives a flat jaxpr)."""
    for eqn in eqns:
        invals = [_read(env, v) for v in eqn.invars]
        inner = (
            eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if eqn.primitive.name in _CALLS else None
        )
        if inline and inner is not None:
            closed = inner if hasattr(inner, "consts") else None
            jaxpr = closed.jaxpr if closed is not None else inner
            sub = dict(zip(jaxpr.constvars, closed.consts if closed is not None else []))
            sub.update(zip(jaxpr.invars, invals))
            _eval_eqns(jaxpr.eqns, sub, inline=True)
            outs = [_read(sub, v) for v in jaxpr.outvars]
        else:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))


def _needed(eqns, targets) -> set:
    """Indices of the equations the variables ``targets`` depend on."""
    want = {v for v in targets if not _is_literal(v)}
    need = set()
    for k in range(len(eqns) - 1, -1, -1):
        if any(v in want for v in eqns[k].outvars):
            need.add(k)
            want.update(v for v in eqns[k].invars if not _is_literal(v))
    return need


class BackwardSplit(NamedTuple):
    """``input_part(w, res, dy) -> (dx, frontier)`` for B, ``weight_part(w, res, dy, frontier) -> dw`` for W;
    ``frontier_avals``: the shapes B hands to W (one slot per in-flight micro-batch); ``w_reads``: the indices
    of the residuals W reads (the others are dead once B ran: :mod:`.front_pack` keeps the frontier there).
    ``weight_part_into(w, res, dy, frontier, sums, add) -> sums``: W's gradient added into ``sums`` (a tree
    like ``dw``) by ``add(sum_leaf, dw_leaf)`` (elementwise); a split scan's stacked weight gradients are
    added layer by layer into their slices in place, never stacked apart first (:func:`_run_w_scan_into`)."""

    input_part: Callable
    weight_part: Callable
    frontier_avals: List[Any]
    w_reads: Tuple[int, ...] = ()
    weight_part_into: Optional[Callable] = None
    #: whether ``weight_part_into`` adds some weight gradient layer by layer in place (a scan over layers)
    in_place: bool = False


def _nbytes(avals) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in avals)


def _scan_split(eqn, need_b_out, need_w_out):
    """The split of one ``scan`` equation of B's part whose outputs W alone needs (a stage scanning its
    layers): B runs the scan's input-gradient equations and stacks, per iteration, the values W's equations
    read (the layer's output gradient); W maps the weight-gradient equations over the iterations.  Returns
    None where the body cannot be cut (a carry only W needs)."""
    lay = scan_layout(eqn)
    body, nc, ncar = lay.body, lay.num_consts, lay.num_carry
    bj = body.jaxpr
    outs_b = [i for i, v in enumerate(eqn.outvars) if v in need_b_out or i < ncar]
    outs_w = [i for i, v in enumerate(eqn.outvars) if v in need_w_out and v not in need_b_out]
    if not outs_w or any(i < ncar for i in outs_w):
        return None
    inner_b = _needed(bj.eqns, [bj.outvars[i] for i in outs_b])
    inner_w = sorted(_needed(bj.eqns, [bj.outvars[i] for i in outs_w]) - inner_b)
    b_def = {v for k in inner_b for v in bj.eqns[k].outvars} | set(bj.invars[nc : nc + ncar])
    used = [u for k in inner_w for u in bj.eqns[k].invars] + [bj.outvars[i] for i in outs_w]
    front = list(dict.fromkeys(v for v in used if not _is_literal(v) and v in b_def))
    outer_in = sorted(
        {j for j, v in enumerate(bj.invars) if j < nc or j >= nc + ncar for u in used if u is v}
    )
    return dict(
        eqn=eqn,
        body=body,
        nc=nc,
        ncar=ncar,
        length=lay.length,
        reverse=lay.reverse,
        outs_b=outs_b,
        outs_w=outs_w,
        b_eqns=[bj.eqns[k] for k in sorted(inner_b)],
        w_eqns=[bj.eqns[k] for k in inner_w],
        front=front,
        outer_in=outer_in,
    )


def _run_b_scan(sp, invals):
    """B's half of a split scan: ``(values of outs_b, stacked frontier)``."""
    bj, nc, ncar = sp["body"].jaxpr, sp["nc"], sp["ncar"]
    consts, carry, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]

    def step(c, x):
        env = dict(zip(bj.constvars, sp["body"].consts))
        env.update(zip(bj.invars, list(consts) + list(c) + list(x)))
        _eval_eqns(sp["b_eqns"], env)
        outs = [_read(env, bj.outvars[i]) for i in sp["outs_b"]]
        return outs[:ncar], (outs[ncar:], [_read(env, v) for v in sp["front"]])

    carry_out, (ys, front) = jax.lax.scan(
        step, list(carry), list(xs), length=sp["length"], reverse=sp["reverse"]
    )
    return carry_out + ys, front


def _run_w_scan(sp, invals, front):
    """W's half of a split scan: the weight-gradient outputs, stacked over the iterations."""
    bj, nc, ncar = sp["body"].jaxpr, sp["nc"], sp["ncar"]
    consts = {j: invals[j] for j in sp["outer_in"] if j < nc}
    xs = {j: invals[j] for j in sp["outer_in"] if j >= nc + ncar}

    def step(_, x):
        xv, fv = x
        env = dict(zip(bj.constvars, sp["body"].consts))
        env.update({bj.invars[j]: v for j, v in consts.items()})
        env.update({bj.invars[j]: v for j, v in zip(xs, xv)})
        env.update(zip(sp["front"], fv))
        _eval_eqns(sp["w_eqns"], env)
        return None, [_read(env, bj.outvars[i]) for i in sp["outs_w"]]

    _, ys = jax.lax.scan(step, None, (list(xs.values()), list(front)), length=sp["length"])
    return ys


def add_into_slice(stacked, index, grad, add):
    """``stacked`` with ``add(stacked[index], grad)`` in its slice ``index`` (of the leading axis).

    Where ``add`` says what it adds (an ``addend(grad, dtype)``, as
    :class:`~jaxpipe.optim.policies.LeafAdd` does: ``add(u, g) == u + addend(g)``), one scatter-add of that
    addend at the one index, in place.  Read with a ``dynamic-slice`` and written back with a
    ``dynamic-update-slice``, XLA CPU copies the slice out before the add (a 4 MiB copy for a 1024^2 layer):
    on one core that made 1F1B's step at D = 1 1.13x as long (BUILD_NOTES, "Stash, residuals and the split
    backward").  Either way each element gets the same one addition."""
    addend = getattr(add, "addend", None)
    if addend is None:
        return jax.lax.dynamic_update_index_in_dim(
            stacked, add(jax.lax.dynamic_index_in_dim(stacked, index, 0, keepdims=False), grad), index, 0
        )
    return stacked.at[index].add(addend(grad, stacked.dtype), indices_are_sorted=True, unique_indices=True)


def _run_w_scan_into(sp, invals, front, sums, add):
    """W's half of a split scan whose every output is a weight gradient the stage returns as it is: each
    iteration's gradients added by ``add`` into their slice of ``sums`` (one per output), in place.  Stacked
    first and added after (:func:`_run_w_scan`), the sum costs a zero-filled stacked buffer and a pass over it
    and the sums: on one core (testbed MLP, 4 layers 1024^2, 64 rows) W took 7.8 ms a micro-batch, 5.1 in
    place (BUILD_NOTES)."""
    bj, nc, ncar = sp["body"].jaxpr, sp["nc"], sp["ncar"]
    consts = {j: invals[j] for j in sp["outer_in"] if j < nc}
    xs = {j: invals[j] for j in sp["outer_in"] if j >= nc + ncar}
    at = lambda leaf, l: jax.lax.dynamic_index_in_dim(leaf, l, 0, keepdims=False)

    def step(l, acc):
        env = dict(zip(bj.constvars, sp["body"].consts))
        env.update({bj.invars[j]: v for j, v in consts.items()})
        env.update({bj.invars[j]: at(v, l) for j, v in xs.items()})
        env.update(zip(sp["front"], [at(f, l) for f in front]))
        _eval_eqns(sp["w_eqns"], env)
        outs = [_read(env, bj.outvars[i]) for i in sp["outs_w"]]
        return [add_into_slice(a, l, y, add) for a, y in zip(acc, outs)]

    return jax.lax.fori_loop(0, sp["length"], step, list(sums))


def _direct_outputs(jaxpr, w_only, splits, dw_vars) -> dict:
    """``{split scan's equation index: [position in dw_vars of each of its W outputs]}`` for the split scans
    whose W outputs are all returned as they are (once each) and read by nothing else in W."""
    read = {u for u in _w_reads(jaxpr, w_only, splits, ()) if not _is_literal(u)}
    direct = {}
    for k, sp in splits.items():
        outs = [sp["eqn"].outvars[i] for i in sp["outs_w"]]
        pos = [[p for p, v in enumerate(dw_vars) if v is o] for o in outs]
        if all(len(q) == 1 for q in pos) and not any(o in read for o in outs):
            direct[k] = [q[0] for q in pos]
    return direct


def _scan_splits(jaxpr, b_set, w_only, dx_vars, dw_vars):
    """``{equation index: split}`` of the scans over layers in B's part whose outputs W alone needs (the
    stacked weight gradients): each is cut in two (:func:`_scan_split`)."""
    read_by = lambda ks: {u for k in ks for u in jaxpr.eqns[k].invars if not _is_literal(u)}
    need_b_out = read_by(b_set) | set(dx_vars)
    need_w_out = read_by(w_only) | set(dw_vars)
    splits = {}
    for k in sorted(b_set):
        if jaxpr.eqns[k].primitive.name == "scan":
            sp = _scan_split(jaxpr.eqns[k], need_b_out, need_w_out)
            if sp is not None:
                splits[k] = sp
    return splits


def _w_reads(jaxpr, w_only, splits, dw_vars) -> list:
    """What W reads: its equations' inputs, the outer inputs of the split scans' weight halves, and the
    weight gradients themselves (B may make some)."""
    return (
        [u for k in w_only for u in jaxpr.eqns[k].invars]
        + [sp["eqn"].invars[j] for sp in splits.values() for j in sp["outer_in"]]
        + list(dw_vars)
    )


def _indices_in(invars, w, res, read) -> Tuple[int, ...]:
    """The indices of the residuals (flat inputs after the weights') among the variables ``read``."""
    n_w = len(jax.tree.leaves(w))
    return tuple(i for i, v in enumerate(invars[n_w : n_w + len(jax.tree.leaves(res))]) if v in read)


def _frontier(jaxpr, b_set, w_only, splits, dw_vars, w_made):
    """The values B computes that W reads (in order, once each)."""
    b_defined = {v for k in b_set for v in jaxpr.eqns[k].outvars} - w_made
    front, seen = [], set()
    for v in _w_reads(jaxpr, w_only, splits, dw_vars):
        if not _is_literal(v) and v in b_defined and v not in seen:
            seen.add(v)
            front.append(v)
    return front


_WARNED = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)


def split_backward(bwd: Callable, w, res, dy, stash_avals) -> Optional[BackwardSplit]:
    """The split of ``bwd(w, res, dy) -> (dw, dx)`` (pytrees) traced at these arguments, or None where it
    would not pay (see the module docstring).  Call it where the executor traces (inside the
    ``shard_map``)."""
    flat_args, in_tree = jax.tree.flatten((w, res, dy))
    nested, out_shape = jax.make_jaxpr(
        lambda *leaf: bwd(*jax.tree.unflatten(in_tree, leaf)), return_shape=True
    )(*flat_args)

    def flat_bwd(*leaves):  # the same equations with jitted calls inlined
        env = dict(zip(nested.jaxpr.constvars, nested.consts))
        env.update(zip(nested.jaxpr.invars, leaves))
        _eval_eqns(nested.jaxpr.eqns, env, inline=True)
        return [_read(env, v) for v in nested.jaxpr.outvars]

    closed = jax.make_jaxpr(flat_bwd)(*flat_args)
    out_tree = jax.tree.structure(out_shape)
    jaxpr = closed.jaxpr
    n_dw = len(jax.tree.leaves(out_shape[0]))
    dw_vars, dx_vars = jaxpr.outvars[:n_dw], jaxpr.outvars[n_dw:]
    b_set = _needed(jaxpr.eqns, dx_vars)
    w_need = _needed(jaxpr.eqns, dw_vars)
    w_only = sorted(w_need - b_set)
    try:
        splits = _scan_splits(jaxpr, b_set, w_only, dx_vars, dw_vars)
    except UnknownJaxprLayout as e:
        _warn_once(
            f"jaxpipe: zero-bubble's B/W split cannot read this JAX's ({jax.__version__}) jaxpr: {e}. W "
            f"recomputes the stage's backward instead (exact, about one more backward pass of compute); "
            f"jaxpipe.jax_internals lists the JAX versions it reads"
        )
        return None
    if not w_only and not splits:
        return None
    w_made = {sp["eqn"].outvars[i] for sp in splits.values() for i in sp["outs_w"]}
    front = _frontier(jaxpr, b_set, w_only, splits, dw_vars, w_made)
    # a frontier value made by an equation with a jaxpr inside (a remat, a custom rule, a scan that could not
    # be cut) means B would run W's part of that equation too: no split there
    atomic = {
        v
        for k in b_set
        for v in jaxpr.eqns[k].outvars
        if any(hasattr(p, "eqns") or hasattr(p, "jaxpr") for p in jaxpr.eqns[k].params.values())
    } - w_made
    inner_avals = [
        jax.ShapeDtypeStruct((sp["length"],) + tuple(v.aval.shape), v.aval.dtype)
        for sp in splits.values()
        for v in sp["front"]
    ]
    front_avals = [v.aval for v in front] + inner_avals
    if any(v in atomic for v in front) or _nbytes(front_avals) > _nbytes(stash_avals):
        return None
    parts = _Parts(
        jaxpr,
        closed.consts,
        splits,
        front,
        sorted(b_set),
        sorted(set(w_only) | set(splits)),
        dx_vars,
        dw_vars,
        _direct_outputs(jaxpr, w_only, splits, dw_vars),
        out_tree.children()[1],
        out_tree.children()[0],
    )
    read = {v for v in _w_reads(jaxpr, w_only, splits, dw_vars) if not _is_literal(v)}
    in_place = any(splits[k]["length"] > 1 for k in parts.direct)
    return BackwardSplit(
        parts.input_part,
        parts.weight_part,
        front_avals,
        _indices_in(jaxpr.invars, w, res, read),
        parts.weight_part_into,
        in_place,
    )


@dataclasses.dataclass(frozen=True)
class _Parts:
    """B's and W's halves of one flat backward jaxpr ``jx`` (:func:`split_backward`'s analysis)."""

    jaxpr: Any
    consts: Any
    splits: dict  # {equation index: a split scan (_scan_split)}
    front: list  # the values B computes that W reads (then the split scans' stacked ones)
    b_tasks: list
    w_tasks: list
    dx_vars: list
    dw_vars: list
    direct: dict  # _direct_outputs: split scans whose W adds into the sums in place
    dx_tree: Any
    dw_tree: Any

    def start(self, w_, res_, cotangent_):
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, jax.tree.leaves((w_, res_, cotangent_))))
        return env

    def input_part(self, w_, res_, cotangent_):
        env, inner = self.start(w_, res_, cotangent_), []
        for k in self.b_tasks:
            if k in self.splits:
                sp = self.splits[k]
                outs, fr = _run_b_scan(sp, [_read(env, v) for v in sp["eqn"].invars])
                env.update((sp["eqn"].outvars[i], o) for i, o in zip(sp["outs_b"], outs))
                inner += fr
            else:
                _eval_eqns([self.jaxpr.eqns[k]], env)
        return (
            jax.tree.unflatten(self.dx_tree, [_read(env, v) for v in self.dx_vars]),
            [env[v] for v in self.front] + inner,
        )

    def run_w(self, w_, res_, cotangent_, frontier, into=None):
        env, done = self.start(w_, res_, cotangent_), {}
        env.update(zip(self.front, frontier[: len(self.front)]))
        inner, pos = frontier[len(self.front) :], 0
        for k in self.w_tasks:
            if k not in self.splits:
                _eval_eqns([self.jaxpr.eqns[k]], env)
                continue
            sp = self.splits[k]
            n = len(sp["front"])
            invals = [_read(env, v) if _is_literal(v) or v in env else None for v in sp["eqn"].invars]
            # one layer: stacked and added as a whole (in place in a loop of one, XLA copied the sums)
            if into is not None and k in self.direct and sp["length"] > 1:
                sums, add = into
                new = _run_w_scan_into(
                    sp, invals, inner[pos : pos + n], [sums[p] for p in self.direct[k]], add
                )
                done.update(zip(self.direct[k], new))
            else:
                ys = _run_w_scan(sp, invals, inner[pos : pos + n])
                env.update((sp["eqn"].outvars[i], y) for i, y in zip(sp["outs_w"], ys))
            pos += n
        if into is None:
            return jax.tree.unflatten(self.dw_tree, [_read(env, v) for v in self.dw_vars])
        sums, add = into
        return jax.tree.unflatten(
            self.dw_tree,
            [done[p] if p in done else add(sums[p], _read(env, v)) for p, v in enumerate(self.dw_vars)],
        )

    def weight_part(self, w_, res_, cotangent_, frontier):
        return self.run_w(w_, res_, cotangent_, frontier)

    def weight_part_into(self, w_, res_, cotangent_, frontier, sums, add):
        if jax.tree.structure(sums) != self.dw_tree:
            raise ValueError(
                f"weight_part_into: sums {jax.tree.structure(sums)} are not shaped like the weight "
                f"gradient {self.dw_tree}"
            )
        return self.run_w(w_, res_, cotangent_, frontier, (jax.tree.leaves(sums), add))


def stage_splits(model, w, x, mb) -> bool:
    """Whether zero-bubble's W of ``model``'s stage (weights ``w``, activation ``x``, micro-batch ``mb``) runs
    from the frontier B keeps (True), or recomputes the backward (False: a recomputing residual policy, a
    stage whose layers sit in one equation) -- as the executor decides it.  A cost model prices W at the
    weight products alone in the first case and at a whole backward again in the second."""
    return _stage_split(model, w, x, mb)[0] is not None


def _stage_split(model, w, x, mb):
    """``(split or None, stashed residual avals)`` of ``model``'s stage, analysed as the executor does."""
    from .stage import StageOps

    zeros = lambda tree: jax.tree.map(lambda leaf: jax.numpy.zeros(leaf.shape, leaf.dtype), tree)
    sop, avals = StageOps.build(model, w, zeros(x), mb)
    return split_backward(sop.backward, w, zeros(avals), zeros(x), avals), avals


def frontier_slot_bytes(model, w, x, mb, slots: int) -> int:
    """Bytes of the frontier slots zero-bubble's B keeps for W in buffers of their own (``slots`` of them, at
    least one, as the executor allocates them): 0 where W recomputes the backward or the frontier is packed
    into the stash slots B alone reads (:func:`~jaxpipe.runtime.front_pack.placed_in_stash`)."""
    from .front_pack import placed_in_stash

    sp, avals = _stage_split(model, w, x, mb)
    if sp is None or placed_in_stash(sp, avals, slots) is not None:
        return 0
    return max(slots, 1) * _nbytes(sp.frontier_avals)
