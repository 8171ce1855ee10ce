"""What a train step checks, on the device, without making the host wait.

A step's program computes, beside its result, a small int32 *status* vector: per floating batch field
whether it holds a NaN/Inf value, per field of ``PipelineModel(integer_inputs=...)`` the number of ids out of
range with the smallest and largest id, and one flag for a non-finite loss (or gradient norm).  A step whose
batch fails its checks keeps its whole input state -- weights, optimizer state, step counter, in-flight
micro-batches; a synchronous step with a non-finite loss applies no update.  The state is kept by a
``lax.cond`` around the update (the synchronous runners) or around the whole program
(:meth:`StepChecks.guard`: the no-flush methods, whose updates happen inside it), never by a select of old and
new values: a select needs the old buffers alive beside the new ones, and XLA then copies every donated
optimizer-state buffer each step (measured: two 16 MiB copies, +50% bytes accessed, on AdamW over 4 x 1024^2
weights).

The host never reads the status inside the call that made it.  :class:`PendingStatus` starts its copy to the
host (``copy_to_host_async``) after dispatch; ``step`` and ``loss_and_grad`` read, before they dispatch, the
statuses of the calls already done and wait only for the oldest of :data:`IN_FLIGHT` unread ones, so the host
runs up to two steps ahead of the device; ``drain``, ``params``, ``Checkpointer.save`` and
``pipe.check()`` read them all.  A failure raises the :class:`~jaxpipe.errors.ConfigError` that names its call
and the field.  The read is an explicit ``jax.device_get``: it passes ``jax.transfer_guard("disallow")``.
"""

from __future__ import annotations

import atexit
import collections
import sys
import weakref
from typing import Callable, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError


#: the metrics key a guarded program returns its status under (popped before a user sees the metrics)
STATUS = "_status"


def pop_status(metrics):
    """``(metrics without the status, status)``."""
    metrics = dict(metrics)
    return metrics, metrics.pop(STATUS)


class Field(NamedTuple):
    kind: str  # "finite" (count) or "ids" (count, lo, hi)
    name: str  # the batch key path, as the user reads it
    bound: Optional[int]


