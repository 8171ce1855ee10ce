"""The training loop for any model: ``jp.train(pipe, batches, steps=...)`` or :class:`Trainer`.

What a long job needs besides ``pipe.step``, for a :class:`~jaxpipe.Pipeline` of any model and method:

* checkpoints (Orbax, asynchronous) every ``checkpoint_every`` steps and at the end; a run that finds one
  resumes from it, its batches where the checkpoint left them (:mod:`jaxpipe.training.streams`);
* stops: SIGTERM (preemption) or SIGINT end the run after the step in flight, with a checkpoint -- every
  process of a multi-process job after the same step (:mod:`jaxpipe.training.stopping`); a worker of
  ``experiments.launch`` also stops when its launcher is gone and tells the launcher's watchdog of each step;
* a NaN or Inf loss or gradient: ``on_nonfinite="stop"`` raises :class:`NonFiniteLoss` naming the step and
  the stage where it first appears (an unpipelined replay) and the newest intact checkpoint; ``"skip"``
  (synchronous schedules, ``Pipeline(skip_nonfinite=True)``) skips such updates and counts them;
* evaluation every ``eval_every`` steps on held-out batches (the model's loss, plus ``evaluate``'s measures);
* progress (a bar on a terminal, a line every ``progress_every`` steps otherwise), ``metrics.jsonl``,
  TensorBoard event files, and ``summary.json`` in ``out_dir``;
* a step's loss read once the next step is dispatched (``overlap_steps``), so that the devices never wait
  for the host between steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

from jaxpipe.errors import ConfigError
from jaxpipe.training import streams
from jaxpipe.training.records import MetricsLog, TensorBoard
from jaxpipe.training.stopping import LaggedVote, Stop, guard_streams

#: the exit status of a job stopped by a signal (what a preempted process is expected to return)
STOPPED_EXIT = 143
#: seconds a checkpoint write in flight gets to finish when the run ends on an error (then it is abandoned,
#: the lock released and the error raised; the newest finished checkpoint stays readable)
CLOSE_ON_ERROR_S = 120.0


class NonFiniteLoss(RuntimeError):
    """A step's loss or gradient was NaN or Inf (``on_nonfinite="stop"``).

    Args:
        message: what happened and what to do.
        step: the step whose loss was not finite.
        stage: the model stage where the unpipelined replay first found a NaN (None where it finds none).
        last_checkpoint: the newest intact checkpoint's step, or None.
    """

    def __init__(self, message: str, step: int, stage: Optional[int], last_checkpoint: Optional[int]):
        super().__init__(message)
        self.step, self.stage, self.last_checkpoint = step, stage, last_checkpoint


@dataclasses.dataclass
class TrainOptions:
    """The loop's settings: the keyword arguments of :func:`train` and :class:`Trainer`, each checked by name
    before anything runs (:meth:`check`).

    Attributes:
        steps: optimizer steps in all (a resumed run takes the ones left).
        out_dir: where ``metrics.jsonl`` (one JSON line a step), ``summary.json`` and the TensorBoard
            events go.
        eval_every: evaluate on ``eval_batches`` every this many steps (0: only after the last step).
        checkpoint_dir: Orbax checkpoints of the whole train state; a run that finds one resumes from it.
        checkpoint_every: save every this many steps (0: only at the end and at a stop).
        checkpoint_keep: checkpoints kept (the oldest are deleted).
        on_nonfinite: ``"stop"`` (a NaN or Inf loss stops the run naming the step and the stage where it
            appeared) or ``"skip"`` (that update is skipped; synchronous schedules).
        progress: a bar on a terminal, a line every ``progress_every`` steps otherwise.
        progress_every: steps between progress lines when not on a terminal (0: a tenth of the run).
        tensorboard: ``"auto"`` (where tensorboardX is installed), ``"true"`` or ``"false"``.
        stop_grace_s: after a second SIGTERM / SIGINT, the seconds the stop-save may still take before the
            process exits.
        learning_rate: an optax schedule, logged as ``lr``.
        units: what the throughput counts (``"tokens"``, ``"images"``, ...).
        units_per_step: how many of them a step processes (default: the rows of a batch).
        exit_on_stop: a stop ends the process with status 143 once saved (False: :func:`train` returns).
        overlap_steps: read a step's loss and metrics once the next step is dispatched, so that the device
            never idles while the host logs one step and prepares the next (a step that saves, evaluates or
            ends the run is read before the next starts).  A stop -- a signal, a hook's request -- then
            takes effect after the step in flight, and a non-finite loss found one step late is replayed
            with the weights after the next step.  False: every step is read before the next starts.
        describe: the first entries of the summary (the model, the schedule, ...)."""

    steps: int
    out_dir: str = "runs/train"
    eval_every: int = 50  # 0: evaluate only after the last step
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0  # 0: only at the end (and at a stop)
    checkpoint_keep: int = 3
    on_nonfinite: str = "stop"  # "stop" | "skip"
    progress: bool = True
    progress_every: int = 0  # lines when not on a terminal; 0: a tenth of the run
    tensorboard: str = "auto"  # "auto" | "true" | "false"
    stop_grace_s: float = 60.0  # after a second signal, the stop-save's time before the process exits
    learning_rate: Optional[Callable[[int], Any]] = None  # an optax schedule: logged as "lr"
    units: str = "examples"  # what the throughput counts ...
    units_per_step: Optional[float] = None  # ... per step (default: the rows of a batch)
    exit_on_stop: bool = True  # a stop ends the process with status 143 once saved (False: returns)
    overlap_steps: bool = True  # read a step's metrics while the next step runs
    describe: Dict[str, Any] = dataclasses.field(default_factory=dict)  # first entries of the summary

    def check(self) -> None:
        """Every option's type and range, each a ConfigError naming the option, before anything runs."""
        from jaxpipe.checks.values import is_int

        for name, choices in (("on_nonfinite", ("stop", "skip")), ("tensorboard", ("auto", "true", "false"))):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r}: choose one of {', '.join(map(repr, choices))}"
                )
        for name, low in (
            ("steps", 0),
            ("eval_every", 0),
            ("checkpoint_every", 0),
            ("checkpoint_keep", 1),
            ("progress_every", 0),
        ):
            value = getattr(self, name)
            if not is_int(value):
                raise ConfigError(
                    f"{name}={value!r}: give a whole number (an int, e.g. {name}={max(low, 1)})"
                )
            if value < low:
                raise ConfigError(f"{name}={value}: must be at least {low}")
        per = self.units_per_step
        if per is not None and (isinstance(per, bool) or not isinstance(per, (int, float)) or not per > 0):
            raise ConfigError(
                f"units_per_step={per!r}: give a positive number (what one step processes), or None "
                f"for the batch's rows"
            )
        if self.learning_rate is not None and not callable(self.learning_rate):
            raise ConfigError(
                f"learning_rate={self.learning_rate!r}: give the optax schedule the optimizer uses "
                f"(a function of the step), or None"
            )
        if not isinstance(self.units, str) or not isinstance(self.describe, dict):
            raise ConfigError(
                f"units={self.units!r} / describe={type(self.describe).__name__}: give a name (str) "
                f"and a dict"
            )
        for name in ("overlap_steps",):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: give True or False")
        grace = self.stop_grace_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < float("inf"):
            raise ConfigError(f"stop_grace_s={grace!r}: give seconds >= 0")
        for name in ("out_dir", "checkpoint_dir"):
            value = getattr(self, name)
            if value is None and name == "checkpoint_dir":
                continue
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise ConfigError(f"{name}={value!r}: give a directory path")
            check_directory(os.fspath(value), name)


