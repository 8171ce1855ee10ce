"""How a tick's messages are routed: one strategy object per program, chosen once (``Program.route``).

* :class:`PlanSlots` -- a stream of one call made from a lane plan (:func:`jaxpipe.schedules.lanes.plan`):
  every lane reads its input from the slot the plan gave it and writes its message where the plan says (kept
  on the device, or sent on one of the plan's channels, one ``ppermute`` each); the last stage's dL/dy is the
  F lane's message to its own B; the head's gradient is summed over the call.
* :class:`Registers` -- a periodic stream (the no-flush methods): one register per direction, consumed the
  tick after it was sent; the last stage keeps its dL/dy, head gradient and count in registers of its own;
  chunks wrap around the device ring through buffers indexed like the ring of micro-batches.

Both are stateless: every method reads the :class:`~.program.Program` ``prog`` and the
:class:`~.executor.Trace` ``trace`` it is given.  The tick (:mod:`.ticks`) and the lanes never ask which one
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
from .collectives import ppermute_bits
from .buffers import read, where, write


def send(prog, trace, x, pairs):
    """A lane's message to the next (previous) device: its bits, or APC-compressed activation/gradient.
    One device (chunks wrapping around on it): the message stays -- a collective over a one-device group
    is still a rendezvous of every device on XLA CPU (BUILD_NOTES, "The executor")."""
    if prog.D == 1:
        return x
    if len(x) == 3 and not prog.counting:
        # (message, tied arrays, count): a count only matters to (sum, count) losses (XLA drops an unused
        # one too; this does not rely on it)
        return tuple(send(prog, trace, x[:2], pairs)) + (x[2],)
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
        batch = jax.tree.map(
            lambda leaf: leaf.reshape((prog.M, leaf.shape[0] // prog.M) + leaf.shape[1:]), batch
        )
        return (lambda g: jax.tree.map(lambda leaf: read(leaf, g), batch)), carry

    def head_grad_to_sums(self, prog, trace, chunk_params, opt_states, policy_states, carry):
        """After the call: the head's gradient, summed over the call's last-stage forwards, to the first
        chunk's policy sums."""
        w0, p0, _ = chunk_params[0]
        g0 = (zero_like(prog, trace, w0), zero_like(prog, trace, p0), carry.gpost)
        return (
            prog.policies[0].update(
                g0,
                *chunk_params[0:1],
                opt_states[0],
                policy_states[0],
                trace.base,
                trace.me,
                count=0.0 if prog.counting else None,
            )[2],
        ) + tuple(policy_states[1:])

    def lanes(self, prog, trace, tick, flags):
        """The lanes this scan compiles (its phase's ``flags``: 0 not compiled, 1 under a conditional, 2 busy
        on every device in every tick, run without one) and this device's route rows at tick ``t``."""
        return (
            [2 if li in flags.full else int(li in flags.used) for li in range(len(prog.kinds))],
            jnp.asarray(prog.routes)[tick % prog.num_ticks, trace.me],
        )

    def forward_in(self, prog, trace, tick, route_row, lane, carry, chunk_f, mb_f):
        """``(x_in, tied_in, stash slot)`` of the F lane ``lane``."""
        x_in, t_in = (read(a, route_row[lane, ROUTE["in"]]) for a in carry.mbuf[:2])
        return x_in, t_in, route_row[lane, ROUTE["stash"]]

    def forward_out(self, prog, trace, tick, route_row, lane, carry, send_f):
        return carry._replace(mbuf=self.deliver(prog, trace, lane, route_row[lane], send_f, carry.mbuf))

    def paired_out(self, prog, trace, tick, route_row, carry, send_f, send_f2):
        """The F lane's and its F2 pair's messages (Chimera's forward doubling runs on lane plans only)."""
        return carry._replace(
            mbuf=self.deliver(
                prog,
                trace,
                prog.lane_f2,
                route_row[prog.lane_f2],
                send_f2,
                self.deliver(prog, trace, 0, route_row[0], send_f, carry.mbuf),
            )
        )

    def deliver(self, prog, trace, li, route_row, msg, mbuf):
        """Lane ``li``'s message kept on the device (written now, to the slot the plan gave it; ``rr``: this
        device's route row) and/or posted for the plan's channels: every lane's posts of a tick move together
        in the tick's one exchange (:meth:`exchange`)."""
        if prog.periodic.plan.keeps[li]:
            mbuf = write(mbuf, route_row[ROUTE["keep"]], msg)
        for ch in prog.periodic.plan.channels[li]:
            trace.outbox.append(
                (
                    ch,
                    route_row[ROUTE["recv_p" if ch == SEND_PLUS else "recv_m"]],
                    msg,
                    route_row[ROUTE["send"]] == ch,
                )
            )
        return mbuf

    def exchange(self, prog, trace, carry):
        """The tick's one exchange: every message its lanes posted moves now, after all of them
        ran, one ``ppermute`` per channel and message, and lands in its receive slot.  A message from another
        device is read the tick after it was sent at the earliest (the plan's rule), so nothing in the tick
        waited for it; and no device waits for a neighbour between its lanes -- a tick costs the slowest
        device's own actions, not the sum over lanes of each lane's slowest device."""
        mbuf, posts = carry.mbuf, list(trace.outbox)
        trace.outbox.clear()
        for ch in dict.fromkeys(p[0] for p in posts):
            mine = [p for p in posts if p[0] == ch]
            pairs = trace.ring_f if ch == SEND_PLUS else trace.ring_b
            if len(mine) > 1 and ch in prog.periodic.plan.shared and _same_avals(p[2] for p in mine):
                # at most one real message on this channel per device and tick (the plan's ``shared``): the
                # one the device sends travels, and lands in every posting lane's slot -- the real one, and
                # the scratch slot of the lanes that receive nothing here
                msg = mine[0][2]
                for _, _, other, sends in mine[1:]:
                    msg = where(sends, other, msg)
                got = send(prog, trace, msg, pairs)
                for _, slot, _, _ in mine:
                    mbuf = write(mbuf, slot, got)
                continue
            for _, slot, msg, _ in mine:
                mbuf = write(mbuf, slot, send(prog, trace, msg, pairs))
        return carry._replace(mbuf=mbuf)

    def last_forward(self, prog, last, msg, cotangent, grad_post, t_out, grad_tied, count, carry):
        """The last stage's forward outputs: dL/dy leaves as the lane's message (kept in the plan's slot); the
        head's gradient summed over the call."""
        carry = carry._replace(
            gpost=jax.tree.map(lambda n, o: o + jnp.where(last, n, 0).astype(o.dtype), grad_post, carry.gpost)
        )
        return carry, (
            where(last, cotangent, msg),
            where(last, grad_tied, t_out),
            jnp.where(last, count, 0.0),
        )

    def idle_message(self, prog, blank, blank_tie):
        return (blank, blank_tie, jnp.full((), jnp.nan if prog.nan_bubbles else 0, jnp.float32))

    def backward_in(self, prog, trace, route_row, lane, carry, chunk_b, mb_b):
        """``(dy_in, tied gradient in, count, stash slot)`` of the B lane ``lane``."""
        dy_in, tb_in, count = (read(a, route_row[lane, ROUTE["in"]]) for a in carry.mbuf)
        return dy_in, tb_in, count, route_row[lane, ROUTE["stash"]]

    def backward_out(self, prog, trace, tick, route_row, lane, carry, send_b):
        return carry._replace(mbuf=self.deliver(prog, trace, lane, route_row[lane], send_b, carry.mbuf))

    # what a B lane reads: dL/dy and the tied arrays' gradient arrived as its message; the head's gradient
    # was summed at the forwards (None: nothing to add)
    def last_dy(self, prog, carry, last, dy_in):
        return dy_in

    def last_tie_grad(self, prog, carry, last, t_in):
        return t_in

    def last_head_grad(self, prog, carry, last, params):
        return None


