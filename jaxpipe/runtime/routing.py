"""How a tick's messages are routed: one strategy object per program, chosen once (``Program.route``).

* :class:`PlanSlots` -- a stream of one call made from a lane plan (:func:`jaxpipe.schedules.lanes.plan`):
  every lane reads its input from the slot the plan gave it and writes its message where the plan says (kept
  on the device, or sent on one of the plan's channels, one ``ppermute`` each); the last stage's dL/dy is the
  F lane's message to its own B; the head's gradient is summed over the call.
* :class:`Registers` -- a periodic stream (the no-flush methods): one register per direction, consumed the
  tick after it was sent; the last stage keeps its dL/dy, head gradient and count in registers of its own;
  chunks wrap around the device ring through buffers indexed like the ring of micro-batches.

Both are stateless: every method reads the :class:`~.program.Program` ``prog`` and the
:class:`~.executor.Trace` ``tr`` it is given.  The tick (:mod:`.ticks`) and the lanes never ask which one
runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..axes import STAGE
from ..schedules.ir import SEND_PLUS
from ..schedules.layout import ROUTE
from .apc import apc_pack, apc_unpack
from .call_base import is_last, op_of, slot_of, zero_like
from .common import ppermute_bits, read, where, write


def send(prog, tr, x, pairs):
    """A lane's message to the next (previous) device: its bits, or APC-compressed activation/gradient.
    One device (chunks wrapping around on it): the message stays -- a collective over a one-device group
    is still a rendezvous of every device on XLA CPU (BUILD_NOTES, "Collectives over one device")."""
    if prog.D == 1:
        return x
    if len(x) == 3 and not prog.counting:
        # (message, tied arrays, count): a count only matters to (sum, count) losses (XLA drops an unused
        # one too; this does not rely on it)
        return tuple(send(prog, tr, x[:2], pairs)) + (x[2],)
    if not prog.apc:
        return ppermute_bits(x, STAGE, pairs)
    head, rest = x[0], x[1:]
    return (apc_unpack(lax.ppermute(apc_pack(head), STAGE, pairs), head),) + tuple(
        ppermute_bits(rest, STAGE, pairs)
    )


def _same_avals(msgs) -> bool:
    """Whether the messages have one structure and leaf shapes and dtypes (an F's and a B's do)."""
    sig = {
        (jax.tree.structure(m), tuple((jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(m)))
        for m in msgs
    }
    return len(sig) == 1


class PlanSlots:
    """Messages and residuals in a lane plan's slots (module docstring)."""

    name = "slots"

    def micro_batches(self, prog, base, n_fed, batch, carry):
        """``(mb_of, carry)``: a stream of one call reads micro-batch ``g`` of its own batch, kept nowhere."""
        batch = jax.tree.map(lambda a: a.reshape((prog.M, a.shape[0] // prog.M) + a.shape[1:]), batch)
        return (lambda g: jax.tree.map(lambda a: read(a, g), batch)), carry

    def head_grad_to_sums(self, prog, tr, lps, oss, pss, carry):
        """After the call: the head's gradient, summed over the call's last-stage forwards, to the first
        chunk's policy sums."""
        w0, p0, _ = lps[0]
        g0 = (zero_like(prog, tr, w0), zero_like(prog, tr, p0), carry.gpost)
        return (
            prog.policies[0].update(
                g0, *lps[0:1], oss[0], pss[0], tr.base, tr.me, count=0.0 if prog.counting else None
            )[2],
        ) + tuple(pss[1:])

    def lanes(self, prog, tr, t, flags):
        """The lanes this scan compiles (its phase's ``flags``: 0 not compiled, 1 under a conditional, 2 busy
        on every device in every tick, run without one) and this device's route rows at tick ``t``."""
        return (
            [2 if li in flags.full else int(li in flags.used) for li in range(len(prog.kinds))],
            jnp.asarray(prog.routes)[t % prog.T, tr.me],
        )

    def forward_in(self, prog, tr, t, rr, cr, cf, gf):
        """``(x_in, tied_in, stash slot)`` of the F lane."""
        x_in, t_in = (read(a, rr[0, ROUTE["in"]]) for a in cr.mbuf[:2])
        return x_in, t_in, rr[0, ROUTE["stash"]]

    def forward_out(self, prog, tr, t, rr, cr, send_f):
        return cr._replace(mbuf=self.deliver(prog, tr, 0, rr[0], send_f, cr.mbuf))

    def paired_out(self, prog, tr, t, rr, cr, send_f, send_f2):
        """The F lane's and its F2 pair's messages (Chimera's forward doubling runs on lane plans only)."""
        return cr._replace(
            mbuf=self.deliver(
                prog, tr, prog.KF2, rr[prog.KF2], send_f2, self.deliver(prog, tr, 0, rr[0], send_f, cr.mbuf)
            )
        )

    def deliver(self, prog, tr, li, rr, msg, mbuf):
        """Lane ``li``'s message kept on the device (written now, to the slot the plan gave it; ``rr``: this
        device's route row) and/or posted for the plan's channels: every lane's posts of a tick move together
        in the tick's one exchange (:meth:`exchange`)."""
        if prog.periodic.plan.keeps[li]:
            mbuf = write(mbuf, rr[ROUTE["keep"]], msg)
        for ch in prog.periodic.plan.channels[li]:
            tr.outbox.append(
                (ch, rr[ROUTE["recv_p" if ch == SEND_PLUS else "recv_m"]], msg, rr[ROUTE["send"]] == ch)
            )
        return mbuf

    def exchange(self, prog, tr, cr):
        """The tick's one exchange (issue #49): every message its lanes posted moves now, after all of them
        ran, one ``ppermute`` per channel and message, and lands in its receive slot.  A message from another
        device is read the tick after it was sent at the earliest (the plan's rule), so nothing in the tick
        waited for it; and no device waits for a neighbour between its lanes -- a tick costs the slowest
        device's own actions, not the sum over lanes of each lane's slowest device."""
        mbuf, posts = cr.mbuf, list(tr.outbox)
        tr.outbox.clear()
        for ch in dict.fromkeys(p[0] for p in posts):
            mine = [p for p in posts if p[0] == ch]
            pairs = tr.ring_f if ch == SEND_PLUS else tr.ring_b
            if len(mine) > 1 and ch in prog.periodic.plan.shared and _same_avals(p[2] for p in mine):
                # at most one real message on this channel per device and tick (the plan's ``shared``): the
                # one
                # the device sends travels, and lands in every posting lane's slot -- the real one, and the
                # scratch slot of the lanes that receive nothing here
                msg = mine[0][2]
                for _, _, other, sends in mine[1:]:
                    msg = where(sends, other, msg)
                got = send(prog, tr, msg, pairs)
                for _, slot, _, _ in mine:
                    mbuf = write(mbuf, slot, got)
                continue
            for _, slot, msg, _ in mine:
                mbuf = write(mbuf, slot, send(prog, tr, msg, pairs))
        return cr._replace(mbuf=mbuf)

    def last_forward(self, prog, last, msg, dy, gq, t_out, gt, cnt, cr):
        """The last stage's forward outputs: dL/dy leaves as the lane's message (kept in the plan's slot); the
        head's gradient summed over the call."""
        cr = cr._replace(
            gpost=jax.tree.map(lambda n, o: o + jnp.where(last, n, 0).astype(o.dtype), gq, cr.gpost)
        )
        return cr, (where(last, dy, msg), where(last, gt, t_out), jnp.where(last, cnt, 0.0))

    def idle_message(self, prog, blank, blank_tie):
        return (blank, blank_tie, jnp.full((), jnp.nan if prog.nan_bubbles else 0, jnp.float32))

    def backward_in(self, prog, tr, rr, cr, cb, gb):
        """``(dy_in, tied gradient in, count, stash slot)`` of the B lane."""
        dy_in, tb_in, cnt = (read(a, rr[prog.KB, ROUTE["in"]]) for a in cr.mbuf)
        return dy_in, tb_in, cnt, rr[prog.KB, ROUTE["stash"]]

    def backward_out(self, prog, tr, t, rr, cr, send_b):
        return cr._replace(mbuf=self.deliver(prog, tr, prog.KB, rr[prog.KB], send_b, cr.mbuf))

    # what a B lane reads: dL/dy and the tied arrays' gradient arrived as its message; the head's gradient
    # was summed at the forwards (None: nothing to add)
    def last_dy(self, prog, cr, last, dy_in):
        return dy_in

    def last_tie_grad(self, prog, cr, last, t_in):
        return t_in

    def last_head_grad(self, prog, cr, last, lp):
        return None


class Registers:
    """Messages in per-tick registers, chunks wrapping around through ring-indexed buffers (module
    docstring)."""

    name = "registers"

    def micro_batches(self, prog, base, n_fed, batch, carry):
        """``(mb_of, carry)``: this call's micro-batches go to ring slots ``(base + n_fed + j) mod C``
        (counted only when fed); micro-batch ``g`` is read from slot ``(base + g) mod C``."""
        M, C = prog.M, prog.C
        batch = jax.tree.map(lambda a: a.reshape((M, a.shape[0] // M) + a.shape[1:]), batch)
        carry = carry._replace(
            ring=lax.fori_loop(
                0,
                M,
                lambda j, r: jax.tree.map(lambda rb, b: write(rb, (base + n_fed + j) % C, b[j]), r, batch),
                carry.ring,
            )
        )
        ring_buf = carry.ring
        return (lambda g: jax.tree.map(lambda a: read(a, (base + g) % C), ring_buf)), carry

    def head_grad_to_sums(self, prog, tr, lps, oss, pss, carry):
        return pss  # the head's gradient joined each last-stage backward's

    def lanes(self, prog, tr, t, flags):
        return [True] * len(prog.kinds), None

    def exchange(self, prog, tr, cr):
        """Registers move in their lanes' own ``ppermute`` (a periodic table has one F and one B a tick)."""
        return cr

    def forward_in(self, prog, tr, t, rr, cr, cf, gf):
        x_in, t_in, sf = cr.recv_f, cr.tie_f, slot_of(prog, tr, cf, gf)
        if prog.K > 1:  # device 0's later chunks read the last device's output from the wrap buffer
            wx, wt = jax.tree.map(lambda a: read(a, gf % prog.C), cr.wrap_f)
            on_wrap = (tr.me == 0) & (cf > 0)
            x_in, t_in = where(on_wrap, wx, x_in), where(on_wrap, wt, t_in)
        return x_in, t_in, sf

    def forward_out(self, prog, tr, t, rr, cr, send_f):
        if prog.D == 1 and prog.K == 1:
            return cr
        recv_f, tie_f = send(prog, tr, send_f, tr.ring_f)
        cr = cr._replace(recv_f=recv_f, tie_f=tie_f)
        if prog.K > 1:
            runs_s, c_s, g_s = op_of(prog, tr, t, prog.D - 1, 0)
            slot = jnp.where((tr.me == 0) & runs_s & (c_s < prog.K - 1), g_s % prog.C, prog.C)
            cr = cr._replace(wrap_f=jax.tree.map(lambda a, v: write(a, slot, v), cr.wrap_f, (recv_f, tie_f)))
        return cr

    def last_forward(self, prog, last, msg, dy, gq, t_out, gt, cnt, cr):
        """The last stage keeps its dL/dy, head gradient, tied gradient and count for its B."""
        cr = cr._replace(
            dy_own=where(last, dy, cr.dy_own),
            gpost=jax.tree.map(lambda n, o: jnp.where(last, n, o), gq, cr.gpost),
            gtie=where(last, gt, cr.gtie),
            cnt_own=jnp.where(last, cnt, cr.cnt_own),
        )
        return cr, (msg, t_out)

    def idle_message(self, prog, blank, blank_tie):
        return (blank, blank_tie)

    def backward_in(self, prog, tr, rr, cr, cb, gb):
        dy_in, tb_in, cnt, sb = cr.recv_b, cr.tie_b, cr.cnt_b, slot_of(prog, tr, cb, gb)
        if prog.K > 1:  # the last device's earlier chunks read device 0's gradient from the wrap buffer
            wd, wt, wc = jax.tree.map(lambda a: read(a, gb % prog.C), cr.wrap_b)
            on_wrap = (tr.me == prog.D - 1) & (cb < prog.K - 1)
            dy_in, tb_in, cnt = (
                where(on_wrap, wd, dy_in),
                where(on_wrap, wt, tb_in),
                jnp.where(on_wrap, wc, cnt),
            )
        cnt = jnp.where(is_last(prog, tr, cb), cr.cnt_own, cnt)
        return dy_in, tb_in, cnt, sb

    def backward_out(self, prog, tr, t, rr, cr, send_b):
        if prog.D == 1 and prog.K == 1:
            return cr
        recv_b, tie_b, cnt_b = send(prog, tr, send_b, tr.ring_b)
        cr = cr._replace(recv_b=recv_b, tie_b=tie_b, cnt_b=cnt_b)
        if prog.K > 1:
            runs_s, c_s, g_s = op_of(prog, tr, t, 0, 1)
            slot = jnp.where((tr.me == prog.D - 1) & runs_s & (c_s > 0), g_s % prog.C, prog.C)
            cr = cr._replace(
                wrap_b=jax.tree.map(lambda a, v: write(a, slot, v), cr.wrap_b, (recv_b, tie_b, cnt_b))
            )
        return cr

    # the last stage's B reads its own registers; the head's gradient joins its backward's gradient
    def last_dy(self, prog, cr, last, dy_in):
        return where(last, cr.dy_own, dy_in)

    def last_tie_grad(self, prog, cr, last, t_in):
        return where(last, cr.gtie, t_in)

    def last_head_grad(self, prog, cr, last, lp):
        return jax.tree.map(lambda a, q: jnp.where(last, a, 0).astype(q.dtype), cr.gpost, lp[2])


ROUTINGS = {"slots": PlanSlots(), "registers": Registers()}
