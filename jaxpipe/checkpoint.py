"""Checkpoints of the whole train state with Orbax: save asynchronously every K steps, keep N, resume.

    ckpt = jp.Checkpointer("ckpt", pipe, keep=3, every=50)
    state = pipe.prepare(pipe.init(), example_batch)        # the in-flight buffers exist before a restore
    state, extra, step = ckpt.restore_latest(state)           # (state, {}, 0) when there is none
    ...
    ckpt.maybe_save(step, state, extra={"data": stream.state_dict()})
    ckpt.close()                                              # waits for the last asynchronous write

What is saved is the state pytree the pipeline returns -- parameters, optimizer state, weight versions and
stashes (``policy_state`` / ``shadow``), the asynchronous methods' in-flight pipeline (``carry``,
``counters``), AvgPipe's elastic-averaging reference -- plus a JSON item with the caller's extras (data
iterator position and RNG) and a fingerprint of the model, schedule and mesh that ``restore`` checks.

Atomicity: Orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it when every file is
written; ``latest_step`` only lists finalized steps, so a write torn by a crash is never picked.  Retention
(``keep``) deletes the oldest finalized steps.

Verification: the metadata holds a checksum of every array (two 32-bit sums of its bits, computed on the
devices when the save starts) and a SHA-256 of itself; ``restore`` checks the metadata first, recomputes the
arrays' sums and refuses a checkpoint where either differs.
``restore_latest`` falls back from a corrupt or unreadable newest checkpoint to the newest intact one and
says which it skipped and why.  One writer per directory: a lock file (``.jaxpipe.lock``, held with ``flock``;
it names host, pid, time) is taken by the first save (or at once with ``writer=True``) and released on
``close`` or when the process dies (a later run takes it over, said so); a live owner is a ConfigError naming
it.  All processes of a multi-host job call save/restore; Orbax writes each array's shards from the process
that holds them and the metadata from process 0.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from .errors import ConfigError
from .checks.values import is_int
from .axes import PIPE, STAGE


def fingerprint(pipe) -> Dict[str, Any]:
    """What a checkpoint must agree with to be restored into ``pipe``: model parameter shapes, schedule,
    micro-batches and mesh shape."""
    # the leaf's own dtype (np.result_type of an array is deprecated in numpy 2.4 and an error later)
    # the model as the user gave it: a cut model's blocks, not the padded layout the executor holds
    user = getattr(pipe, "user_model", None)
    model = user if getattr(user, "cut", None) else pipe.model
    shapes = [
        (
            jax.tree_util.keystr(k),
            tuple(int(d) for d in np.shape(v)),
            str(v.dtype if hasattr(v, "dtype") else np.result_type(v)),
        )
        for k, v in jax.tree_util.tree_flatten_with_path(model.params)[0]
    ]
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    opt = getattr(pipe, "optimizer", None)
    opt_digest = None
    if opt is not None and hasattr(opt, "init"):
        try:
            o = jax.eval_shape(opt.init, pipe.model.params)
            opt_digest = hashlib.sha256(repr(jax.tree.structure(o)).encode()).hexdigest()[:16]
        except Exception:  # an optimizer that cannot init on the model's layout: no check
            opt_digest = None
    ties = [[list(map(str, a)), list(map(str, b))] for a, b in getattr(pipe.model, "tied", ())]
    digest = hashlib.sha256(repr((shapes, ties) if ties else shapes).encode()).hexdigest()[:16]
    from .cuts import blocks_layout

    blocks, cut = blocks_layout(model)  # a model of identical blocks: restorable onto another cut
    rest = [s for s in shapes if not s[0].startswith("[0]")]  # the embedding and head must agree too
    blocks = None if blocks is None else hashlib.sha256(repr((blocks, rest, ties)).encode()).hexdigest()[:16]
    return {
        "blocks": blocks,
        "block_cut": None if cut is None else list(cut),
        "model": digest,
        "optimizer": opt_digest,
        "model_parameters": int(sum(int(np.prod(s[1])) for s in shapes)),
        "model_leaves": [[k, list(sh), dt] for k, sh, dt in shapes],
        "tied": ties,
        "model_stages": int(model.num_stages),
        "cut": list(model.cut) if getattr(model, "cut", None) else None,
        "schedule": pipe.schedule.name,
        "microbatches": int(pipe.num_microbatches),
        # a flushing schedule that updates once a step keeps no in-flight state between steps: its state is
        # the weights' and the optimizer's whatever the schedule and M (:func:`_alike_between_steps`)
        "synchronous": _synchronous(pipe),
        "mesh": {k: int(v) for k, v in pipe.mesh.shape.items()},
        # how the state holds the stage leaves (chunks a device, a device-local order): a restore onto
        # another number of devices reads them in the writer's layout, not its own
        "state_layout": _state_layout(pipe),
    }


def _synchronous(pipe) -> Optional[bool]:
    """Whether ``pipe``'s method flushes and updates once a step (None: a pipeline of no such method)."""
    method = getattr(pipe, "method", None)
    if method is None:
        return None
    return bool(method.flushes and not method.updates_inside)