class StepChecks:
    """The checks of one pipeline: ``check_inputs`` (NaN/Inf in floating fields, ids of ``integer_inputs`` in
    range) and ``check_loss`` (a non-finite loss or gradient norm is an error, not an update).  ``opt_out``
    names the argument that turns the input checks off, for the messages."""

    def __init__(
        self, integer_inputs, check_inputs: bool, check_loss: bool, opt_out: str, keeps_state: bool = True
    ):
        self.integer_inputs = dict(integer_inputs or {})
        self.check_inputs, self.check_loss, self.opt_out = bool(check_inputs), bool(check_loss), opt_out
        self.keeps_state = keeps_state
        #: a non-finite loss changes nothing (the synchronous runners and AvgPipe gate their update on it); a
        #: program under :meth:`guard` finds it only after its updates landed inside the pipeline
        self.loss_keeps_state = True

    @property
    def active(self) -> bool:
        return self.check_inputs or self.check_loss

    def fields(self, batch) -> List[Field]:
        """The checked fields of ``batch`` in status order (pure Python: shapes and dtypes only)."""
        if not self.check_inputs:
            return []
        out = []
        for k, v in jax.tree_util.tree_flatten_with_path(batch)[0]:
            name = jax.tree_util.keystr(k) or "batch"
            top = k[0].key if k and hasattr(k[0], "key") else None
            if jnp.issubdtype(_dtype(v), jnp.floating):
                out.append(Field("finite", name, None))
            elif top in self.integer_inputs and len(k) == 1:
                out.append(Field("ids", repr(top), self.integer_inputs[top]))
        return out

    def input_status(self, batch):
        """The batch's part of the status vector (traced inside the step's program) and ``ok``: every check
        of the batch passed."""
        parts = [jnp.zeros((0,), jnp.int32)]
        leaves = {
            jax.tree_util.keystr(k) or "batch": v for k, v in jax.tree_util.tree_flatten_with_path(batch)[0]
        }
        for f in self.fields(batch):
            if f.kind == "finite":
                parts.append(_any_nonfinite(leaves[f.name])[None])
            else:
                v = leaves[f"[{f.name}]"]
                bad = (v < 0) if f.bound is None else (v < 0) | (v >= f.bound)
                parts.append(
                    jnp.stack(
                        [
                            jnp.sum(bad).astype(jnp.int32),
                            jnp.min(v).astype(jnp.int32),
                            jnp.max(v).astype(jnp.int32),
                        ]
                    )
                )
        return jnp.concatenate(parts), ~_any(p[0] > 0 for p in parts[1:])

    def checked(self, batch, mesh):
        """``(status, ok, batch)``: :meth:`input_status`, and -- on XLA CPU, over several devices -- the batch
        made to depend on the whole status, so everything computed from it waits for the status's reductions.
        Trap (XLA CPU): the status's all-reduces over a sharded batch depended on nothing else, and the CPU
        runtime, which runs independent instructions in any order, ran them before the pipeline's loop on one
        device and after it on another; each waited in a different collective and the step deadlocked (CI,
        WPipe on stage x data x tensor).  An optimization barrier does not order them (XLA removes it before
        the runtime sees the program, measured).  So the batch's smallest leaf goes through a select on a
        predicate computed from every entry of the status (a batch that failed its checks gets that leaf
        zeroed; its step is refused or reported anyway): every loop reading the batch reads that leaf.  One
        device, or another platform (a device runs its program in order): the batch as given, no cost."""
        inputs, ok = self.input_status(batch)
        if not self.check_inputs or jax.devices()[0].platform != "cpu" or mesh.size == 1:
            return inputs, ok, batch
        leaves, tree = jax.tree.flatten(batch)
        k = min(range(len(leaves)), key=lambda i: np.size(leaves[i]))
        # the whole vector (its min / max reductions too) feeds the predicate: always true for ints, not
        # folded
        keep = ok & jnp.isfinite(jnp.sum(inputs.astype(jnp.float32)))
        leaves[k] = jnp.where(keep, leaves[k], jnp.zeros_like(leaves[k]))
        return inputs, ok, jax.tree.unflatten(tree, leaves)

    def status(self, inputs, loss_bad=None):
        """The whole status vector: ``inputs`` (:meth:`input_status`) and the loss flag (reported where
        ``check_loss``)."""
        lb = jnp.asarray(False) if loss_bad is None or not self.check_loss else loss_bad
        return jnp.concatenate([inputs, lb.astype(jnp.int32)[None]])

    def guard(self, run: Callable, mesh, loss_bad: Optional[Callable] = None) -> Callable:
        """A program whose state updates happen inside it (the no-flush methods, Cyclic DP): ``run(state,
        batch,
        *rest) -> (state, metrics)`` runs only where the batch passed its checks (``lax.cond``: the state's
        buffers are updated in place, no copy of them is kept for the other branch); otherwise the state comes
        back as given.  The status is in ``metrics[STATUS]`` (the runner pops it: :func:`pop_status`).
        Where ``keeps_state`` is False the program runs unconditionally and the failure is only reported
        (Cyclic DP: its ring lands stages in place into stacked buffers, which inside a conditional XLA copies
        -- temp
        2.2x, measured)."""
        if loss_bad is not None:
            self.loss_keeps_state = False

        def guarded(state, batch, *rest):
            inputs, ok, batch = self.checked(batch, mesh)
            if not (self.check_inputs and self.keeps_state):
                new, metrics = run(state, batch, *rest)
            else:
                shapes = jax.eval_shape(lambda s: run(s, batch, *rest)[1], state)
                idle = jax.tree.map(
                    lambda a: jnp.full(
                        a.shape, jnp.nan if jnp.issubdtype(a.dtype, jnp.floating) else 0, a.dtype
                    ),
                    shapes,
                )
                new, metrics = jax.lax.cond(ok, lambda s: run(s, batch, *rest), lambda s: (s, idle), state)
                if "step" in metrics and hasattr(new, "step"):
                    metrics = {**metrics, "step": new.step}
            return new, {
                **metrics,
                STATUS: self.status(inputs, None if loss_bad is None else loss_bad(metrics)),
            }

        return guarded

    # ------------------------------------------------------------------ host side
    def kept_state(self, fields: List[Field], status: np.ndarray) -> bool:
        """Whether the call whose read-back ``status`` failed left its input state as it was (an input check
        is kept back where ``keeps_state``; a non-finite loss where ``loss_keeps_state``)."""
        pos, inputs_failed = 0, False
        for f in fields:  # a finite flag, or an id count with its smallest and largest id
            inputs_failed |= bool(status[pos])
            pos += 1 if f.kind == "finite" else 3
        return self.keeps_state if inputs_failed else self.loss_keeps_state

    @staticmethod
    def _kept(kept: bool) -> str:
        return (
            "it changed nothing: the weights, optimizer state, step counter and any micro-batches in flight "
            "are as before it"
            if kept
            else "that step ran (this method's state is not kept back; a checkpoint of it, or of any state "
            "derived from it, is refused): restore the last checkpoint"
        )

    def message(self, fields: List[Field], status: np.ndarray, where: str, batch_fields) -> Optional[str]:
        """The error for a read-back status, or None where every check passed."""
        nonfinite, ids, pos = [], [], 0
        for f in fields:
            if f.kind == "finite":
                if status[pos]:
                    nonfinite.append(f.name)
                pos += 1
            else:
                n, lo, hi = (int(x) for x in status[pos : pos + 3])
                if n:
                    ids.append((f, lo, hi))
                pos += 3
        kept = self._kept(self.keeps_state if (nonfinite or ids) else self.loss_keeps_state)
        if nonfinite:
            return (
                f"{where}: the batch holds NaN or Inf in {', '.join(nonfinite)}, which a pipeline would "
                "spread "
                f"into every stage's weights; {kept}. Clean the data (np.nan_to_num, drop the rows), or pass "
                f"{self.opt_out} if non-finite inputs are intended"
            )
        if ids:
            f, lo, hi = ids[0]
            bad = lo if lo < 0 else hi
            return (
                f"{where}: batch[{f.name}] holds {bad}, outside [0, "
                f"{f.bound if f.bound is not None else 'inf'}) "
                "that the model accepts "
                f"({'negative ids read the last rows' if bad < 0 else 'past the table: a NaN loss'}). "
                f"{kept}. Fix the data, or declare the right size in integer_inputs= (of PipelineModel, "
                "from_nnx or from_linen); "
                f"{self.opt_out} turns the check off"
            )
        if status[pos]:
            undeclared = [k for k in batch_fields if k not in self.integer_inputs]
            cause = (
                f" Likely cause: batch field(s) {undeclared} hold integer ids the model does not declare: a "
                f"label or token id outside its table gives a NaN loss (-1 silently reads the last row); "
                f"declare them, e.g. integer_inputs={{{undeclared[0]!r}: num_classes}} (an argument of "
                "PipelineModel, from_nnx and from_linen), and "
                f"the batch is checked before it trains."
                if undeclared
                else ""
            )
            return (
                f"{where}: the loss or the gradient norm is NaN or Inf; {kept}.{cause} Lower the learning "
                f"rate or use loss scaling if the model diverged; Pipeline(..., skip_nonfinite=True) skips "
                f"such steps and goes on (synchronous schedules)"
            )
        return None