def check_directory(path: str, what: str) -> None:
    """A ConfigError where ``path`` cannot be a directory this run writes to: a file, or a path under a
    file."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"{what}={path}: a file is there, not a directory; give a directory path (it is created "
            f"if missing)"
        )
    from jaxpipe.checks.values import file_in_the_way

    blocker = file_in_the_way(path)
    if blocker:
        raise ConfigError(
            f"{what}={path}: {blocker} is a file, so no directory can be made under it; give another path"
        )


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        state: the final state (drained: nothing in flight).
        step: the last step taken (or the checkpoint's, if there was nothing to do).
        summary: the run's summary (losses, throughput, times), or None when there was nothing to do.
        stopped: the stop's cause (a signal's name, a hook's reason) when the run stopped before ``steps``."""

    state: Any  # the final PipelineState (drained: nothing in flight)
    step: int  # the last step taken (or the checkpoint's, if there was nothing to do)
    summary: Optional[dict]  # None when there was nothing to do
    stopped: Optional[str] = None  # the stop's cause (a signal's name, ...) when stopped before `steps`


def train(
    pipe,
    batches,
    *,
    eval_batches: Sequence[Any] = (),
    evaluate: Optional[Callable] = None,
    hooks: Sequence[Callable] = (),
    state=None,
    **options,
) -> TrainResult:
    """Train ``pipe`` on ``batches`` for ``steps`` steps: checkpoints and resume, stops, evaluation, progress,
    metrics.

    Args:
        pipe: a :class:`~jaxpipe.Pipeline` (or :class:`~jaxpipe.CyclicDataParallel`).
        batches: an iterator of batches, or -- for checkpoints that resume the data too -- a stream with
            ``state_dict()`` / ``load_state_dict()``, or a function of no arguments that starts the stream.
        eval_batches: held-out batches the model's loss is measured on every ``eval_every`` steps.
        evaluate: ``evaluate(params, batch) -> dict`` of extra measures (``{"eval_acc": ...}``) beside the
            loss.
        hooks: functions ``hook(trainer, step)`` called after every step; ``trainer.request_stop(reason)``
            stops the run there.
        state: the state to start from (default: ``pipe.init()``, or the newest checkpoint in
            ``checkpoint_dir``).
        **options: the :class:`TrainOptions` (``steps`` is required).

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: an option of the wrong type or range, a path that cannot be written, a checkpoint of
            another configuration, or batches that ran out before ``steps``.
        NonFiniteLoss: a NaN or Inf loss or gradient with ``on_nonfinite="stop"``, naming the step, the
            stage and the last good checkpoint."""
    return Trainer(pipe, batches, eval_batches=eval_batches, evaluate=evaluate, hooks=hooks, **options).run(
        state
    )