def _alike_between_steps(saved: dict, mine: dict) -> bool:
    """Whether a checkpoint written under one schedule and micro-batch count restores under another: both
    synchronous (nothing in flight between steps) and their stage leaves laid out alike on the devices
    (the same chunk order: ZB-V and DualPipeV, not interleaved 1F1B).  A checkpoint from before the
    fingerprint recorded it: no."""
    both = bool(saved.get("synchronous")) and bool(mine.get("synchronous"))
    return both and saved.get("state_layout") == mine.get("state_layout")


def _state_layout(pipe) -> Optional[dict]:
    layout = getattr(getattr(pipe, "_runner", None), "state_layout", None)
    return layout() if layout is not None else None


def params_by_path(params) -> Dict[str, np.ndarray]:
    """``params`` as host arrays named by their tree paths.  ``pipe.params(state)`` (``(stages, pre, post)``
    in the model's own layout): ``"stages/blocks/0/attn/kernel"``, ``"pre/embed"``, ... -- the stage leaves
    stacked ``[stages, ...]`` (a model of blocks given a cut: ``[blocks, ...]``).  Any other pytree by its own
    paths; Flax NNX modules in it (what ``from_nnx``'s ``to_modules`` gives) by their state's paths, one array
    per Variable (``"blocks/0/attn/key/kernel"``)."""
    from . import distributed

    def name(path) -> str:
        parts = []
        for k in path:
            key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
            parts.append(str(key if key is not None else k))
        if len(parts) > 1 and parts[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
            parts = parts[:-1]  # an NNX Variable's array
        return "/".join(parts)

    named = (
        dict(zip(("stages", "pre", "post"), params))
        if isinstance(params, tuple) and len(params) == 3
        else params
        if isinstance(params, dict)
        else {"params": params}
    )
    named = _module_states(named)
    flat = jax.tree_util.tree_flatten_with_path(named)[0]
    values = distributed.to_host([v for _, v in flat])  # a collective: every process calls it
    return {name(k): np.asarray(v) for (k, _), v in zip(flat, values)}


def _module_states(tree):
    """Flax NNX modules in ``tree`` as their states (pytrees of their Variables' arrays)."""
    try:
        from flax import nnx
    except ImportError:
        return tree
    is_module = lambda m: isinstance(m, nnx.Module)
    return jax.tree.map(lambda m: nnx.state(m) if is_module(m) else m, tree, is_leaf=is_module)


def check_params_path(path: str, what: str = "save_params") -> str:
    """``path`` made an ``.npz`` path whose directory exists and is writable, or a ConfigError -- checked
    before a run, not after it trained."""
    path = os.fspath(path)
    if os.path.isdir(path) or path.endswith(os.sep) or not os.path.basename(path):
        raise ConfigError(
            f"{what}={path}: a directory; give a file path, e.g. {os.path.join(path, 'params.npz')}"
        )
    if not path.endswith(".npz"):
        path += ".npz"  # (what np.savez would write)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(
            f"{what}={path}: a directory is there; give a file path, e.g. {os.path.join(path, 'params.npz')}"
        )
    from .checks.values import file_in_the_way

    blocker = file_in_the_way(path)
    if blocker:
        raise ConfigError(f"{what}={path}: {blocker} is a file, not a directory; give another path")
    if not os.path.isdir(folder):
        raise ConfigError(
            f"{what}={path}: the directory {folder} does not exist; create it or give another path"
        )
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{what}={path}: the directory {folder} is not writable by this user")
    return path


def save_params(path: str, params) -> str:
    """Write parameters to an ``.npz`` file, each array named by its tree path.

    ``np.load(path)["pre/embed"]`` reads one back without jaxpipe. Every process calls it (the arrays are
    gathered); process 0 writes, whole, through a temporary file.

    Args:
        path: the file to write (``.npz`` is added where missing).
        params: ``pipe.params(state)``, or the modules ``to_modules`` makes of them (a dict of names to
            modules).

    Returns:
        The path written.

    Raises:
        ConfigError: ``path`` cannot be written (a directory there, a missing parent, no permission), said
            before anything is gathered."""
    path = check_params_path(path, "save_params")
    arrays = params_by_path(params)
    if jax.process_index() == 0:
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    return path


