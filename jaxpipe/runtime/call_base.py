"""Where a tick's ops come from: the stream's call table read for a device and a lane, chunk positions,
the versions a chunk's policy offers.  Methods of the executor's per-trace
:class:`~jaxpipe.runtime.executor._Call`."""
from __future__ import annotations

import jax
import jax.numpy as jnp


class CallBase:
    def op_of(self, t, d, kind, r=None):
        """(runs, chunk, g): device ``d``'s op ``kind`` (0: F, 1: B) at tick ``t``, of micro-batch ``g``, on
        replica ``r`` (default: this one; it runs ``r * replica_delay`` ticks late)."""
        if self.periodic.replica_delay:
            t = t - (self.replica if r is None else r) * self.periodic.replica_delay
        u, shift = self.ctab[t % self.T, d, kind, 0], self.ctab[t % self.T, d, kind, 1]
        q = t // self.T - shift
        row = self.unit_tab[jnp.maximum(u, 0)]
        g = (q + jnp.where(kind in (0, self.KF2), row[1], row[2])) * self.M + row[3]     # W: the B's micro-batch
        return (u >= 0) & (q >= 0) & (g >= 0) & (g < self.n_fed), row[0], g

    def position(self, c: int):
        """The position code of this device's chunk ``c``: 1 first (pre), 2 last (loss), 3 both."""
        return self.is_first(c).astype(jnp.int32) + 2 * self.is_last(c).astype(jnp.int32)

    def pick(self, c, values):
        """``values[c]`` for a traced chunk index (scalars)."""
        out = values[0]
        for cc in range(1, self.K):
            out = jnp.where(c == cc, values[cc], out)
        return out

    def choices(self, g, lps, pss):
        """Per chunk: (version index, candidates) the policy chooses for micro-batch ``g`` on this device."""
        return [p.choose(lp, ps, self.base + g, self.me) for p, lp, ps in zip(self.policies, lps, pss)]

    def operands(self, ch, lps, pss):
        """The switch's weight operands: every chunk's candidates (each read in place by its branch) -- or, on
        a ring, the stacked candidates (``lps``, ``pss``: the stacks), each branch slicing its chunk (views
        sliced outside were materialised: 173 MiB of temp)."""
        if self.ring:
            return self.policies[0].choose(lps, pss, self.base, self.me)[1]
        return [cands for _, cands in ch]

    def per_chunk(self, lps, pss):
        """The chunks' (weights, policy state): views of the stacks on a ring, else as they are."""
        return (self.views(lps), self.views(pss)) if self.ring else (lps, pss)

    def candidate(self, cs, cc, w):
        return jax.tree.map(lambda a: a[cc], cs[w]) if self.ring else cs[cc][w]

    def errors_of(self, c, g, runs, pss):
        """1 where the op would read a version its chunk's policy no longer holds."""
        ok = [p.held(ps, self.base + g, self.me) if p.held is not None else jnp.asarray(True)
              for p, ps in zip(self.policies, pss)]
        return (runs & ~self.pick(c, ok)).astype(jnp.int32)
