"""A lockstep tick (its F, F2, B and W lanes, the messages they send), the call's scans over the plan's
phases, and what happens between scans (landings, Chimera's eager exchange).  Functions over the
executor's :class:`~jaxpipe.runtime.program.Program` and :class:`~jaxpipe.runtime.executor.Trace`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..axes import STAGE
from ..schedules.layout import ROUTE
from .call_base import errors_of, is_first, op_of, per_chunk
from .lanes_backward import w_lanes
from .lanes_forward import f_cond, f_lanes_paired


def scan_phases(prog, tr, st):
    """The call's scans, one per phase (``segments``: a tick range and its static flags), with the landings
    and Chimera's eager exchanges between them."""
    for a, b, flags in prog.segments:
        ticks = tr.t0 + jnp.arange(a, b, dtype=jnp.int32)
        if prog.fused:  # sum-only policies never write the weights: they stay out of the loop's state

            def scan_tick(s_, t, fixed=st[:2], flags=flags):
                return tick(prog, tr, fixed + s_, t, flags)[0][2:], None

            rest, _ = lax.scan(scan_tick, st[2:], ticks)
            st = st[:2] + rest
        else:
            st, _ = lax.scan(lambda s_, t, flags=flags: tick(prog, tr, s_, t, flags), st, ticks)
        st = land_between(prog, tr, st, b)
        if b in prog.eager:
            st = exchange_between(prog, tr, st, prog.eager[b])
    return st


def tick(prog, tr, st, t, flags=True):
    """One tick.  ``flags`` (static, per scan segment): whether an in-scan landing may happen in it; on a
    ring, (may land an arrived stage, may complete a sum); a lane plan's phase: the lanes some device
    uses in these ticks (the others are not compiled here)."""
    lps, oss, pss, cr, loss = st
    tr.outbox.clear()  # (what an interrupted trace may have left)
    run, rr = prog.route.lanes(prog, tr, t, flags)  # the lanes compiled here; this device's route rows
    lps, pss, stacks = prog.grads.before_tick(prog, tr, lps, oss, pss, cr, flags)
    is_f, cf, gf = op_of(prog, tr, t, tr.me, 0)
    is_b, cb, gb = op_of(prog, tr, t, tr.me, prog.KB)
    is_f, is_b = (True if run[0] == 2 else is_f), (True if run[prog.KB] == 2 else is_b)  # no conditional
    err = errors_of(prog, tr, cf, gf, is_f, per_chunk(prog, tr, lps, pss)[1])
    if run[0]:
        pss, cr, loss = forward_lanes(prog, tr, t, rr, run, (is_f, cf, gf), lps, pss, cr, loss)
    if run[prog.KB]:
        err = err + errors_of(prog, tr, cb, gb, is_b, per_chunk(prog, tr, lps, pss)[1])
        lps, oss, pss, cr = backward_lanes(
            prog, tr, t, rr, run, flags, (is_b, cb, gb), stacks, lps, oss, pss, cr
        )
    if (
        prog.split and run[prog.KW]
    ):  # ZB's W lane (a lane plan's: W reads its slots), also in a phase without B
        pss = w_lanes(prog, tr, t, rr[prog.KW], lps, oss, pss, cr)
    cr = prog.route.exchange(prog, tr, cr)  # the tick's messages, in one exchange after every lane
    cr = cr._replace(errors=cr.errors + err, **({"stash": []} if prog.direct else {}))
    lps, oss, pss = prog.grads.end_tick(lps, oss, pss)
    return (lps, oss, pss, cr, loss), None


def forward_lanes(prog, tr, t, rr, run, op, lps, pss, cr, loss):
    """The tick's F lane (with its F2 pair where the plan has one) and the messages they send."""
    is_f, cf, gf = op
    x_in, t_in, sf = prog.route.forward_in(prog, tr, t, rr, cr, cf, gf)
    if prog.paired and run[prog.KF2]:  # F2 pairs with F: one forward of the two micro-batches where both run
        (pss, cr, loss), send_f, send_f2 = f_lanes_paired(
            prog, tr, t, rr, is_f, cf, gf, sf, x_in, t_in, (lps, pss, cr, loss)
        )
        return pss, prog.route.paired_out(prog, tr, t, rr, cr, send_f, send_f2), loss
    (pss, cr, loss), send_f = f_cond(prog, tr, is_f, cf, gf, sf, x_in, t_in, ops=(lps, pss, cr, loss))
    return pss, prog.route.forward_out(prog, tr, t, rr, cr, send_f), loss


def backward_lanes(prog, tr, t, rr, run, flags, op, stacks, lps, oss, pss, cr):
    """The tick's B lane, the update it feeds (or the ring's exchange), and its messages."""
    is_b, cb, gb = op
    dy_in, tb_in, cnt, sb = prog.route.backward_in(prog, tr, rr, cr, cb, gb)
    if tr.wsp is not None:  # B keeps its frontier for W in a slot of its own
        sb = (sb, rr[prog.KB, ROUTE["front"]])
    pss, cr, grad, send_b = prog.grads.backward(
        prog, tr, (cb, gb, sb, dy_in, tb_in, cnt), is_b, lps, oss, pss, cr
    )
    send_b = send_b + (
        jnp.where(
            is_b & ~is_first(prog, tr, cb), cnt, jnp.full((), jnp.nan if prog.nan_bubbles else 0, jnp.float32)
        ),
    )
    lps, oss, pss, cr = prog.grads.apply(prog, tr, t, flags, stacks, op, grad, cnt, lps, oss, pss, cr)
    cr = prog.route.backward_out(prog, tr, t, rr, cr, send_b)
    return lps, oss, pss, cr


def land_between(prog, tr, st, tau):
    """The chunks whose batch completes by tick offset ``tau`` land it now (``lag`` calls after it was
    fed), outside any scan: a landing conditional in a scan made XLA copy the weights every tick."""
    if not any(tc == tau for _, tc in prog.lands.values()):
        return st
    lps, oss, pss, cr, loss = st
    lps, oss, pss = list(lps), list(oss), list(pss)
    for c, (lag, tc) in prog.lands.items():
        if tc != tau:
            continue
        bk = tr.t0 // prog.T - lag
        lps[c], oss[c], pss[c] = lax.cond(
            (bk >= 0) & (bk * prog.M < tr.n_fed),
            lambda *a, c=c: prog.policies[c].land(*a, counting=prog.counting, b=tr.base // prog.M + bk),
            lambda *a: a,
            lps[c],
            oss[c],
            pss[c],
        )
    return tuple(lps), tuple(oss), tuple(pss), cr, loss


def exchange_between(prog, tr, st, pairs):
    """Chimera §3.2: the replica gradients of the stages whose backwards are all done go home now
    (one ``ppermute`` for the group), where the transfer may overlap the rest of the pipeline; the sent
    sums are zeroed, so the exchange after the call adds nothing for them."""
    lps, oss, pss, cr, loss = st
    (get0, put0), (get1, put1) = prog.policies[0].sums, prog.policies[1].sums
    got = jax.tree.map(lambda a: lax.ppermute(a, STAGE, list(pairs)), get1(pss[1]))
    dst = jnp.isin(tr.me, jnp.asarray([d for _, d in pairs]))
    src = jnp.isin(tr.me, jnp.asarray([r for r, _ in pairs]))
    p0 = put0(pss[0], jax.tree.map(lambda a, b: jnp.where(dst, a + b, a), get0(pss[0]), got))
    p1 = put1(pss[1], jax.tree.map(lambda a: jnp.where(src, jnp.zeros_like(a), a), get1(pss[1])))
    return lps, oss, (p0, p1), cr, loss