class Checkpointer:
    """Orbax checkpoints of one pipeline's whole train state, refused where they would not restore what was
    saved.

    Args:
        directory: where the checkpoints go (created if missing; one writer per directory, held by a lock).
        pipe: the :class:`~jaxpipe.Pipeline` whose state is saved (or any object with ``model``,
            ``schedule``, ``num_microbatches`` and ``mesh``); its fingerprint is saved and checked on
            restore. None skips the check.
        keep: checkpoints kept (the oldest are deleted; None keeps every one).
        every: :meth:`maybe_save` saves at multiples of this step (0: only when forced).
        async_save: write in the background while training goes on (``wait`` / ``close`` block until
            written).
        writer: take the directory's lock now (a training run: fail before step 1 if another run writes
            there); otherwise the first save takes it, and a Checkpointer that only restores never does.

    Raises:
        ConfigError: ``keep`` or ``every`` out of range, ``directory`` a file, or the directory's lock held
            by another run (naming its host, pid and time)."""

    def __init__(
        self,
        directory: str,
        pipe=None,
        *,
        keep: Optional[int] = 3,
        every: int = 0,
        async_save: bool = True,
        writer: bool = False,
    ):
        import orbax.checkpoint as ocp

        if keep is not None and not is_int(keep, 1):
            raise ConfigError(
                f"Checkpointer keep={keep!r}: give how many checkpoints to keep (>= 1) or None for all"
            )
        if not is_int(every, 0):
            raise ConfigError(
                f"Checkpointer every={every!r}: give a step interval >= 1, or 0 to save only when "
                f"asked (save(..., force=True))"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.every, self.keep = every, keep
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ConfigError(
                f"checkpoint directory {self.directory} is a file, not a directory: give a directory "
                f"path (it is created if missing)"
            )
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:  # a path under a regular file, a read-only parent, an immutable one
            raise ConfigError(
                f"checkpoint directory {self.directory} cannot be created: {e.strerror}"
                f"{' (a part of the path is a file)' if isinstance(e, NotADirectoryError) else ''}; "
                f"give a writable --checkpoint_dir"
            ) from None
        if not os.access(self.directory, os.W_OK):
            raise ConfigError(
                f"checkpoint directory {self.directory} is not writable by this user: give a writable "
                f"--checkpoint_dir (checked before step 1, not at the first save)"
            )
        self._lock = None
        if writer:
            self._take_lock()
        self.fingerprint = fingerprint(pipe) if pipe is not None else None
        #: ``(schedule, micro-batches)`` that wrote the checkpoint last restored, where they differ from this
        #: pipeline's (a synchronous checkpoint resumed under another schedule or M); else None
        self.written_under_other = None
        # the pipeline's pending on-device checks: a state whose step failed them is never written
        self._check_pipe = getattr(pipe, "check", None)
        self._check_saveable = getattr(pipe, "check_saveable", None)
        self._optimizer = getattr(pipe, "optimizer", None)  # finds the optimizer state's copies of the blocks
        order = getattr(getattr(pipe, "_runner", None), "stage_order", None)
        self._stage_order = (
            order() if order is not None else None
        )  # the state's stage leaves in the model's order
        self._ocp = ocp
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=max(every, 1),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "meta"))
        import logging

        for name in ("absl", ""):
            logger = logging.getLogger(name)
            if not any(isinstance(f, _QuietOrbaxWrites) for f in logger.filters):
                logger.addFilter(_QuietOrbaxWrites())
        _quiet_closed_loop_callbacks()
        self._pending = None  # the step of the write in flight, for the message if it fails

    # ------------------------------------------------------------------ save
    def latest_step(self) -> Optional[int]:
        """The newest finalized step (never a torn, unfinished write), or None."""
        self.manager.reload()
        return self.manager.latest_step()

    def all_steps(self):
        self.manager.reload()
        return list(self.manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether :meth:`maybe_save` saves at ``step`` without ``force`` (a multiple of ``every``).

        Args:
            step: the step the state is at.

        Returns:
            Whether ``step`` is a multiple of ``every`` (never with ``every=0``)."""
        return self.every > 0 and step % self.every == 0

    def maybe_save(self, step: int, state, extra: Optional[dict] = None, force: bool = False) -> bool:
        """Save at multiples of ``every`` (or always with ``force``).

        The state is refused if its trained values (not the in-flight buffers) hold NaN or Inf: a diverged
        run must never overwrite a good checkpoint.

        Args:
            step: the step the state is at.
            state: the train state.
            extra: a JSON-serialisable dict saved beside it.
            force: save whatever the step.

        Returns:
            Whether a save started."""
        if not force and not self.due(step):
            return False
        from .checks.batch import require_live

        require_live(state, f"Checkpointer.save of step {step}")
        if self._check_saveable is not None:  # the last step's checks, and no refused step's effect held
            try:
                self._check_saveable(state)
            except ConfigError as e:
                raise ConfigError(f"{e}; the last good checkpoint is step {self.latest_step()}") from None
        elif self._check_pipe is not None:
            self._check_pipe()  # the last step's checks: raises where that step failed them
        if step in (self.manager.all_steps() or []):
            return False
        # the trained values only: a no-flush state's in-flight buffers (``.carry``) hold NaN in their idle
        # slots in NaN mode (``nan_bubbles=True``) by design; a non-finite live activation shows in the next
        # step's loss and parameters, which the train loop and the next save refuse
        bad = [k for k in nonfinite_leaves(state) if not k.startswith(".carry")]
        if bad:
            raise ConfigError(
                f"refusing to checkpoint step {step}: the state holds NaN/Inf in {bad[:3]}"
                f"{' ...' if len(bad) > 3 else ''}; the last good checkpoint is step "
                f"{self.latest_step()}"
            )
        self._take_lock()
        meta = {
            "step": int(step),
            "fingerprint": self.fingerprint,
            "extra": extra or {},
            "shapes": _shapes(state),
            "checksums": checksums(state),
        }
        meta["meta_sha256"] = meta_digest(meta)
        args = self._ocp.args.Composite(
            state=self._ocp.args.StandardSave(state), meta=self._ocp.args.JsonSave(meta)
        )
        started = self._writing(lambda: bool(self.manager.save(step, args=args, force=True)), step)
        self._pending = step
        return started

    def _writing(self, fn, step=None):
        """``fn()``; a failed write (this one, or the asynchronous one before it surfacing now) becomes one
        :class:`CheckpointWriteError` naming the step, the reason and the newest finished checkpoint."""
        try:
            return fn()
        except Exception as e:  # Orbax surfaces an asynchronous write's failure as whatever its layer raised
            why = _write_failure(e)
            if why is None:
                raise
            finished = self.all_steps() or []
            # an asynchronous write surfaces at the next call: the pending step, unless it finished
            step = self._pending if self._pending is not None and self._pending not in finished else step
            done = [s for s in finished if s != step]
            raise CheckpointWriteError(
                f"checkpoint step {step} could not be written to {self.directory}: {why}. The newest "
                "finished "
                f"checkpoint holds step {max(done) if done else 'none'}; free space or fix the directory, "
                "then run "
                f"again to resume from it"
            ) from None

    def _take_lock(self):
        if self._lock is None and jax.process_index() == 0:
            self._lock = _DirectoryLock(self.directory)

    def save(self, step: int, state, extra: Optional[dict] = None) -> bool:
        """Save ``step`` now.

        Args:
            step: the step the state is at.
            state: the train state.
            extra: a JSON-serialisable dict saved beside it (the data stream's position, ...).

        Returns:
            Whether a save started.

        Raises:
            ConfigError: the step was already saved (writing it again would leave the older state there,
                which a later restore of that step would return), or the state may not be saved
                (:meth:`jaxpipe.Pipeline.check_saveable`)."""
        if step in (self.manager.all_steps() or []):
            raise ConfigError(
                f"Checkpointer.save: step {step} is already saved in {self.directory}, and a "
                f"checkpoint is never overwritten; save under another step number, or delete "
                f"{os.path.join(self.directory, str(step))} first to replace it"
            )
        return self.maybe_save(step, state, extra, force=True)

    def wait(self):
        """Block until the asynchronous write in progress (if any) is on disk."""
        self._writing(self.manager.wait_until_finished)

    def close(self):
        """Finish the writes in flight and close; then raise the pipeline's last step's failed checks if
        nothing has read them yet (a job whose last step was refused says so as it ends)."""
        try:
            self._writing(self.manager.wait_until_finished)
        finally:
            self._close_quietly()
        if self._check_pipe is not None:
            self._check_pipe()

    def close_within(self, timeout_s: float) -> Optional[str]:
        """Close on an error path, without raising (the caller is already raising its own error).

        The write in flight gets ``timeout_s`` seconds to finish, then the manager is closed and the
        directory's lock released, whatever happened. An abandoned write stays an unfinished temporary
        folder, which no restore reads: the newest finished checkpoint is what a later run resumes from (a
        write still going on in the background may yet finish it).

        Args:
            timeout_s: seconds the write in flight may still take.

        Returns:
            None where everything finished; else what was abandoned."""
        import threading

        errors = []

        def finish():
            try:
                self._writing(self.manager.wait_until_finished)
                self._close_quietly()
            except BaseException as e:  # reported below; the caller's error goes on
                errors.append(e)

        worker = threading.Thread(target=finish, name="jaxpipe-checkpoint-close", daemon=True)
        worker.start()
        worker.join(timeout_s)
        self.abandon()
        if worker.is_alive():
            return (
                f"the write of checkpoint step {self._pending} to {self.directory} did not finish within "
                f"{timeout_s:g} s and is abandoned; the newest finished checkpoint holds step "
                f"{self._newest_finished()}"
            )
        if errors:
            return f"closing the checkpoints in {self.directory}: {errors[0]}"
        return None

    def abandon(self) -> None:
        """Give up the directory without waiting for anything: its lock released, the manager left as it is (a
        write that failed -- :class:`CheckpointWriteError` -- or hangs on a directory made read-only: waiting
        for it stalled the process for minutes).  What finished stays readable."""
        if self._lock is not None:
            lock, self._lock = self._lock, None
            try:
                lock.release()
            except OSError:  # the process's end releases an flock anyway
                pass

    def _newest_finished(self) -> Optional[int]:
        """The newest finished step, from the folder names (no Orbax call: usable while a write hangs)."""
        try:
            return max((int(x) for x in os.listdir(self.directory) if x.isdigit()), default=None)
        except OSError:
            return None

    def _close_quietly(self):
        try:
            self.manager.close()
        except Exception as e:  # the failed write, raised a second time: already said by wait
            if _write_failure(e) is None:
                raise
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ------------------------------------------------------------------ restore
    def restore(self, template, step: Optional[int] = None) -> Tuple[Any, dict, int]:
        """Restore a checkpoint onto the structure of ``template``.

        Args:
            template: a state of the same pipeline (e.g. ``pipe.prepare(pipe.init(), batch)``): it gives
                the structure, shapes and shardings the arrays are restored onto, so a checkpoint written
                on another mesh is resharded where shapes allow.
            step: the step to restore (default: the latest).

        Returns:
            ``(state, extra, step)``.

        Raises:
            ConfigError: the checkpoint is of another configuration (its fingerprint names what differs),
                or the step does not exist."""
        ocp = self._ocp
        if step is None:
            step = self.latest_step()
        if step is None:
            raise ConfigError(f"no finalized checkpoint in {self.directory}")
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if "meta_sha256" in meta and meta_digest(meta) != meta["meta_sha256"]:
            # checked before anything is read from it: a flipped digit would resume at another step or
            # position in the data, or look like another configuration's checkpoint
            raise CorruptCheckpoint(
                f"checkpoint step {step} in {self.directory} is corrupt: its metadata (step, "
                f"data position, fingerprint, checksums) differs from the digest written with it"
            )
        from_cut = self._check_fingerprint(meta.get("fingerprint"), step)
        if _carry_missing(template):
            raise ConfigError(
                "the restore template has empty in-flight state (carry=None): build it with "
                "pipe.prepare(pipe.init(), example_batch) so the buffers exist"
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        if from_cut is not None:
            return self._restore_across_cuts(step, meta, abstract, from_cut)
        saved, want = meta.get("shapes") or {}, _shapes(abstract)
        _check_stash(step, saved, want)
        diff = [
            f"{k}: saved {tuple(saved[k])}, needed {tuple(v)}"
            for k, v in want.items()
            if k in saved and tuple(saved[k]) != tuple(v)
        ]
        if diff:
            self._mesh_error(
                step, meta.get("fingerprint"), "; ".join(diff[:2]) + (" ..." if len(diff) > 2 else "")
            )
        if saved and set(saved) != set(want):
            raise ConfigError(
                f"checkpoint step {step} holds a state of another structure (e.g. "
                f"{sorted(set(saved) ^ set(want))[:2]}): it was written by another schedule or "
                f"jaxpipe version; resume with the configuration that wrote it, or start afresh"
            )
        return self._read(step, meta, abstract), meta.get("extra", {}), int(meta["step"])

    def _read(self, step, meta, abstract):
        """The state of ``step`` read onto ``abstract`` (shapes, dtypes, shardings), checksums verified."""
        ocp = self._ocp
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        want_sums = meta.get("checksums")
        if want_sums is not None:
            got = checksums(out["state"])
            bad = [k for k, v in want_sums.items() if got.get(k) != v]
            if bad:
                raise CorruptCheckpoint(
                    f"checkpoint step {step} in {self.directory} is corrupt: {len(bad)} array(s) "
                    f"differ from the checksums written with them (e.g. {bad[0]})"
                )
        return out["state"]

    def _restore_across_cuts(self, step, meta, abstract, from_cut):
        """This model's blocks saved on another cut: read as they were saved (checksums verified), then moved
        block by block onto this run's cut (:func:`jaxpipe.cuts.recut_state`)."""
        from jax.sharding import NamedSharding, PartitionSpec
        from .cuts import recut_state

        to_cut = tuple(self.fingerprint["block_cut"])
        if not hasattr(abstract, "opt_state") or hasattr(abstract, "carry"):
            raise ConfigError(
                f"checkpoint step {step} holds this model's blocks cut as {list(from_cut)}, this run cuts "
                "them as "
                f"{list(to_cut)}: a state moves between cuts for the synchronous schedules (gpipe, 1f1b, "
                f"interleaved_1f1b, zb_h1, zb_v, chimera, dualpipe_v); {self.fingerprint['schedule']}'s "
                "holds "
                f"in-flight micro-batches and weight versions laid out for the old cut. Resume with "
                f"cut={list(from_cut)}, or start the new cut from its weights: jp.PipelineModel(..., "
                f"stage_params=pipe.params(state)[0], cut={list(to_cut)}) (optimizer state restarts)"
            )
        saved = meta.get("shapes") or {}

        def as_saved(path, leaf):  # a stage leaf of the old cut: read whole (replicated), moved below
            shape = tuple(saved.get(jax.tree_util.keystr(path), leaf.shape))
            return (
                leaf
                if shape == tuple(leaf.shape)
                else jax.ShapeDtypeStruct(
                    shape, leaf.dtype, sharding=NamedSharding(leaf.sharding.mesh, PartitionSpec())
                )
            )

        state = recut_state(
            self._read(step, meta, jax.tree_util.tree_map_with_path(as_saved, abstract)),
            self._optimizer,
            from_cut,
            to_cut,
            self._orders(step, meta.get("fingerprint") or {}),
        )
        got, want = _shapes(state), _shapes(abstract)
        if got != want:
            diff = [
                f"{k}: moved {tuple(got.get(k, ()))}, needed {tuple(v)}"
                for k, v in want.items()
                if got.get(k) != v
            ]
            self._mesh_error(step, meta.get("fingerprint"), "; ".join(diff[:2]))
        return (
            jax.tree.map(lambda a, t: jax.device_put(a, t.sharding), state, abstract),
            meta.get("extra", {}),
            int(meta["step"]),
        )

    def _orders(self, step, saved: dict):
        """``(to_model, from_model)`` for :func:`~jaxpipe.cuts.recut_state`: the saved stage leaves into the
        model's order by the *writer's* layout (chunks a device depend on its number of devices), then into
        this run's.  A checkpoint that did not record its layout is refused where the number of devices
        differs (its chunks would be read in this run's order: blocks swapped without a word)."""
        from .runtime.chunk_state import layout_order

        same = lambda a: a
        mine = self._stage_order or (same, same)
        if "state_layout" in saved:
            info = saved["state_layout"]
            theirs = layout_order(info["layout"], info["chunks"]) if info else (same, same)
        elif (saved.get("mesh") or {}).get(STAGE) == self.fingerprint["mesh"].get(STAGE):
            theirs = mine
        elif self._stage_order is None:
            theirs = (same, same)
        else:
            raise ConfigError(
                f"checkpoint step {step} in {self.directory} holds {saved.get('schedule')}'s state on "
                f"{(saved.get('mesh') or {}).get(STAGE)} stage devices; this run has "
                f"{self.fingerprint['mesh'].get(STAGE)}, "
                f"and the checkpoint (written by an older jaxpipe) does not record how its devices held the "
                f"chunks. Resume on {(saved.get('mesh') or {}).get(STAGE)} stage devices (a later checkpoint "
                f"then moves), or start the new layout from its weights: jp.PipelineModel(..., "
                f"stage_params=pipe.params(state)[0], cut=...) (optimizer state restarts)"
            )
        return theirs[0], mine[1]

    def restore_latest(self, template, report=print) -> Tuple[Any, dict, int]:
        """Restore the newest checkpoint that is intact.

        A corrupt or unreadable one (a flipped bit, a missing file) is reported through ``report`` and the
        next older one tried.

        Args:
            template: as for :meth:`restore`.
            report: where the skipped checkpoints are said (default ``print``).

        Returns:
            ``(state, extra, step)``; ``(template, {}, 0)`` when the directory holds none (or none intact,
            said so)."""
        steps = sorted(self.all_steps(), reverse=True)
        for i, step in enumerate(steps):
            try:
                return self.restore(template, step)
            except ConfigError as e:
                if not isinstance(e, CorruptCheckpoint):
                    raise  # a checkpoint of another configuration: the user decides
                why = str(e)
            except Exception as e:  # Orbax / tensorstore / JSON: unreadable files
                why = (
                    f"checkpoint step {step} in {self.directory} cannot be read ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else ''})"
                )
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            report(
                f"jaxpipe: {why}; "
                + (
                    f"falling back to step {nxt}"
                    if nxt is not None
                    else "no older checkpoint: starting afresh"
                )
            )
        return template, {}, 0

    def _check_fingerprint(self, saved: Optional[dict], step: int) -> Optional[tuple]:
        """Raise where the checkpoint is another configuration's; the cut it was written with where it holds
        this model's blocks on another cut (restored by moving them), else None."""
        mine = self.fingerprint
        self.written_under_other = None
        if mine is None or saved is None:
            return
        where = f"checkpoint step {step} in {self.directory}"
        moved = (
            saved.get("block_cut")
            and mine.get("block_cut")
            and saved["block_cut"] != mine["block_cut"]
            and saved.get("blocks") == mine.get("blocks") is not None
        )
        if moved:  # the same blocks, another cut
            for k in ("optimizer", "schedule", "microbatches"):
                if saved.get(k) != mine.get(k):
                    raise ConfigError(
                        f"{where} holds this model's blocks cut as {saved['block_cut']}; it can be "
                        f"restored onto cut {mine['block_cut']} with the same {k} only (it was "
                        f"written with {saved.get(k)!r}, this run has {mine.get(k)!r})"
                    )
            return tuple(saved["block_cut"])
        if saved["model"] != mine["model"]:
            raise ConfigError(
                f"{where} is from another model: it holds {saved['model_parameters']:,} parameters in "
                f"{saved['model_stages']} stages (fingerprint {saved['model']}), this run's model has "
                f"{mine['model_parameters']:,} in {mine['model_stages']} (fingerprint {mine['model']})"
                f"{model_difference(saved, mine)}{_blocks_hint(saved, mine)}; build the same model, or point "
                f"--checkpoint_dir at an empty directory to start afresh"
            )
        if saved.get("cut") != mine.get("cut"):  # written before checkpoints recorded the blocks
            raise ConfigError(
                f"{where} holds this model cut into stages as {saved.get('cut') or 'an even cut'}; this run "
                "cuts it "
                f"as {mine.get('cut') or 'an even cut'}, and the checkpoint was written by a jaxpipe that "
                "did not "
                f"record the blocks' layout: resume with cut={saved.get('cut')}, or start afresh in another "
                "directory"
            )
        if saved.get("optimizer") and mine.get("optimizer") and saved["optimizer"] != mine["optimizer"]:
            raise ConfigError(
                f"{where} was written with another optimizer (its state has another structure, fingerprint "
                f"{saved['optimizer']} vs {mine['optimizer']}): resume with the optimizer that wrote it "
                "(e.g. the same "
                f"--optimizer), or start afresh in another directory"
            )
        changed = [k for k in ("schedule", "microbatches") if saved[k] != mine[k]]
        self.written_under_other = (saved["schedule"], saved["microbatches"]) if changed else None
        if changed and not _alike_between_steps(saved, mine):
            raise ConfigError(
                f"{where} was written by schedule {saved['schedule']!r} with {saved['microbatches']} "
                f"micro-batches; this run uses {mine['schedule']!r} with {mine['microbatches']}: the state "
                f"layout ({changed[0]}) differs -- only a synchronous schedule's checkpoint resumes under "
                "another synchronous schedule or micro-batch count, and only where both lay the stages out "
                "alike on the devices. Resume with the same schedule and num_microbatches, or start afresh"
            )

    def _mesh_error(self, step, fp, detail):
        was = (fp or {}).get("mesh")
        now = self.fingerprint["mesh"] if self.fingerprint else None
        if was is not None and was == now:
            raise ConfigError(
                f"checkpoint step {step} holds arrays of other shapes than this run's state ({detail}) on "
                "the same "
                f"mesh {now}: the in-flight pipeline of a no-flush schedule is sized by the micro-batch, so "
                "the batch "
                "size (or sequence length) differs from the run that wrote it. Resume with that batch "
                "size, or "
                f"start afresh in another directory"
            ) from None
        per = "pipe replica" if was and now and was.get(PIPE) != now.get(PIPE) else "device"
        raise ConfigError(
            f"checkpoint step {step} cannot be restored onto this mesh: an array differs in shape "
            f"({detail}). "
            f"It was written on mesh {was}, this run has {now}; this schedule's state (in-flight pipeline, "
            f"replicas) is laid out per {per}. Resume on mesh {was}, or (synchronous schedules, whose state "
            "does "
            f"not depend on the 'data' axis) change only 'data'"
        ) from None


def _blocks_hint(saved: dict, mine: dict) -> str:
    """Where one side is a model of blocks (``cut=``, the Flax adapters, ``block_fn``) and the other one
    module per stage with as many parameters (the reference GPT without ``cut=``): checkpoints move between
    cuts and stage counts only between models of blocks; the even model's form as blocks, by name."""
    blocky = [fp for fp in (saved, mine) if fp.get("block_cut")]
    if len(blocky) != 1 or saved.get("model_parameters") != mine.get("model_parameters"):
        return ""
    n = sum(blocky[0]["block_cut"])
    other = mine if blocky[0] is saved else saved
    S = int(other.get("model_stages") or 0)
    form = f" (this model as blocks: cut={[n // S] * S})" if S and n % S == 0 else ""
    side = "the checkpoint's" if other is saved else "this run's"
    return (
        f". Only models of blocks (a cut=, the Flax adapters, block_fn) move between cuts and stage counts, "
        f"and {side} model is one module per stage (the reference GPT without cut=): build it with cut= on "
        f"both sides{form}"
    )


def model_difference(saved: dict, mine: dict) -> str:
    """What differs between two fingerprints' models, in words (ties, then up to three leaves)."""
    out = []
    if "tied" in saved and saved.get("tied") != mine.get("tied"):
        out.append(
            f"tied arrays {saved.get('tied') or 'none'} in the checkpoint, {mine.get('tied') or 'none'} here"
        )
    if "model_leaves" in saved:
        a = {k: (tuple(sh), dt) for k, sh, dt in saved["model_leaves"]}
        b = {k: (tuple(sh), dt) for k, sh, dt in mine["model_leaves"]}
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                fmt = lambda v: "absent" if v is None else f"{v[1]}{list(v[0])}"
                out.append(f"{k or 'params'}: {fmt(a.get(k))} in the checkpoint, {fmt(b.get(k))} here")
    shown = out[:4]
    return (
        "" if not shown else ": " + "; ".join(shown) + (f" (and {len(out) - 4} more)" if len(out) > 4 else "")
    )


#: what a failed write says, whatever layer (OSError, tensorstore's ValueError) reports it
_WRITE_FAILURES = (
    "File too large",
    "No space left",
    "Permission denied",
    "Operation not permitted",
    "Read-only file system",
    "Disk quota exceeded",
    "Failed writing",
)


class CheckpointWriteError(ConfigError):
    """A checkpoint that could not be written (disk full, file-size limit, permissions changed mid-run)."""


def _write_failure(e: BaseException) -> Optional[str]:
    """The reason, in one line, if ``e`` is a failed write; None otherwise."""
    text = f"{type(e).__name__}: {e}"
    for phrase in _WRITE_FAILURES:
        if phrase in text:
            tail = text.split(phrase, 1)[1].split("[")[0].strip(" :")
            return (phrase + (f" ({tail[:80]})" if tail and phrase == "Failed writing" else "")).strip()
    return "OSError: " + str(e)[:120] if isinstance(e, OSError) else None


class _QuietOrbaxWrites:
    """A logging filter for Orbax's background threads: a failed write is logged there with every traceback
    (hundreds of lines) before it reaches the caller, which gets it as one :class:`CheckpointWriteError`."""

    def filter(self, record) -> bool:
        if "orbax" not in (record.pathname or "") or record.levelno < 40:
            return True
        text = record.getMessage() + (
            str(record.exc_info[1]) if record.exc_info and record.exc_info[1] else ""
        )
        return not any(p in text for p in _WRITE_FAILURES)


def _closed_loop_callback(u) -> bool:
    """Whether an unraisable exception is tensorstore's completion callback finding Orbax's event loop closed
    (``call_soon_threadsafe`` -> "Event loop is closed"): after a failed write Orbax closes its loop while
    tensorstore's threads still report the other files' writes, each as a traceback on stderr."""
    if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
        return False
    tb = u.exc_traceback
    return tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"


def _quiet_closed_loop_callbacks():
    """Drop :func:`_closed_loop_callback` reports (a failed write reaches the caller as one
    :class:`CheckpointWriteError`); every other unraisable exception goes to the hook that was there."""
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "_jaxpipe_quiet", False):
        return

    def hook(u):
        if not _closed_loop_callback(u):
            previous(u)

    hook._jaxpipe_quiet = True
    sys.unraisablehook = hook


class CorruptCheckpoint(ConfigError):
    """A checkpoint whose arrays do not match the checksums saved with them (or that cannot be read)."""


def meta_digest(meta: dict) -> str:
    """SHA-256 of the metadata's canonical JSON, its own digest left out."""
    import json

    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _digest(a):
    import jax.numpy as jnp

    if a.dtype == jnp.bool_:
        a = a.astype(jnp.uint8)
    bits = a.view({1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[a.dtype.itemsize]).ravel()
    bits = bits.astype(jnp.uint32)
    pos = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * pos, dtype=jnp.uint32)])