class Trainer:
    """The loop of :func:`train`, for callers that want :meth:`request_stop` or the pieces (module docstring).

    Args:
        pipe: a :class:`~jaxpipe.Pipeline` (or :class:`~jaxpipe.CyclicDataParallel`).
        batches: as for :func:`train`.
        eval_batches: as for :func:`train`.
        evaluate: as for :func:`train`.
        hooks: as for :func:`train`.
        **options: the :class:`TrainOptions`.

    Raises:
        ConfigError: an option of the wrong type or range, or a path that cannot be written."""

    def __init__(
        self,
        pipe,
        batches,
        *,
        eval_batches: Sequence[Any] = (),
        evaluate: Optional[Callable] = None,
        hooks: Sequence[Callable] = (),
        **options,
    ):
        fields = {f.name for f in dataclasses.fields(TrainOptions)}
        unknown = sorted(set(options) - fields)
        if unknown or "steps" not in options:
            raise ConfigError(
                f"Trainer options: {'unknown ' + ', '.join(unknown) if unknown else 'steps= is needed'}"
                f"; the options are {', '.join(sorted(fields))}"
            )
        self.opts = TrainOptions(**options)
        self.opts.check()
        if self.opts.on_nonfinite == "skip" and not pipe.skip_nonfinite:
            raise ConfigError(
                "on_nonfinite='skip' needs Pipeline(..., skip_nonfinite=True) (a synchronous "
                "schedule) so that a non-finite update is refused on the device; or use 'stop'"
            )
        self.pipe = pipe
        self.batches = streams.resumable(batches) if self.opts.checkpoint_dir else streams.stream(batches)
        self.eval_batches, self.evaluate_fn, self.hooks = (
            _listed("eval_batches", eval_batches),
            evaluate,
            _listed("hooks", hooks),
        )
        for name, f in [("evaluate", evaluate)] + [(f"hooks[{i}]", h) for i, h in enumerate(self.hooks)]:
            if f is not None and not callable(f):
                raise ConfigError(
                    f"{name}={f!r}: give a function "
                    f"({'evaluate(params, batch) -> dict' if name == 'evaluate' else 'hook(trainer, step)'})"
                )
        self.ckpt, self.stop, self._eval_loss, self._lrs = None, None, None, None
        self._vote: Optional[LaggedVote] = None  # the stop flags' gather (several processes, overlapped)

    # ------------------------------------------------------------------ the run
    def run(self, state=None) -> TrainResult:
        """Run the loop to ``steps`` (or to a stop).

        Args:
            state: the state to start from (default: ``pipe.init()``, or the newest intact checkpoint).

        Returns:
            A :class:`TrainResult`."""
        import jax

        o = self.opts
        self.primary = jax.process_index() == 0
        os.makedirs(o.out_dir, exist_ok=True)
        state = self.pipe.init() if state is None else state
        try:
            state, start = self._restore(state)
        except BaseException:  # a refused resume: the directory's lock goes with the error
            self._close_checkpointer_after_error()
            raise
        self.log = MetricsLog(o.out_dir, start, self.primary)
        self.board = TensorBoard(
            os.path.join(o.out_dir, "tensorboard"), o.tensorboard if self.primary else "false"
        )
        # a launcher that dies takes our output's reader with it: writes must not raise, and what this process
        # says after that (its stop, its save, or why neither happened) goes to a file in out_dir
        guard_streams(os.path.join(o.out_dir, f"process{jax.process_index()}.orphaned.log"))
        self.stop = Stop(o.stop_grace_s, last_checkpoint=self._finished_checkpoint)
        self.stop.exits = o.exit_on_stop
        self.stop.install()
        self.stop.watch_launcher(
            int(os.environ.get("JAXPIPE_LAUNCHER_PID", "0") or 0),
            float(os.environ.get("JAXPIPE_STOP_TIMEOUT", "120")),
        )
        exiting = False
        try:
            result = self._loop(state, start)
            exiting = result.stopped is not None and o.exit_on_stop
        except BaseException:
            # the write in flight gets a bounded time to finish (a directory made read-only stalled an
            # unbounded close for minutes), the lock is released, and the error goes to the caller
            self._close_checkpointer_after_error()
            self._close(restore_signals=True)
            raise
        self._close(restore_signals=not exiting)
        if exiting:
            sys.exit(STOPPED_EXIT)
        return result

    def _close_checkpointer_after_error(self) -> None:
        """The checkpointer closed on an error path (:meth:`~jaxpipe.checkpoint.Checkpointer.close_within`):
        what could not finish is said on stderr, never raised over the caller's error.  Where that error is a
        failed checkpoint write, nothing is waited for (the write will not finish): the lock is released."""
        if self.ckpt is None:
            return
        import jax
        from jaxpipe.checkpoint import CheckpointWriteError

        ckpt, self.ckpt = self.ckpt, None
        if isinstance(sys.exc_info()[1], CheckpointWriteError):
            ckpt.abandon()
            return
        # several processes: a write finishes only with every process's shards, and a failed peer sends none
        # -- a short bound, so the failure reaches the launcher at once
        note = ckpt.close_within(CLOSE_ON_ERROR_S if jax.process_count() == 1 else 10.0)
        if note:
            print(f"jaxpipe: {note}", file=sys.stderr, flush=True)

    def request_stop(self, reason: str) -> None:
        """Stop after the step in flight, with a checkpoint, as a SIGTERM would (for hooks; with
        ``overlap_steps`` the step after the one the hook was called for is already running).

        Args:
            reason: said in the stop's line and kept as ``TrainResult.stopped``."""
        self.stop.request(reason)

    def say(self, *args, **kw) -> None:
        """``print`` on process 0 only (a multi-process job prints each line once).

        Args:
            *args: as for ``print``.
            **kw: as for ``print``."""
        if getattr(self, "primary", True):
            print(*args, **kw)

    def _restore(self, state):
        """The newest intact checkpoint (a corrupt or unreadable one is reported and skipped) and its step."""
        o = self.opts
        if not o.checkpoint_dir:
            return state, 0
        from jaxpipe.checkpoint import Checkpointer
        import jax
        import numpy as np

        # one writer per directory: a second run fails here, not later
        self.ckpt = Checkpointer(
            o.checkpoint_dir, self.pipe, keep=o.checkpoint_keep, every=o.checkpoint_every, writer=True
        )
        if self.ckpt.latest_step() is None:
            return state, 0
        example = jax.tree.map(np.zeros_like, streams.peek(self.batches))
        state, extra, start = self.ckpt.restore_latest(self.pipe.prepare(state, example), report=self.say)
        if start:
            self.batches.load_state_dict(extra["data"])
            other = self.ckpt.written_under_other
            self.say(
                f"resumed from {o.checkpoint_dir} at step {start} (data position "
                f"{getattr(self.batches, 'position', '?')})"
                + (
                    f"; written by schedule {other[0]!r} with {other[1]} micro-batches, continued with "
                    f"{self.pipe.schedule.name!r} and {self.pipe.num_microbatches}"
                    if other
                    else ""
                )
            )
        return state, start

    def _finished_checkpoint(self) -> Optional[int]:
        """The newest finished checkpoint, read from the directory (Orbax renames a step's folder when
        done)."""
        d = self.opts.checkpoint_dir
        if self.ckpt is None or not d or not os.path.isdir(d):
            return None
        return max((int(x) for x in os.listdir(d) if x.isdigit()), default=None)

    def _save(self, step: int, state, force: bool = False) -> None:
        if self.ckpt is not None:
            self.ckpt.maybe_save(step, state, extra={"data": self.batches.state_dict()}, force=force)

    def _close(self, restore_signals: bool) -> None:
        self.log.close()
        self.board.close()
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()
        if restore_signals:
            self.stop.uninstall()

    def _loop(self, state, start: int) -> TrainResult:
        """Steps ``start + 1`` to ``steps``.  With ``overlap_steps`` a step's metrics are read once the next
        step is dispatched, so that the device never waits for the host between them; a step that saves,
        evaluates or ends the run is read before the next one starts (its state is still whole)."""
        o = self.opts
        progress = _Progress(o, start, self.primary)
        run = _RunTally(time.perf_counter())
        ahead: Optional[_Dispatched] = None  # the step dispatched before this one, its metrics unread
        stopping = False  # every process agreed to stop after the step in flight
        for i in progress.steps():
            state, step = self._dispatch(i, start, state, ahead, run, progress)
            if ahead is not None:
                stopping = self._account(ahead, state, run, progress, later=True)
                ahead = None
            if o.overlap_steps and not stopping and not self._read_now(step.done):
                ahead = step
                continue
            rec = self._read(step, state, run, progress, later=False)
            state = self._at_step_end(step.done, state, rec, run, progress)
            if self._finish_record(step.done, rec, run, progress, stopping):
                progress.close()
                return self._stopped(state, step.done)
        progress.close()
        if run.first_s is None:
            self.say(
                f"nothing to do: the checkpoint in {o.checkpoint_dir} is at step {start} >= steps={o.steps}"
            )
            return TrainResult(self.pipe.drain(state)[0] if self.pipe.is_async else state, start, None)
        return TrainResult(state, run.done, self._summary(run, start, run.last_eval))

    def _dispatch(self, i: int, start: int, state, ahead, run: "_RunTally", progress: "_Progress"):
        """``(state, step)``: step ``i + 1`` dispatched on the next batch.  Where the batch or the call fails,
        the step still unread is accounted first (logged, or its own failure raised): as if it had been
        read before this one started."""
        try:
            batch = self._next_batch(i, start)
            started = time.perf_counter()
            state, metrics = self.pipe.step(state, batch)
        except BaseException as error:
            if ahead is not None:
                try:
                    self._account(ahead, state, run, progress, later=False, raised=error)
                except BaseException as earlier:
                    raise earlier from error
            raise
        return state, _Dispatched(i + 1, batch, metrics, started)

    def _read_now(self, done: int) -> bool:
        """Whether step ``done`` must be read before the next step starts: it is the last, it saves a
        checkpoint, or it evaluates on ``eval_batches`` -- each needs its own state, which the next step
        consumes."""
        o = self.opts
        return (
            done == o.steps
            or bool(self.eval_batches and o.eval_every and done % o.eval_every == 0)
            or (self.ckpt is not None and self.ckpt.due(done))
        )

    def _account(self, step: "_Dispatched", state, run, progress, later: bool, raised=None) -> bool:
        """Step ``step`` read, logged and its hooks called (its state is gone: a later step holds it);
        whether every process agreed to stop.  ``raised``: what the next step's call raised (a failed check
        of this step's, which names the cause of a non-finite loss)."""
        rec = self._read(step, state, run, progress, later=later, raised=raised)
        return self._finish_record(step.done, rec, run, progress, False)

    def _read(self, step: "_Dispatched", state, run, progress, later: bool, raised=None) -> dict:
        """Step ``step``'s loss read from the device (waiting for it), its time and record; a refused step
        counted (``on_nonfinite="skip"``) or stopped with :class:`NonFiniteLoss` (``state``: the newest;
        ``later``: a step after this one has started on it)."""
        o = self.opts
        loss = float(step.metrics["loss"])
        now = time.perf_counter()
        seconds = now - max(step.started, run.last_read or step.started)
        run.last_read = now
        run.stepped(seconds, loss, o.units_per_step or _rows(step.batch))
        rec = self._record(step.done - 1, seconds, step.metrics)
        if self._refused(step.metrics, loss):
            if o.on_nonfinite == "skip":
                run.skipped += 1
            else:
                self.log.write(rec)
                self.board.scalars(step.done, rec)
                progress.close()
                self._nonfinite(state, step.batch, step.metrics, step.done, later=later, raised=raised)
        run.done = step.done
        return rec

    def _at_step_end(self, done: int, state, rec: dict, run: "_RunTally", progress: "_Progress"):
        """What step ``done`` does with its own state: the checkpoint (it holds the running pipeline, before
        the final drain, so that a longer run resumed from it equals one that never stopped), the final
        drain, the evaluation (into ``rec``)."""
        o = self.opts
        self._save(done, state, force=done == o.steps)
        if done == o.steps and self.pipe.is_async:  # finish the micro-batches still in flight
            state, _ = self.pipe.drain(state)
        if o.eval_every and done % o.eval_every == 0 or done == o.steps:
            run.last_eval = self._evaluate(self.pipe.params(state))
            rec.update(run.last_eval)
            progress.evaluated(done)
        return state

    def _finish_record(self, done: int, rec: dict, run: "_RunTally", progress: "_Progress", stopping: bool):
        """Step ``done``'s record written and shown, the launcher told, the hooks called; whether to stop
        (already agreed, or agreed now by every process)."""
        self.log.write(rec)
        self.board.scalars(done, rec)
        progress.show(done, run.loss, rec["time_s"], run.last_eval)
        _heartbeat()
        for hook in self.hooks:
            hook(self, done)
        return stopping or self._agreed_stop()

    def _next_batch(self, i: int, start: int):
        """The batch of step ``i + 1``; a stream that ends early says how many batches it gave and what
        would do."""
        o = self.opts
        try:
            return next(self.batches)
        except StopIteration:
            resumed = f", resumed at step {start}" if start else ""
            raise ConfigError(
                f"the batches ran out before step {i + 1} of steps={o.steps} (after {i - start} batch(es) "
                f"this run{resumed}): give a stream of at least {o.steps} batches, a repeating one "
                f"(itertools.cycle, or more epochs), or fewer steps"
            ) from None

    def _record(self, i: int, dt: float, metrics) -> dict:
        """Step ``i + 1``'s log record: its time, learning rate and metrics (arrays as lists)."""
        import numpy as np

        return {
            "step": i + 1,
            "time_s": dt,
            **self._lr(i),
            **{k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist() for k, v in metrics.items()},
        }

    def _summary(self, run: "_RunTally", start: int, last_eval: Dict[str, float]) -> dict:
        """The run's summary (written to ``summary.json`` by the primary process): its options, losses, last
        evaluation, compile-and-first-step and steady step times, and throughput."""
        import jax

        o = self.opts
        wall = time.perf_counter() - run.started
        steady = (wall - run.first_s) / max(1, o.steps - start - 1)
        summary = {
            **o.describe,
            "steps": o.steps,
            "resumed_at": start,
            "processes": jax.process_count(),
            "skipped_updates": run.skipped,
            "first_loss": run.first_loss,
            "final_loss": run.loss,
            **last_eval,
            "wall_s": wall,
            "compile_and_first_step_s": run.first_s,
            "steady_step_s": steady,
            f"{o.units}_per_s": run.units / steady,
        }
        if self.primary:
            with open(os.path.join(o.out_dir, "summary.json"), "w") as fh:
                json.dump(summary, fh, indent=1)
        return summary

    def _lr(self, i: int) -> dict:
        """The learning rate the update of step i + 1 used (the optax schedule's count i), computed once for
        the whole run: nothing is read from a device between steps for it."""
        if self.opts.learning_rate is None:
            return {}
        if self._lrs is None:
            import jax
            import jax.numpy as jnp
            import numpy as np

            self._lrs = np.asarray(jax.vmap(self.opts.learning_rate)(jnp.arange(max(self.opts.steps, 1))))
        return {"lr": float(self._lrs[min(i, len(self._lrs) - 1)])}

    @staticmethod
    def _refused(metrics, loss: float) -> bool:
        """Whether the step's update was skipped or its loss or gradient norm is not finite."""
        import numpy as np

        computed = int(metrics.get("losses_computed", 1))
        # grad_norm is a vector for avgpipe (one per pipeline)
        finite = (not computed or np.isfinite(loss)) and bool(
            np.all(np.isfinite(np.asarray(metrics.get("grad_norm", 0.0))))
        )
        return bool(metrics.get("skipped", False)) or not finite

    def _evaluate(self, params) -> Dict[str, float]:
        """The model's mean loss on the evaluation batches, and ``evaluate``'s measures (their means)."""
        import jax
        import numpy as np
        from jaxpipe import distributed

        if not self.eval_batches:
            return {}
        if self._eval_loss is None:  # the model as trained (precision policy); no key: no dropout
            self._eval_loss = jax.jit(self.pipe.model.loss)
        params = distributed.to_host(params)  # all processes gather (collective), then evaluate locally
        losses = [float(self._eval_loss(params, b)) for b in self.eval_batches]
        more = [self.evaluate_fn(params, b) for b in self.eval_batches] if self.evaluate_fn else []
        out = {"eval_loss": float(np.mean(losses))}
        for k in more[0] if more else {}:
            out[k] = float(np.mean([m[k] for m in more]))
        return out

    def _agreed_stop(self) -> bool:
        """Whether any process was told to stop: every process must stop after the same step, or the
        collective checkpoint save of one waits forever for the others (a tiny allgather per step).  With
        ``overlap_steps`` the flags are read one step late (:class:`~.stopping.LaggedVote`): read at once,
        the gather waited for the step in flight."""
        import jax
        import numpy as np

        if jax.process_count() == 1:
            return bool(self.stop)
        if self.opts.overlap_steps:
            if self._vote is None:
                self._vote = LaggedVote()
            told = self._vote.cast(bool(self.stop))
            if told is None:
                return False
        else:
            from jax.experimental import multihost_utils

            told = multihost_utils.process_allgather(np.int32(1 if self.stop else 0))
        if np.any(told):
            self.stop.request(f"a stop signal to process {int(np.argmax(told))}")
        return bool(np.any(told))

    def _stopped(self, state, done: int) -> TrainResult:
        import jax

        print(
            f"jaxpipe: process {jax.process_index()}: stopping ({self.stop.reason}) after step {done}; "
            "saving",
            file=sys.stderr,
            flush=True,
        )
        self._save(done, state, force=True)
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()
        if self.opts.exit_on_stop:
            self.stop.done()  # saved: a signal arriving while the process exits changes nothing
        self.say(
            f"\nstopped by {self.stop.reason} at step {done}"
            + (
                f"; checkpoint saved in {self.opts.checkpoint_dir}, run again to resume"
                if self.opts.checkpoint_dir
                else ""
            )
        )
        return TrainResult(state, done, None, stopped=self.stop.reason)

    def _nonfinite(self, state, batch, metrics, step: int, later: bool = False, raised=None):
        """Raise :class:`NonFiniteLoss` with the step, the stage where the NaN/Inf first appears (an
        unpipelined replay) and the newest intact checkpoint.  ``later``: ``state`` is the state after the
        next step, which had started when this step's loss was read (``overlap_steps``); ``raised``: the next
        step's call's error, where that call reported this step's failed checks."""
        import numpy as np
        from jaxpipe import distributed
        from jaxpipe.checks import diagnose
        from jaxpipe.checkpoint import Checkpointer

        last, cause = None, ""
        failed = raised if isinstance(raised, ConfigError) else None
        if failed is None:
            try:  # this stop is the report of the step's failed checks: read them here, once
                self.pipe.check()
            except ConfigError as e:
                failed = e
        if failed is not None:  # the library's diagnosis (an undeclared id field, ...) is kept
            found = str(failed).find(" Likely cause: ")
            if found >= 0:
                cause = str(failed)[found:].split(" Lower the learning rate")[0].rstrip()
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()  # the writes in flight (all of finite states) finish; nothing new starts
            # name a checkpoint that really is good: restore the newest intact one (checksums verified; a
            # damaged one is reported and skipped) -- every process takes part, as in a resume
            reader = Checkpointer(ckpt.directory, self.pipe)
            try:
                _, _, last = reader.restore_latest(state, report=lambda m: sys.stderr.write(m + "\n"))
            finally:
                reader.close()
            last = last or None
        where = diagnose.locate_nonfinite(
            self.pipe.model, distributed.to_host(self.pipe.params(state)), batch
        )
        if later:
            used = (
                f"the weights after step {step + 1}, which had started when this step's loss was read; "
                "overlap_steps=False replays this step's own"
            )
        elif metrics.get("skipped", False):
            used = "the weights this step used (its update was not applied)"
        else:
            used = "the weights after this step's updates (asynchronous: updated inside the pipeline)"
        at = (
            f"first at stage {where['stage']} ({where['where']}: {where['detail']}; replayed unpipelined "
            "with "
            f"{used})"
            if where
            else "the unpipelined model reproduces no NaN with the updated weights (the pipelined step's "
            "inputs held it)"
        )
        raise NonFiniteLoss(
            f"non-finite loss {float(metrics['loss'])} / grad_norm "
            f"{np.asarray(metrics.get('grad_norm', np.nan))} "
            f"at step {step}, {at}. Stopped; nothing was checkpointed after it"
            f"{f' (last good checkpoint, verified just now: step {last})' if last is not None else ''}."
            f"{cause} "
            f"Lower the learning rate, add clipping, or skip such updates (on_nonfinite='skip')",
            step,
            where["stage"] if where else None,
            last,
        )