def _any(xs):
    """``x0 | x1 | ...`` of traced booleans."""
    out = jnp.asarray(False)
    for x in xs:
        out = out | x
    return out


def _any_nonfinite(v):
    """1 where ``v`` holds a NaN or Inf, else 0, in one fused read of ``v``: ``sum(v * 0)`` is NaN exactly
    where some entry is (Inf * 0 is NaN).  The count, ``sum(~isfinite(v))``, wrote an int32 copy of the batch
    on XLA CPU (its large reductions run as reduce-windows over a materialised input), and counting only on
    failure (a conditional) is charged in full by XLA's cost analysis: the message names the field only."""
    return (~jnp.isfinite(jnp.sum(v - v))).astype(jnp.int32)


def _dtype(v):
    d = getattr(v, "dtype", None)
    return np.asarray(v).dtype if d is None else d


def integer_fields(batch) -> List[str]:
    """Top-level batch keys holding integers (candidates for ``integer_inputs``)."""
    if not isinstance(batch, dict):
        return []
    return [k for k, v in batch.items() if jnp.issubdtype(_dtype(v), jnp.integer)]


#: statuses a pipeline leaves unread when it dispatches a call: the host runs up to this many calls ahead of
#: the device before it waits for the oldest one's status.  1: every call waits for the one before
#: it and reports its failure at once (a debugging aid; ``jaxpipe.checks.on_device.IN_FLIGHT = 1``)
IN_FLIGHT = 2