# one program per state structure, compiled once (not again at every save)
_digests = jax.jit(lambda xs: [_digest(x) for x in xs])


def checksums(tree) -> Dict[str, list]:
    """Per array leaf: two 32-bit sums of its bits (plain and position-weighted), computed on the devices:
    any single flipped bit changes the first; reordered values change the second."""
    flat = [
        (jax.tree_util.keystr(k), v)
        for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
        if hasattr(v, "dtype") and hasattr(v, "shape")
    ]
    sums = _digests([v for _, v in flat]) if flat else []
    if jax.process_count() == 1:
        sums = jax.device_get(sums)
    else:  # results of a collective: every process reads them locally
        from jax.experimental import multihost_utils

        sums = [
            np.asarray(s.addressable_shards[0].data)
            if s.sharding.is_fully_replicated
            else multihost_utils.process_allgather(s, tiled=True)
            for s in sums
        ]
    return {k: [int(x) for x in np.asarray(s).reshape(-1)[:2]] for (k, _), s in zip(flat, sums)}


class _DirectoryLock:
    """``<dir>/.jaxpipe.lock``, held with an exclusive ``flock`` for as long as the run lives: the kernel
    releases it when the process dies, so a dead owner's lock is free at once, and two processes taking it
    over at the same moment cannot both get it (a lock file of a dead pid, unlinked and created again, let 51
    of 300 racing pairs both believe they held it).  The file names its owner (host, pid, time) for the error
    message."""

    def __init__(self, directory: str):
        import fcntl
        import json
        import socket
        import time

        self.path = os.path.join(directory, ".jaxpipe.lock")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        if os.path.isdir(self.path):
            raise ConfigError(
                f"{self.path} is a directory; jaxpipe keeps its writer lock in a file of that name. "
                f"Remove that directory (it is not a checkpoint) or use another --checkpoint_dir"
            )
        while True:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _owner(fd)
                os.close(fd)
                who = (
                    f"process {owner['pid']} on host {owner.get('host')} (since {owner.get('since')})"
                    if owner.get("pid")
                    else "another process (which has not written its name yet)"
                )
                raise ConfigError(
                    f"checkpoint directory {directory} is in use by {who}: two runs writing one directory "
                    "would "
                    f"mix their steps. Stop that run or use another --checkpoint_dir"
                ) from None
            # the holder unlinks the file on release: a lock got on a file no longer at the path is no lock
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        before = _owner(fd)
        if before.get("pid") and before.get("pid") != me["pid"]:
            print(
                f"jaxpipe: taking over the lock of {directory} left by process {before.get('pid')} on host "
                f"{before.get('host')} (no longer holding it)",
                flush=True,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd, self.owner = fd, me

    def release(self):
        import fcntl

        if self.fd is not None:
            try:
                os.unlink(self.path)  # while still holding it (see __init__'s check of the path)
            except OSError:  # a directory made read-only: the file stays, the lock goes (the
                pass  # next run takes it over: flock is free once released)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _owner(fd) -> dict:
    """The owner a lock file names ({} when empty or unreadable)."""
    import json

    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def _check_stash(step, saved: dict, want: dict) -> None:
    """A no-flush state's stash holds one array per residual kept of ``stage_fn``'s pullback: another number
    in the checkpoint means the residuals are kept differently there, and its in-flight micro-batches cannot
    be carried over (the micro-batch size would change shapes, not the count)."""
    count = lambda d: sum(1 for k in d if k.startswith(".carry.stash["))
    a, b = count(saved), count(want)
    if saved and a != b:
        raise ConfigError(
            f"checkpoint step {step} keeps {a} residual arrays of each in-flight micro-batch, this run {b}: "
            "the "
            f"stage's residuals are kept differently -- another residuals= policy (or recompute=), another "
            "stage_fn, or a jaxpipe before 2026-11-27, which also stashed residuals that depend on no "
            "activation "
            "(a causal mask's). The micro-batches in flight cannot move between the two. Resume with what "
            "wrote "
            f"it, or start this run from its weights (pipe.params(state) of the restored state) in another "
            f"directory"
        )


def _shapes(tree) -> Dict[str, list]:
    return {
        jax.tree_util.keystr(k): [int(d) for d in np.shape(v)]
        for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _carry_missing(tree) -> bool:
    """Whether a no-flush state's in-flight buffers (``carry``) are not allocated yet.  (Other ``None``s are
    legitimate: a tied parameter's post copy is ``None`` in the train state.)"""
    return hasattr(tree, "carry") and tree.carry is None


def nonfinite_leaves(tree):
    """Key paths of floating-point leaves holding NaN or Inf (checked on device, one bool per leaf)."""
    import jax.numpy as jnp

    flat = [
        (k, v)
        for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
        if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating)
    ]
    if not flat:
        return []
    ok = jax.jit(lambda xs: [jnp.all(jnp.isfinite(x)) for x in xs])([v for _, v in flat])
    return [jax.tree_util.keystr(k) for (k, _), good in zip(flat, ok) if not bool(good)]