class _Dispatched(NamedTuple):
    """A step dispatched: its number (1-based), batch, metrics (on the device until read) and start."""

    done: int
    batch: Any
    metrics: Any
    started: float


@dataclasses.dataclass
class _RunTally:
    """What a run's summary counts as the loop goes: its start, its first step's time and loss (compile
    included), the last loss, the units a step processes, the updates skipped and the steps done."""

    started: float
    first_s: Optional[float] = None
    first_loss: Optional[float] = None
    loss: float = float("nan")
    units: float = 0.0
    skipped: int = 0
    done: int = 0
    last_read: Optional[float] = None  # when the last step's loss came back
    last_eval: Dict[str, float] = dataclasses.field(default_factory=dict)

    def stepped(self, seconds: float, loss: float, units: float) -> None:
        if self.first_s is None:
            self.first_s, self.first_loss, self.units = seconds, loss, units
        self.loss = loss


class _Progress:
    """A bar on a terminal; a plain line every ``progress_every`` steps when the output goes to a file or a
    pipe (a bar's carriage returns wrote 54 KB of one line into a redirected log)."""

    def __init__(self, o: TrainOptions, start: int, primary: bool):
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.steps_ = o.steps
        self.bar = tqdm(
            range(start, o.steps),
            disable=not (o.progress and primary and tty),
            unit="step",
            dynamic_ncols=True,
            initial=start,
            total=o.steps,
        )
        self.every = o.progress_every or max(1, (o.steps - start) // 10)
        self.lines = o.progress and primary and not tty
        self.eval_step = None

    def steps(self):
        return self.bar

    def evaluated(self, step: int) -> None:
        self.eval_step = step

    def show(self, done: int, loss: float, dt: float, last_eval: dict) -> None:
        self.bar.set_postfix(loss=f"{loss:.3f}", **{k: f"{v:.3f}" for k, v in last_eval.items()})
        if self.lines and (done % self.every == 0 or done == self.steps_):
            # an evaluation is printed where it was made, and later marked with its step (not as if new)
            since = "" if self.eval_step == done else f" (step {self.eval_step})"
            print(
                f"step {done}/{self.steps_}  loss {loss:.3f}  {dt * 1e3:.0f} ms/step"
                + "".join(f"  {k} {v:.3f}{since}" for k, v in last_eval.items()),
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


def _heartbeat() -> None:
    """``experiments.launch``'s watchdog: this process finished a step (``$JAXPIPE_HEARTBEAT``'s mtime)."""
    beat = os.environ.get("JAXPIPE_HEARTBEAT")
    if beat:
        try:
            open(beat, "a").close()
            os.utime(beat)
        except OSError:  # the launcher is gone and took its directory: nothing to tell
            pass


def _listed(name: str, value) -> list:
    """An option that is a sequence (``eval_batches``, ``hooks``) as a list; None is empty."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ConfigError(
            f"{name}={type(value).__name__}: give a list "
            f"({'of batches' if name == 'eval_batches' else 'of functions'}), or leave it out"
        )
    return list(value)


def _rows(batch) -> float:
    """The rows of a batch (the leading dimension of its first array)."""
    import jax

    leaves = jax.tree.leaves(batch)
    return float(leaves[0].shape[0]) if leaves and getattr(leaves[0], "ndim", 0) else 1.0