def read_status(status) -> np.ndarray:
    """The host copy of a step's status: an explicit ``jax.device_get`` (it waits where the step is not
    done)."""
    return np.asarray(jax.device_get(status))


def is_ready(status) -> bool:
    """Whether the step that computes ``status`` is done (reading it then costs no wait)."""
    try:
        return bool(status.is_ready())
    except AttributeError:  # a host array
        return True


_UNSET = object()


class _Call:
    """One dispatched call: its status (until read), what the message needs, the state it returned (a weak
    reference, set by :meth:`PendingStatus.track`), the unread call whose state it ran on, and -- once read
    and refused with its effect kept -- the refusal."""

    __slots__ = ("status", "fields", "where", "batch_fields", "out", "out_leaves", "parent", "refused")

    def __init__(self, status, fields, where, batch_fields):
        self.status, self.fields, self.where, self.batch_fields = status, fields, where, batch_fields
        self.out = self.out_leaves = self.parent = self.refused = None


class PendingStatus:
    """The statuses of the dispatched calls, read back later (module docstring): :meth:`poll` before a call
    is dispatched reads those that are ready and waits only while :data:`IN_FLIGHT` are unread, so the host
    runs ahead of the device; :meth:`check` reads them all.  A failure names its call (``step() #7``) and,
    where it is read calls later, what those calls ran on.

    Where the method's state is not kept back (``keeps_state=False``: WPipe, a no-flush method on a mesh whose
    conditionals may not hold collectives, Cyclic DP), the state a refused step returned holds that step's
    effect.  It is remembered (:meth:`track`), and so is every state later derived from it by a step or a
    drain -- also one derived before the refusal was read: :meth:`refusal` names the refused step for such a
    state, and ``Checkpointer.save`` refuses it for as long as it lives.  A restored checkpoint or
    a fresh ``init()`` is a state of its own, never tainted.  A status still unread when the interpreter exits
    is read then and reported on stderr."""

    def __init__(self, checks: StepChecks):
        self.checks = checks
        self._queue = collections.deque()  # the unread calls, oldest first
        self._newest = None  # the last call put (read or not), until tracked
        self._counts = {}  # per kind of call ("step()"...): how many were put
        self._tainted = {}  # id(leaf) -> (weak reference, the refusal's message)
        # the values of every refused state (:func:`value_digest`) -> the message: a copy of one, or a state
        # put on other devices, holds the same values and is refused too
        self._tainted_values = {}
        # states checked clean by value while a refusal lives (id(leaf) -> weak reference), and those derived
        # from them: each is checked once, not at every step
        self._clean = {}
        _LIVE.add(self)

    def put(self, status, batch, where: str) -> None:
        """Remember ``status`` of a call ``where`` (``"step()"``...) on ``batch``; its copy to the host
        starts."""
        if not self.checks.active:
            return
        try:
            status.copy_to_host_async()
        except AttributeError:
            pass
        n = self._counts[where] = self._counts.get(where, 0) + 1
        self._newest = _Call(status, self.checks.fields(batch), f"{where} #{n}", integer_fields(batch))
        self._queue.append(self._newest)

    def track(self, state_in, state_out, why_in=_UNSET) -> None:
        """``state_out`` came from ``state_in`` by the last call put: it inherits a refusal of ``state_in``
        (or of the call itself, once read) and is the state a refusal of that call will name.  ``why_in``: the
        :meth:`refusal` of ``state_in`` taken before the call (the call consumed its arrays: their values can
        no longer be read)."""
        leaf = _key_leaf(state_out)
        if leaf is None:
            return
        why = self.refusal(state_in) if why_in is _UNSET else why_in
        call, self._newest = self._newest, None
        if call is not None:
            src = _key_leaf(state_in)
            call.out = _weak(leaf)
            # the leaves until the status is read (their values taint a refused state; dropped at the read, so
            # the chain of parents holds no state: a donated one's buffers are gone anyway)
            call.out_leaves = tuple(jax.tree.leaves(state_out))
            call.parent = next(
                (c for c in self._queue if c is not call and c.out is not None and c.out() is src), None
            )
            if call.refused is not None:
                self._taint(leaf, call.refused, state_out)
        if why is not None:
            self._taint(leaf, why, state_out)
        elif self._tainted_values and id(_key_leaf(state_in)) in self._clean:
            self._clean[id(leaf)] = _weak(leaf, lambda _, k=id(leaf): self._clean.pop(k, None))

    def refusal(self, state) -> Optional[str]:
        """The message of the refused step whose effect ``state`` holds (None for a clean state): the state a
        refused call returned, one derived from it by a step or a drain, or one holding the same values (a
        copy, a ``device_put``; compared only while a refused state was seen, once per state)."""
        leaf = _key_leaf(state)
        if leaf is None:
            return None
        entry = self._tainted.get(id(leaf))
        if entry is not None and entry[0]() is leaf:
            return entry[1]
        if not self._tainted_values:
            return None
        known = self._clean.get(id(leaf))
        if known is not None and known() is leaf:
            return None
        digest = value_digest(jax.tree.leaves(state))
        if digest is None:  # a consumed state: its values are gone (require_live names it)
            return None
        why = self._tainted_values.get(digest)
        if why is None:
            self._clean[id(leaf)] = _weak(leaf, lambda _, k=id(leaf): self._clean.pop(k, None))
        return why

    def require_saveable(self, state) -> None:
        """Every call's checks (:meth:`check`), then a ConfigError where ``state`` holds a refused step's
        effect (:meth:`refusal`): what ``Checkpointer.save`` asks of a pipeline before writing ``state``."""
        self.check()
        why = self.refusal(state)
        if why is not None:
            raise ConfigError(
                f"refusing to checkpoint this state: it holds the effect of a refused step ({why})"
            )

    def _taint(self, leaf, msg: str, state=None) -> None:
        """Mark the state whose key leaf is ``leaf``, and its values where ``state`` (or its leaves) is
        given."""
        key = id(leaf)
        self._tainted[key] = (_weak(leaf, lambda _: self._tainted.pop(key, None)), msg)
        self._clean.pop(key, None)
        if state is not None:
            digest = value_digest(jax.tree.leaves(state))
            if digest is not None:
                self._tainted_values[digest] = msg

    def poll(self) -> None:
        """Before a call is dispatched: read the statuses that are ready, and wait for the oldest only while
        :data:`IN_FLIGHT` or more are unread; raise the first failure read."""
        if isinstance(IN_FLIGHT, bool) or not isinstance(IN_FLIGHT, int) or IN_FLIGHT < 1:
            raise ConfigError(
                f"jaxpipe.checks.on_device.IN_FLIGHT={IN_FLIGHT!r}: give a whole number >= 1 (the calls "
                f"the host runs ahead of the device: 2 by default, 1 to wait for every call)"
            )
        while self._queue and (len(self._queue) >= max(IN_FLIGHT, 1) or is_ready(self._queue[0].status)):
            self._read(self._queue.popleft())

    def check(self) -> None:
        """Read every unread status (waiting for those calls) and raise the first failure."""
        while self._queue:
            self._read(self._queue.popleft())

    def _read(self, call: _Call) -> None:
        status = read_status(call.status)
        call.status = None
        msg = self.checks.message(call.fields, status, call.where, call.batch_fields)
        if not msg:
            call.out_leaves = None
            return
        kept = self.checks.kept_state(call.fields, status)
        later = list(self._queue)
        if later:
            msg += f". Read {len(later)} call(s) later (the host runs ahead of the device): " + (
                "they ran on the state as it was before it"
                if kept
                else "those that ran on its state hold its effect too, and are refused by save as well"
            )
        if not kept:
            self._refuse(call, msg)
            for c in later:  # the calls that ran on its state, or on one derived from it
                if c.parent is not None and c.parent.refused is not None:
                    self._refuse(c, msg)
        call.out_leaves = None
        raise ConfigError(msg)

    def _refuse(self, call: _Call, msg: str) -> None:
        """``call``'s state holds a refused step's effect: mark it (now, or when :meth:`track` sees it)."""
        call.refused = msg
        out = call.out() if call.out is not None else None
        if out is not None:
            self._taint(out, msg, call.out_leaves)

    def unread_failure(self) -> Optional[str]:
        """The message of the first unread failed call (None where every unread call passed)."""
        try:
            self.check()
        except ConfigError as e:
            return str(e)
        return None


