"""Where a stream's tick loop is cut (:mod:`.executor`): the ticks where accumulating policies land their
batch's update (in a scan or between scans) and, for a ring reduction, the ticks that may complete a sum.
Read off the replayed stream (:meth:`jaxpipe.schedules.periodic.Periodic.events`); pure Python + NumPy."""

from __future__ import annotations

from ..errors import ConfigError


def landing_segments(periodic, M: int, D: int):
    """The call's ticks cut into ``(start, stop, landing)`` scans so that only the ticks where some stage runs
    the B of a batch's last micro-batch compile the in-scan landing of an accumulating policy (one chunk).
    A call runs ``period * M`` ticks from a tick that is a multiple of that, so stage ``s`` lands at offset
    ``(tick(B, s, M - 1)) mod (period * M)`` of every call."""
    n = periodic.period * M
    offs = sorted({periodic.tick("B", s, M - 1) % n for s in range(D)})
    lo, hi = offs[0], offs[-1] + 1
    if hi - lo > n // 2:  # spread over the call: one scan that may land in every tick
        return [(0, n, True)]
    return [seg for seg in ((0, lo, False), (lo, hi, True), (hi, n, False)) if seg[1] > seg[0]]


def landing_points(periodic, M: int, chunk: int, policy, b: int = 4):
    """``(lag, tau)`` for a policy that lands between scans: batch ``q - lag``'s update lands at tick offset
    ``tau`` of call ``q`` (``tau = period * U``: after the call), after every device ran that batch's last B
    of ``chunk`` and before any op of batch ``q - lag + 1 + stale`` (the first to read the new version) --
    read off the replayed stream; a ConfigError when the timeline leaves no such point or makes more batches
    accumulate at once than the policy keeps."""
    T = periodic.call_ticks(M)
    ends = periodic.batch_ticks(M, chunk, b)["last_b"]
    calls = {t // T for t in ends}
    if len(calls) != 1:
        raise ConfigError(
            f"{policy.name}: stages finish a batch in different calls ({sorted(calls)}); it must "
            f'land inside the scan (landing="in_scan")'
        )
    q = calls.pop()
    start = max(t % T for t in ends) + 1
    first = min(periodic.batch_ticks(M, chunk, b + 1 + policy.stale)["first"])
    if first >= (q + 1) * T:
        tau = T
    elif first >= q * T + start:
        tau = start
    else:
        raise ConfigError(
            f"{policy.name}: with D={periodic.num_devices}, M={M} batch {b + 1 + policy.stale} "
            f"starts (tick {first}) before batch {b}'s update can land (tick {q * T + start})"
        )
    open_ = {}
    for t, d, kind, c, g in periodic.events(M, calls=b + 6):
        if c == chunk and kind == "B":
            open_.setdefault((t - tau) // T, set()).add(g // M)
    if max(len(v) for v in open_.values()) > policy.accumulators:
        raise ConfigError(
            f"{policy.name}: this timeline accumulates {max(len(v) for v in open_.values())} "
            f"batches at once; the policy keeps {policy.accumulators}"
        )
    return q - b, tau


def ring_phases(periodic, M: int, workers: int):
    """Per tick offset of a call: (may_land, may_update) -- whether the last worker (``workers - 1`` replica
    delays late) may complete a ring sum in that tick, or in the one before (the others land it then)."""
    T = periodic.call_ticks(M)
    tab = periodic.call_table(M)
    late = periodic.replica_delay * (workers - 1)
    upd = [bool(tab[(tau - late) % T, 0, 1, 0] >= 0) for tau in range(T)]
    return [(upd[(tau - 1) % T] and workers > 1, upd[tau]) for tau in range(T)]
