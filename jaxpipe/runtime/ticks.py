"""A lockstep tick (its F, F2, B and W lanes, the messages they send), the call's scans over the plan's
phases, and what happens between scans (landings, Chimera's eager exchange).  Methods of the executor's
per-trace :class:`~jaxpipe.runtime.executor._Call`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..axes import STAGE
from ..schedules.ir import SEND_PLUS
from .apc import apc_pack, apc_unpack
from .common import ROUTE, ppermute_bits, read, where, write


class Ticks:
    def scan_phases(self, st):
        """The call's scans, one per phase (``segments``: a tick range and its static flags), with the landings
        and Chimera's eager exchanges between them."""
        for a, b, flags in self.segments:
            ticks = self.t0 + jnp.arange(a, b, dtype=jnp.int32)
            if self.fused:       # sum-only policies never write the weights: they stay out of the loop's state
                def scan_tick(s_, t, fixed=st[:2], flags=flags):
                    return self.tick(fixed + s_, t, flags)[0][2:], None
                rest, _ = lax.scan(scan_tick, st[2:], ticks)
                st = st[:2] + rest
            else:
                st, _ = lax.scan(lambda s_, t, flags=flags: self.tick(s_, t, flags), st, ticks)
            st = self.land_between(st, b)
            if b in self.eager:
                st = self.exchange_between(st, self.eager[b])
        return st

    def tick(self, st, t, flags=True):
        """One tick.  ``flags`` (static, per scan segment): whether an in-scan landing may happen in it; on a
        ring, (may land an arrived stage, may complete a sum); a lane plan's phase: the lanes some device
        uses in these ticks (the others are not compiled here)."""
        lps, oss, pss, cr, loss = st
        run = [li in flags for li in range(len(self.kinds))] if self.slots else [True] * len(self.kinds)
        rr = jnp.asarray(self.routes)[t % self.T, self.me] if self.slots else None     # this device's route rows
        stacks = None
        if self.ring:            # stacked chunks: the lanes read static views of them
            if flags[0]:
                lps, pss = self.receive_arrived(lps, pss, cr.reduce)
            stacks = (lps, oss, pss)
        is_f, cf, gf = self.op_of(t, self.me, 0)
        is_b, cb, gb = self.op_of(t, self.me, self.KB)
        err = self.errors_of(cf, gf, is_f, self.per_chunk(lps, pss)[1])
        if run[0]:
            pss, cr, loss = self.forward_lanes(t, rr, run, (is_f, cf, gf), lps, pss, cr, loss)
        if run[self.KB]:
            err = err + self.errors_of(cb, gb, is_b, self.per_chunk(lps, pss)[1])
            lps, oss, pss, cr = self.backward_lanes(t, rr, run, flags, (is_b, cb, gb), stacks, lps, oss, pss, cr)
        cr = cr._replace(errors=cr.errors + err)
        if not self.ring:
            lps, oss, pss = tuple(lps), tuple(oss), tuple(pss)
        return (lps, oss, pss, cr, loss), None

    def forward_lanes(self, t, rr, run, op, lps, pss, cr, loss):
        """The tick's F lane (with its F2 pair where the plan has one) and the messages they send."""
        is_f, cf, gf = op
        if self.slots:       # the plan's slots: what each lane reads and where its stash goes
            x_in, t_in = (read(a, rr[0, ROUTE["in"]]) for a in cr.mbuf[:2])
            sf = rr[0, ROUTE["stash"]]
        else:
            x_in, t_in, sf = cr.recv_f, cr.tie_f, self.slot_of(cf, gf)
        if self.K > 1 and not self.slots:   # device 0's later chunks read the last device's output from the wrap buffer
            wx, wt = jax.tree.map(lambda a: read(a, gf % self.C), cr.wrap_f)
            on_wrap = (self.me == 0) & (cf > 0)
            x_in, t_in = where(on_wrap, wx, x_in), where(on_wrap, wt, t_in)
        if self.paired and run[self.KF2]:     # F2 pairs with F: one forward of the two micro-batches where both run
            (pss, cr, loss), send_f, send_f2 = self.f_lanes_paired(t, rr, is_f, cf, gf, sf, x_in, t_in,
                                                                   (lps, pss, cr, loss))
            return pss, cr._replace(mbuf=self.deliver(self.KF2, rr[self.KF2], send_f2,
                                                      self.deliver(0, rr[0], send_f, cr.mbuf))), loss
        (pss, cr, loss), send_f = self.f_cond(is_f, cf, gf, sf, x_in, t_in, ops=(lps, pss, cr, loss))
        if self.slots:
            cr = cr._replace(mbuf=self.deliver(0, rr[0], send_f, cr.mbuf))
        elif self.D > 1 or self.K > 1:
            recv_f, tie_f = self.send(send_f, self.ring_f)
            cr = cr._replace(recv_f=recv_f, tie_f=tie_f)
            if self.K > 1:
                runs_s, c_s, g_s = self.op_of(t, self.D - 1, 0)
                slot = jnp.where((self.me == 0) & runs_s & (c_s < self.K - 1), g_s % self.C, self.C)
                cr = cr._replace(wrap_f=jax.tree.map(lambda a, v: write(a, slot, v), cr.wrap_f, (recv_f, tie_f)))
        return pss, cr, loss

    def backward_lanes(self, t, rr, run, flags, op, stacks, lps, oss, pss, cr):
        """The tick's B lane, the update it feeds (or the ring's exchange), ZB's W lane, and their messages."""
        is_b, cb, gb = op
        if self.slots:
            dy_in, tb_in, cnt = (read(a, rr[self.KB, ROUTE["in"]]) for a in cr.mbuf)
            sb = rr[self.KB, ROUTE["stash"]]
        else:
            dy_in, tb_in, cnt, sb = cr.recv_b, cr.tie_b, cr.cnt_b, self.slot_of(cb, gb)
        if self.K > 1 and not self.slots:   # the last device's earlier chunks read device 0's gradient from the wrap buffer
            wd, wt, wc = jax.tree.map(lambda a: read(a, gb % self.C), cr.wrap_b)
            on_wrap = (self.me == self.D - 1) & (cb < self.K - 1)
            dy_in, tb_in, cnt = where(on_wrap, wd, dy_in), where(on_wrap, wt, tb_in), jnp.where(on_wrap, wc, cnt)
        if not self.slots:
            cnt = jnp.where(self.is_last(cb), cr.cnt_own, cnt)
        if self.fused:
            pss, cr, send_b = self.b_lanes_summing(cb, gb, sb, dy_in, tb_in, cnt, is_b, lps, oss, pss, cr)
        else:
            grad, send_b, _ = lax.cond(is_b, self.b_lane, self.b_idle, cb, gb, sb, dy_in, tb_in, (lps, pss, cr))
        send_b = send_b + (jnp.where(is_b & ~self.is_first(cb), cnt,
                                     jnp.full((), jnp.nan if self.nan_bubbles else 0, jnp.float32)),)
        if self.ring:
            lps, oss, pss, rs = self.ring_exchange(t, *stacks, cr.reduce, is_b, cb, grad, cnt, flags[1])
            cr = cr._replace(reduce=rs)
        elif not self.fused:
            lps, oss, pss = self.b_updates(is_b, cb, gb, grad, cnt, flags, lps, oss, pss)
        if self.slots:
            cr = cr._replace(mbuf=self.deliver(self.KB, rr[self.KB], send_b, cr.mbuf))
            if self.split and run[self.KW]:
                pss = self.w_lanes(t, rr[self.KW], lps, oss, pss, cr)
        elif self.D > 1 or self.K > 1:
            recv_b, tie_b, cnt_b = self.send(send_b, self.ring_b)
            cr = cr._replace(recv_b=recv_b, tie_b=tie_b, cnt_b=cnt_b)
            if self.K > 1:
                runs_s, c_s, g_s = self.op_of(t, 0, 1)
                slot = jnp.where((self.me == self.D - 1) & runs_s & (c_s > 0), g_s % self.C, self.C)
                cr = cr._replace(wrap_b=jax.tree.map(lambda a, v: write(a, slot, v), cr.wrap_b,
                                                     (recv_b, tie_b, cnt_b)))
        return lps, oss, pss, cr

    def b_updates(self, is_b, cb, gb, grad, cnt, flags, lps, oss, pss):
        """The backward's update of its chunk: one conditional per chunk, each output either its operand or a
        new value (no copies); a pending version applied; an in-scan landing where the policy lands."""
        lps, oss, pss = list(lps), list(oss), list(pss)
        for c in range(self.K):
            mine = is_b & (cb == c)
            lps[c], oss[c], pss[c] = lax.cond(
                mine, lambda *a, c=c: self.b_apply(c, *a), lambda g, gr, n, *a: a, gb, grad, cnt,
                lps[c], oss[c], pss[c])
            if self.policies[c].apply_pending is not None:
                lps[c] = lax.cond(mine, self.policies[c].apply_pending, lambda lp, ps: lp, lps[c], pss[c])
            if self.in_scan and flags:
                lps[c], oss[c], pss[c] = lax.cond(
                    mine & self.policies[c].lands(self.base + gb),
                    lambda *a, c=c: self.policies[c].land(*a, counting=self.counting, b=(self.base + gb) // self.M),
                    lambda *a: a, lps[c], oss[c], pss[c])
        return lps, oss, pss

    def send(self, x, pairs):
        """A lane's message to the next (previous) device: its bits, or APC-compressed activation/gradient.
        One device (chunks wrapping around on it): the message stays -- a collective over a one-device group
        is still a rendezvous of every device on XLA CPU (BUILD_NOTES, "Collectives over one device")."""
        if self.D == 1:
            return x
        if len(x) == 3 and not self.counting:
            # (message, tied arrays, count): a count only matters to (sum, count) losses (XLA drops an unused
            # one too; this does not rely on it)
            return tuple(self.send(x[:2], pairs)) + (x[2],)
        if not self.apc:
            return ppermute_bits(x, STAGE, pairs)
        head, rest = x[0], x[1:]
        return (apc_unpack(lax.ppermute(apc_pack(head), STAGE, pairs), head),) + tuple(
            ppermute_bits(rest, STAGE, pairs))

    def deliver(self, li, rr, msg, mbuf):
        """A lane plan's stream: lane ``li``'s message kept on the device and/or sent on the plan's channels
        (one ``ppermute`` each), written to the slots the plan gave it (``rr``: this device's route row)."""
        if self.periodic.plan.keeps[li]:
            mbuf = write(mbuf, rr[ROUTE["keep"]], msg)
        for ch in self.periodic.plan.channels[li]:
            fwd = ch == SEND_PLUS
            mbuf = write(mbuf, rr[ROUTE["recv_p" if fwd else "recv_m"]], self.send(msg, self.ring_f if fwd else self.ring_b))
        return mbuf

    def land_between(self, st, tau):
        """The chunks whose batch completes by tick offset ``tau`` land it now (``lag`` calls after it was
        fed), outside any scan: a landing conditional in a scan made XLA copy the weights every tick."""
        if not any(tc == tau for _, tc in self.lands.values()):
            return st
        lps, oss, pss, cr, loss = st
        lps, oss, pss = list(lps), list(oss), list(pss)
        for c, (lag, tc) in self.lands.items():
            if tc != tau:
                continue
            bk = self.t0 // self.T - lag
            lps[c], oss[c], pss[c] = lax.cond(
                (bk >= 0) & (bk * self.M < self.n_fed),
                lambda *a, c=c: self.policies[c].land(*a, counting=self.counting, b=self.base // self.M + bk),
                lambda *a: a, lps[c], oss[c], pss[c])
        return tuple(lps), tuple(oss), tuple(pss), cr, loss

    def exchange_between(self, st, pairs):
        """Chimera §3.2: the replica gradients of the stages whose backwards are all done go home now
        (one ``ppermute`` for the group), where the transfer may overlap the rest of the pipeline; the sent
        sums are zeroed, so the exchange after the call adds nothing for them."""
        lps, oss, pss, cr, loss = st
        (get0, put0), (get1, put1) = self.policies[0].sums, self.policies[1].sums
        got = jax.tree.map(lambda a: lax.ppermute(a, STAGE, list(pairs)), get1(pss[1]))
        dst = jnp.isin(self.me, jnp.asarray([d for _, d in pairs]))
        src = jnp.isin(self.me, jnp.asarray([r for r, _ in pairs]))
        p0 = put0(pss[0], jax.tree.map(lambda a, b: jnp.where(dst, a + b, a), get0(pss[0]), got))
        p1 = put1(pss[1], jax.tree.map(lambda a: jnp.where(src, jnp.zeros_like(a), a), get1(pss[1])))
        return lps, oss, (p0, p1), cr, loss