def value_digest(leaves) -> Optional[tuple]:
    """What identifies a state's values: each array leaf's shape, dtype and two on-device checksums of its
    bits (:func:`jaxpipe.checkpoint.checksums`: one small read back).  None where a leaf was consumed (donated
    to a step): its values are gone."""
    from ..checkpoint import checksums

    arrays = [a for a in leaves if hasattr(a, "dtype") and hasattr(a, "shape")]
    if any(getattr(a, "is_deleted", lambda: False)() for a in arrays):
        return None
    sums = checksums(arrays)
    return tuple((tuple(a.shape), str(a.dtype), tuple(v)) for a, v in zip(arrays, sums.values()))


def _key_leaf(state):
    """The leaf that identifies a train state (its first array), or None."""
    leaves = jax.tree.leaves(state)
    return leaves[0] if leaves else None


def _weak(leaf, callback=None):
    """A weak reference to ``leaf`` (a strong one where it has none: a NumPy array, kept alive with its
    mark)."""
    try:
        return weakref.ref(leaf, callback)
    except TypeError:
        return lambda: leaf


#: every PendingStatus alive, for the report at exit
_LIVE: "weakref.WeakSet[PendingStatus]" = weakref.WeakSet()


def _report_unread_at_exit() -> None:
    """At interpreter exit: a step whose checks failed and that no later call read is reported on stderr."""
    for pending in list(_LIVE):
        try:
            msg = pending.unread_failure()
        except Exception:  # the runtime may already be going down: nothing more to say
            continue
        if msg:
            print(
                f"jaxpipe: a step of this run was refused and nothing read it before exit: {msg}",
                file=sys.stderr,
                flush=True,
            )


atexit.register(_report_unread_at_exit)


def pending_for(model, check_inputs: bool, check_loss: bool, owner: str, keeps_state: bool = True):
    """``(StepChecks, PendingStatus)`` of a pipeline of ``model`` (``owner``: the class a user configures, for
    the messages' opt-out hint)."""
    checks = StepChecks(
        model.integer_inputs, check_inputs, check_loss, f"{owner}(..., check_inputs=False)", keeps_state
    )
    return checks, PendingStatus(checks)


def gate(ok, update: Callable, operands: tuple, by_select: bool = False):
    """``update(*operands)`` where ``ok``, else ``operands`` unchanged: a ``lax.cond``, so XLA updates the
    donated buffers in place -- or, where a conditional holding collectives is refused (``by_select``: model
    axes on XLA CPU, :func:`jaxpipe.sharding.branches_refused`), a select, which costs copies of the
    operands."""
    if by_select:
        new = update(*operands)
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, tuple(operands))
    return jax.lax.cond(ok, update, lambda *a: a, *operands)