class Registers:
    """Messages in per-tick registers, chunks wrapping around through ring-indexed buffers (module
    docstring)."""

    name = "registers"

    def micro_batches(self, prog, base, n_fed, batch, carry):
        """``(mb_of, carry)``: this call's micro-batches go to ring slots ``(base + n_fed + j) mod C``
        (counted only when fed); micro-batch ``g`` is read from slot ``(base + g) mod C``."""
        M, C = prog.M, prog.ring_slots
        batch = jax.tree.map(lambda leaf: leaf.reshape((M, leaf.shape[0] // M) + leaf.shape[1:]), batch)
        carry = carry._replace(
            ring=lax.fori_loop(
                0,
                M,
                lambda j, r: jax.tree.map(lambda rb, b: write(rb, (base + n_fed + j) % C, b[j]), r, batch),
                carry.ring,
            )
        )
        ring_buf = carry.ring
        return (lambda g: jax.tree.map(lambda leaf: read(leaf, (base + g) % C), ring_buf)), carry

    def head_grad_to_sums(self, prog, trace, chunk_params, opt_states, policy_states, carry):
        return policy_states  # the head's gradient joined each last-stage backward's

    def lanes(self, prog, trace, tick, flags):
        return [True] * len(prog.kinds), None

    def exchange(self, prog, trace, carry):
        """Registers move in their lanes' own ``ppermute`` (a periodic table has one F and one B a tick)."""
        return carry

    def forward_in(self, prog, trace, tick, route_row, lane, carry, chunk_f, mb_f):
        x_in, t_in, slot_f = carry.recv_f, carry.tie_f, slot_of(prog, trace, chunk_f, mb_f)
        if prog.num_chunks > 1:  # device 0's later chunks read the last device's output from the wrap buffer
            wx, wt = jax.tree.map(lambda leaf: read(leaf, mb_f % prog.ring_slots), carry.wrap_f)
            on_wrap = (trace.me == 0) & (chunk_f > 0)
            x_in, t_in = where(on_wrap, wx, x_in), where(on_wrap, wt, t_in)
        return x_in, t_in, slot_f

    def forward_out(self, prog, trace, tick, route_row, lane, carry, send_f):
        if prog.D == 1 and prog.num_chunks == 1:
            return carry
        recv_f, tie_f = send(prog, trace, send_f, trace.ring_f)
        carry = carry._replace(recv_f=recv_f, tie_f=tie_f)
        if prog.num_chunks > 1:
            runs_s, c_s, g_s = op_of(prog, trace, tick, prog.D - 1, 0)
            slot = jnp.where(
                (trace.me == 0) & runs_s & (c_s < prog.num_chunks - 1), g_s % prog.ring_slots, prog.ring_slots
            )
            carry = carry._replace(
                wrap_f=jax.tree.map(
                    lambda leaf, value: write(leaf, slot, value), carry.wrap_f, (recv_f, tie_f)
                )
            )
        return carry

    def last_forward(self, prog, last, msg, cotangent, grad_post, t_out, grad_tied, count, carry):
        """The last stage keeps its dL/dy, head gradient, tied gradient and count for its B."""
        carry = carry._replace(
            dy_own=where(last, cotangent, carry.dy_own),
            gpost=jax.tree.map(lambda n, o: jnp.where(last, n, o), grad_post, carry.gpost),
            gtie=where(last, grad_tied, carry.gtie),
            cnt_own=jnp.where(last, count, carry.cnt_own),
        )
        return carry, (msg, t_out)

    def idle_message(self, prog, blank, blank_tie):
        return (blank, blank_tie)

    def backward_in(self, prog, trace, route_row, lane, carry, chunk_b, mb_b):
        dy_in, tb_in, count, slot_b = (
            carry.recv_b,
            carry.tie_b,
            carry.cnt_b,
            slot_of(prog, trace, chunk_b, mb_b),
        )
        if (
            prog.num_chunks > 1
        ):  # the last device's earlier chunks read device 0's gradient from the wrap buffer
            wd, wt, wc = jax.tree.map(lambda leaf: read(leaf, mb_b % prog.ring_slots), carry.wrap_b)
            on_wrap = (trace.me == prog.D - 1) & (chunk_b < prog.num_chunks - 1)
            dy_in, tb_in, count = (
                where(on_wrap, wd, dy_in),
                where(on_wrap, wt, tb_in),
                jnp.where(on_wrap, wc, count),
            )
        count = jnp.where(is_last(prog, trace, chunk_b), carry.cnt_own, count)
        return dy_in, tb_in, count, slot_b

    def backward_out(self, prog, trace, tick, route_row, lane, carry, send_b):
        if prog.D == 1 and prog.num_chunks == 1:
            return carry
        recv_b, tie_b, cnt_b = send(prog, trace, send_b, trace.ring_b)
        carry = carry._replace(recv_b=recv_b, tie_b=tie_b, cnt_b=cnt_b)
        if prog.num_chunks > 1:
            runs_s, c_s, g_s = op_of(prog, trace, tick, 0, 1)
            slot = jnp.where(
                (trace.me == prog.D - 1) & runs_s & (c_s > 0), g_s % prog.ring_slots, prog.ring_slots
            )
            carry = carry._replace(
                wrap_b=jax.tree.map(
                    lambda leaf, value: write(leaf, slot, value), carry.wrap_b, (recv_b, tie_b, cnt_b)
                )
            )
        return carry

    # the last stage's B reads its own registers; the head's gradient joins its backward's gradient
    def last_dy(self, prog, carry, last, dy_in):
        return where(last, carry.dy_own, dy_in)

    def last_tie_grad(self, prog, carry, last, t_in):
        return where(last, carry.gtie, t_in)

    def last_head_grad(self, prog, carry, last, params):
        return jax.tree.map(lambda leaf, q: jnp.where(last, leaf, 0).astype(q.dtype), carry.gpost, params[2])
