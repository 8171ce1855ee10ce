"""Train a pipelined model on bundled data, on CPU-emulated devices by default.

    jaxpipe train                  # GPT-style byte LM on pydoc text, 4 stages, 1F1B
    jaxpipe train --model=mlp --schedule=gpipe --stages=2 --data=2 --steps=300

Shows a progress bar, writes one JSON line of metrics per step to ``<out_dir>/metrics.jsonl``, evaluates on
held-out data every ``--eval_every`` steps, and ends with a summary (and, for the LM, a sample of text).

    # checkpoints: every 50 steps and at exit (or on SIGTERM), keep 3; run the same command again to resume
    jaxpipe train --checkpoint_dir=ckpt --checkpoint_every=50
    # two processes, 2 CPU devices each, one 4-stage pipeline across them (or: jaxpipe launch)
    jaxpipe train --stages=4 --num_processes=2 --process_id=0 --coordinator=127.0.0.1:12355 &
    jaxpipe train --stages=4 --num_processes=2 --process_id=1 --coordinator=127.0.0.1:12355

A NaN or Inf loss stops the run with the step and the stage where it first appeared (``--on_nonfinite=skip``
skips such updates instead, synchronous schedules); a non-finite state is never checkpointed.
"""

from __future__ import annotations

import functools
import os
import sys

from jaxpipe.cli import common as cli
from absl import app, flags


@functools.cache
def define_flags() -> None:
    """The command's flags, defined when it runs (importing the module defines none; ``jaxpipe
    configure`` defines them too, as they are its flags)."""
    _model_and_mesh_flags()
    _search_flags()
    _optimisation_flags()
    _model_size_flags()
    _run_flags()
    _multihost_flags()
    _checkpoint_flags()
    _debug_flags()


def _model_and_mesh_flags() -> None:
    """The model, the schedule and the mesh's axes."""
    flags.DEFINE_string(
        "model",
        "gpt",
        "gpt: byte-level transformer LM on pydoc_data text; mlp: residual MLP on "
        "sklearn digits; package.module:factory: your own model and batches (jaxpipe.cli.factories "
        "says what the factory returns), with this runner's whole loop",
    )
    flags.DEFINE_string(
        "schedule",
        "1f1b",
        "pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v, dualpipe_v, "
        "chimera (synchronous: the gradient of jax.grad); avgpipe (parallel flushing pipelines, "
        "elastically averaged); wpipe, cdp_v1, cdp_v2, pipedream, pipedream_2bw, spectrain, pipeoptim "
        "(asynchronous, no flush); see jaxpipe.schedules.available()" + cli.OWN_SCHEDULE_HELP,
    )
    flags.DEFINE_integer("stages", 4, "pipeline stages = devices on the mesh's 'stage' axis")
    flags.DEFINE_integer(
        "virtual", 2, "interleaved_1f1b: model chunks per device (the model gets stages x virtual)"
    )
    flags.DEFINE_integer("chimera_pipelines", 2, "chimera: 2f pipelines (f dividing stages / 2)")
    flags.DEFINE_enum(
        "chimera_concat",
        "direct",
        ["direct", "forward_doubling", "backward_halving"],
        "chimera: how units of D micro-batches are concatenated when N > D (§3.5)",
    )
    flags.DEFINE_bool(
        "chimera_eager", False, "chimera: reduce the last stage's replica gradients eagerly (§3.2)"
    )
    flags.DEFINE_integer("data", 1, "data-parallel replicas of the pipeline (mesh 'data' axis)")
    flags.DEFINE_integer(
        "tensor",
        1,
        "gpt: tensor parallelism inside each stage (mesh 'tensor' axis): the MLP's up / "
        "down projections split Megatron-style",
    )
    flags.DEFINE_integer(
        "fsdp",
        1,
        "gpt: FSDP inside each stage (mesh 'fsdp' axis): the kernels and token embedding "
        "sharded, the batch split over it too",
    )
    flags.DEFINE_integer(
        "pipes", 1, "avgpipe: parallel pipelines N (mesh 'pipe' axis; the batch is split over them)"
    )
    flags.DEFINE_string(
        "advance", "auto", "avgpipe: forwards in advance beyond 1F1B (integer) or 'auto' (Algorithm 1)"
    )


def _search_flags() -> None:
    """``--auto``: the configuration search and what it considers."""
    flags.DEFINE_bool(
        "auto",
        False,
        "choose the stage x data split of --stages x --data devices, the schedule, "
        "--microbatches and the residual policy with jp.configure (the predicted-fastest that fits "
        "--memory_budget_mb); prints the candidates' table",
    )
    flags.DEFINE_float(
        "memory_budget_mb", 0.0, "--auto: memory per device in MiB the configuration must fit (0: no limit)"
    )
    flags.DEFINE_list(
        "auto_schedules", ["1f1b", "gpipe", "zb_h1", "interleaved_1f1b"], "--auto: the schedules it considers"
    )
    flags.DEFINE_list("auto_microbatches", ["2", "4", "8"], "--auto: the micro-batch counts it considers")
    flags.DEFINE_list(
        "auto_axes",
        [],
        "--auto (gpt): model axes it also splits the devices into, 'tensor' and / or "
        "'fsdp' (the GPT's MLP split Megatron-style / its kernels and the batch sharded): stage x data x "
        "those, each of every size that divides the devices",
    )
    flags.DEFINE_enum(
        "residuals",
        "all",
        ["all", "inputs"],
        "what a stage keeps between its forward and backward: "
        "every residual, or only its input (the backward recomputes the forward: less memory, more flops)",
    )


def _optimisation_flags() -> None:
    """The batch, the steps, the optimiser and its learning rate."""
    flags.DEFINE_integer("microbatches", 4, "micro-batches per step (per data replica)")
    flags.DEFINE_integer(
        "batch", 32, "global batch size (sequences or images); divisible by data x microbatches"
    )
    flags.DEFINE_integer("steps", 300, "optimizer steps")
    flags.DEFINE_string("optimizer", "adamw", "sgd | momentum | adam | adamw")
    flags.DEFINE_float("lr", 3e-3, "peak learning rate (after --warmup, then --lr_schedule)")
    flags.DEFINE_enum(
        "lr_schedule",
        "cosine",
        ["cosine", "linear", "rsqrt", "constant"],
        "after the warm-up: cosine or linear decay to 0, rsqrt (lr sqrt(warm-up / step)), or constant "
        "(jaxpipe.optim.schedule_by_name)",
    )
    flags.DEFINE_enum(
        "tensorboard",
        "auto",
        ["auto", "true", "false"],
        "metrics also as TensorBoard event files in <out_dir>/tensorboard (tensorboardX; auto: where it "
        'is installed -- pip install -e ".[tensorboard]")',
    )
    flags.DEFINE_float(
        "warmup", 0.05, "linear warm-up from 0 to --lr: a fraction of --steps if below 1, else steps"
    )


def _model_size_flags() -> None:
    """The bundled models' sizes, cut, dropout, tying, padding and dtype."""
    flags.DEFINE_integer("seq_len", 64, "gpt: context length in bytes")
    flags.DEFINE_integer("d_model", 64, "gpt: model width / mlp: hidden width")
    flags.DEFINE_integer("heads", 4, "gpt: attention heads")
    flags.DEFINE_integer(
        "blocks_per_stage", 1, "gpt: transformer blocks per stage / mlp: residual blocks per stage"
    )
    flags.DEFINE_string(
        "cut",
        "",
        "gpt: blocks per stage where they differ, e.g. 3,3,2,2 (one count per --stages; "
        "interleaved / two-chunk schedules split each into chunks), or 'balanced': chosen from the "
        "measured costs of a block, the embedding and the head (printed with the even cut's prediction); "
        "'' = --blocks_per_stage on every stage",
    )
    flags.DEFINE_integer(
        "blocks", 0, "gpt with --cut=balanced: transformer blocks in all (0: stages x blocks_per_stage)"
    )
    flags.DEFINE_float(
        "dropout", 0.0, "gpt: residual dropout rate inside the stages (keys per step, micro-batch, stage)"
    )
    flags.DEFINE_bool(
        "tie_embeddings", False, "gpt: the output head reuses the input embedding (one tied array)"
    )
    flags.DEFINE_bool(
        "pad", False, "gpt: variable-length sequences with a padding mask; exact masked mean loss"
    )
    flags.DEFINE_enum(
        "dtype", "float32", ["float32", "bfloat16"], "compute dtype (float32 master weights either way)"
    )


def _run_flags() -> None:
    """Evaluation, output, progress and host memory."""
    flags.DEFINE_integer(
        "eval_every", 50, "evaluate on held-out data every this many steps (0: only at the end)"
    )
    flags.DEFINE_integer("eval_batches", 4, "held-out batches per evaluation")
    flags.DEFINE_integer("sample_len", 160, "gpt: bytes of text to sample at the end (0: none)")
    flags.DEFINE_integer("seed", 0, "seed for parameters and data order")
    flags.DEFINE_string("out_dir", "runs/train", "where metrics.jsonl and summary.json go")
    flags.DEFINE_bool(
        "progress",
        True,
        "show progress: a bar on a terminal, a line every --progress_every steps "
        "when the output goes to a file or a pipe",
    )
    flags.DEFINE_integer(
        "progress_every", 0, "steps between progress lines when not on a terminal (0: a tenth of the run)"
    )
    flags.DEFINE_bool(
        "keep_freed_memory",
        True,
        "glibc keeps freed memory for the next step instead of mapping and "
        "page-faulting each step's large buffers again (jaxpipe.host_memory; what a Pipeline on CPU "
        "devices does by default; the process keeps its peak memory); false: glibc's defaults",
    )
    flags.DEFINE_bool(
        "nan_bubbles", False, "debug: fill pipeline bubbles with NaN (results must stay finite)"
    )


def _multihost_flags() -> None:
    """A multi-process job (``jax.distributed``)."""
    flags.DEFINE_string("coordinator", None, "multi-host: process 0's HOST:PORT (or JAX_COORDINATOR_ADDRESS)")
    flags.DEFINE_integer(
        "num_processes",
        None,
        "multi-host: number of processes (or JAX_NUM_PROCESSES); the mesh spans all their devices",
    )
    flags.DEFINE_integer("process_id", None, "multi-host: this process's index (or JAX_PROCESS_ID)")
    flags.DEFINE_bool(
        "verbose",
        False,
        "multi-host: also print the collective library's connection lines ('[Gloo] Rank i "
        "is connected to ...'), dropped by default",
    )
    flags.DEFINE_integer(
        "heartbeat_timeout",
        15,
        "multi-host: seconds without a heartbeat after which a dead process "
        "is declared and the job aborts (JAX's default: 100)",
    )
    flags.DEFINE_integer("init_timeout", 60, "multi-host: seconds to wait for the coordinator before failing")


def _checkpoint_flags() -> None:
    """Checkpoints, non-finite steps, stops and the final parameters."""
    flags.DEFINE_string(
        "checkpoint_dir", None, "Orbax checkpoints of the whole train state; a run finding one resumes"
    )
    flags.DEFINE_integer(
        "checkpoint_every", 0, "save every this many steps (0: only at exit); asynchronous writes"
    )
    flags.DEFINE_integer("checkpoint_keep", 3, "checkpoints kept (the oldest are deleted)")
    flags.DEFINE_enum(
        "on_nonfinite",
        "stop",
        ["stop", "skip"],
        "a NaN/Inf loss or gradient: stop with the step and "
        "the stage where it appeared, or skip that update (synchronous schedules)",
    )
    flags.DEFINE_string("save_params", None, "write the final parameters to this .npz (process 0)")
    flags.DEFINE_float(
        "stop_grace_s",
        60.0,
        "after a second SIGTERM/SIGINT: seconds the stop-save may still take "
        "before the process exits (a third signal exits at once)",
    )
    flags.DEFINE_bool(
        "overlap_steps",
        True,
        "read a step's loss while the next step runs, so the device never waits for the host between steps "
        "(the debug flags --stop_at_step, --fail_at_step and --stall_at_step read each step before the next)",
    )


def _debug_flags() -> None:
    """Faults on purpose, for the tests of stops, failures and stalls."""
    flags.DEFINE_integer(
        "stop_at_step", 0, "debug: act as if preempted (SIGTERM) after this step: checkpoint, exit 143"
    )
    flags.DEFINE_integer(
        "fail_at_step",
        0,
        "debug: process --fail_process raises an error after this step (a worker "
        "that fails: the job must end in bounded time)",
    )
    flags.DEFINE_integer("fail_process", 0, "debug: the process --fail_at_step fails")
    flags.DEFINE_integer(
        "stall_at_step",
        0,
        "debug: process --fail_process stalls (sleeps) after this step (a "
        "worker stuck in user code: jaxpipe launch's watchdog must stop the job)",
    )
    flags.DEFINE_float("throttle_s", 0.0, "debug: sleep this long after each step (fault-injection tests)")


FLAGS = flags.FLAGS


def printable(text: str) -> str:
    """Control characters (a young model samples BEL, NUL, ...) escaped, so the terminal shows them as
    text."""
    return "".join(
        c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
        for c in text
    )


#: this runner's flags that a process may set for itself; every other one of its flags must agree
PER_PROCESS = {
    "out_dir",
    "progress",
    "progress_every",
    "coordinator",
    "process_id",
    "verbose",
    "heartbeat_timeout",
    "init_timeout",
    "stop_grace_s",
    "throttle_s",
    "fail_at_step",
    "fail_process",
    "stall_at_step",
}


def main(argv):
    """``jaxpipe train``: :func:`run`, guarded (:func:`guarded`)."""
    guarded(run, argv)


def guarded(body, argv):
    """``body(argv)``; a process of a multi-process job that fails exits at once with status 1 (its traceback
    printed): a normal exit runs JAX's distributed shutdown, which waits for the other processes -- stuck in
    the collective this one will never join -- and hung the job for minutes.  The others notice through the
    coordination service's heartbeat (``--heartbeat_timeout``).  A refused configuration (``ConfigError``) on
    one process prints its message, no traceback, and exits 2."""
    try:
        body(argv)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        if type(e).__name__ == "CheckpointWriteError":  # disk full, a size limit: one line, no traceback
            try:  # (by name: importing it would import JAX too early)
                sys.stderr.write(f"jaxpipe: {e}\n")
                sys.stderr.flush()
            finally:
                os._exit(1)
        jax = sys.modules.get("jax")
        if jax is None or not jax.distributed.is_initialized() or jax.process_count() == 1:
            if (
                type(e).__name__ == "ConfigError"
            ):  # a refused configuration or step: its message, no traceback
                sys.stderr.write(f"jaxpipe: {e}\n")
                sys.stderr.flush()
                sys.exit(2)
            raise
        import time
        import traceback

        try:
            traceback.print_exc()
            sys.stderr.write(
                f"jaxpipe: process {jax.process_index()} of {jax.process_count()} failed (above); "
                f"exiting now -- the other processes stop within --heartbeat_timeout="
                f"{FLAGS.heartbeat_timeout} s\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
        except OSError:
            pass
        if jax.process_index() == 0 and type(e).__name__ == "ConfigError":
            # a start-up check every process makes: process 0 hosts the coordination service, whose end
            # aborts the others -- give them a moment to say the same
            time.sleep(3)
        os._exit(1)


def run(argv):
    """Build the model, the mesh and the pipeline from the flags, then train through :func:`jaxpipe.train`."""
    del argv
    from absl import logging

    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    n_proc = _start_process()
    import jax
    import jaxpipe as jp

    primary = jax.process_index() == 0
    say = print if primary else (lambda *a, **k: None)
    _check_paths()
    if FLAGS.auto:
        _auto_configure(jp, say)
    pipe, parts, sched = _build_pipeline(jp)
    state = pipe.init()
    _describe(jp, pipe, state, n_proc, say)
    if primary:
        _save_resolved_flags()
    try:
        result = jp.train(
            pipe,
            parts.batches,
            eval_batches=parts.eval_batches,
            evaluate=parts.evaluate,
            hooks=[_debug_hook],
            state=state,
            **_train_options(parts, sched),
        )
    except jp.training.NonFiniteLoss as e:
        sys.stderr.write(f"\njaxpipe: {e}\n")
        sys.exit(3)
    if FLAGS.save_params:
        _save_params(jp, pipe, result.state, primary, parts.to_modules)
    if result.summary is not None:
        _report(jp, pipe, parts.model, result, primary)


def _check_paths() -> None:
    """``--out_dir``, ``--checkpoint_dir`` and ``--save_params`` checked before anything runs: a path that
    cannot be written would lose the run's result at its end."""
    from jaxpipe.training.loop import check_directory

    for name in ("out_dir", "checkpoint_dir"):
        if FLAGS[name].value:
            check_directory(FLAGS[name].value, f"--{name}")
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    if FLAGS.save_params:
        from jaxpipe.checkpoint import check_params_path

        FLAGS.save_params = check_params_path(FLAGS.save_params, "--save_params")


#: flags left out of ``config.flags``: one process's identity and the debug switches
NOT_RERUN = (
    "flagfile",
    "coordinator",
    "process_id",
    "fail_at_step",
    "fail_process",
    "stall_at_step",
    "stop_at_step",
    "throttle_s",
)


def _save_resolved_flags() -> None:
    """The resolved configuration in ``<out_dir>/config.flags`` (``--flagfile=`` reruns it)."""
    from jaxpipe.cli.run_records import save_config

    save_config(FLAGS.out_dir, skip=NOT_RERUN)


def _train_options(parts, sched) -> dict:
    """:class:`jaxpipe.training.TrainOptions` from the flags."""
    return dict(
        steps=FLAGS.steps,
        out_dir=FLAGS.out_dir,
        eval_every=FLAGS.eval_every,
        checkpoint_dir=FLAGS.checkpoint_dir,
        checkpoint_every=FLAGS.checkpoint_every,
        checkpoint_keep=FLAGS.checkpoint_keep,
        on_nonfinite=FLAGS.on_nonfinite,
        # a fault injected after step N acts at step N, not after the step in flight
        overlap_steps=FLAGS.overlap_steps
        and not (FLAGS.stop_at_step or FLAGS.fail_at_step or FLAGS.stall_at_step),
        progress=FLAGS.progress,
        progress_every=FLAGS.progress_every,
        tensorboard=FLAGS.tensorboard,
        stop_grace_s=FLAGS.stop_grace_s,
        learning_rate=sched,
        units=parts.unit,
        units_per_step=FLAGS.batch * parts.per_row,
        describe={
            "model": FLAGS.model,
            "schedule": FLAGS.schedule,
            "stages": FLAGS.stages,
            "data": FLAGS.data,
            "microbatches": FLAGS.microbatches,
        },
    )


def choose(argv):
    """``jaxpipe configure``: the ``--auto`` choice for this command line's model and devices, printed with
    the candidates' table and the ``jaxpipe train`` flags that run it; nothing is trained."""
    del argv
    from absl import logging

    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    _start_process()
    import jaxpipe as jp

    _auto_configure(jp, print)
    chosen = {
        "stages": FLAGS.stages,
        "data": FLAGS.data,
        "tensor": FLAGS.tensor,
        "fsdp": FLAGS.fsdp,
        "schedule": FLAGS.schedule,
        "microbatches": FLAGS.microbatches,
        "residuals": FLAGS.residuals,
        "blocks_per_stage": FLAGS.blocks_per_stage,
    }
    if FLAGS.schedule == "interleaved_1f1b":
        chosen["virtual"] = FLAGS.virtual
    chosen = {k: v for k, v in chosen.items() if v != FLAGS[k].default or k in ("stages", "data", "schedule")}
    search = {"auto", "memory_budget_mb", "auto_schedules", "auto_microbatches", "auto_axes"}
    given = [a for a in sys.argv[1:] if a.split("=", 1)[0].lstrip("-") not in {*chosen, *search}]
    print("train it:\n  jaxpipe train " + " ".join(given + [f"--{k}={v}" for k, v in chosen.items()]))


def _start_process() -> int:
    """This process's part of the job: its devices (XLA_FLAGS, before JAX is imported), glibc's memory
    policy, and -- in a multi-process job -- the coordinator and the check that every process has the same
    flags.  Returns the number of processes."""
    from jaxpipe.distributed import settings

    try:
        coordinator, n_proc, proc = settings(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    except ValueError as e:
        raise app.UsageError(str(e))
    n_dev = FLAGS.stages * FLAGS.data * FLAGS.pipes * FLAGS.tensor * FLAGS.fsdp
    if n_dev % n_proc:
        raise app.UsageError(
            f"the mesh has {n_dev} devices (stages x data x pipes x tensor x fsdp), which {n_proc} processes "
            f"cannot hold equally; use a device count divisible by --num_processes"
        )
    if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_dev // n_proc}"
        ).strip()
    from jaxpipe import host_memory

    host_memory.choose(FLAGS.keep_freed_memory)
    import jaxpipe as jp

    if n_proc > 1:
        jp.distributed.initialize(
            coordinator,
            n_proc,
            proc,
            timeout_s=FLAGS.init_timeout,
            verbose=FLAGS.verbose,
            heartbeat_timeout_s=FLAGS.heartbeat_timeout,
        )
        # the flags that shape the computation or its collectives must be the same on every process
        own = {f.name for f in FLAGS.get_flags_for_module(sys.modules[__name__])}
        jp.distributed.check_agree({f"--{k}": FLAGS[k].value for k in sorted(own - PER_PROCESS)}, "flags")
    return n_proc


def _auto_arguments(jp):
    """--auto's flags checked, each refusal naming its flag; returns ``(devices, memory budget in bytes,
    micro-batch counts)``."""
    import jax

    if jax.process_count() > 1 or FLAGS.tensor > 1 or FLAGS.fsdp > 1 or FLAGS.pipes > 1:
        raise app.UsageError(
            "--auto chooses stage x data on one process (no --tensor / --fsdp / --pipes; "
            "--auto_axes=tensor,fsdp lets it split the devices over those too): run it once "
            "there and give the flags it prints to the multi-process job"
        )
    bad = [a for a in FLAGS.auto_axes if a not in ("tensor", "fsdp")]
    if bad or (FLAGS.auto_axes and FLAGS.model != "gpt"):
        raise app.UsageError(
            f"--auto_axes={','.join(FLAGS.auto_axes)}: the model axes --auto can add are 'tensor' "
            f"and 'fsdp', for --model=gpt (its param_specs name them)"
        )
    if FLAGS.cut:
        raise app.UsageError(
            f"--auto cuts the model evenly for the stages it considers; drop --cut={FLAGS.cut}"
        )
    devices = FLAGS.stages * FLAGS.data
    mb = FLAGS.memory_budget_mb
    if not (mb == mb and 0 <= mb < float("inf")):  # NaN, negative, infinite: not a budget
        raise app.UsageError(
            f"--memory_budget_mb={mb:g}: give the MiB a device may hold (> 0), or 0 for no limit"
        )
    budget = mb * 2**20 if mb > 0 else float("inf")
    flushing = [n for n in jp.schedules.available() if jp.schedules.method(n).flushes]
    bad = [n for n in FLAGS.auto_schedules if n not in flushing]
    if bad or not FLAGS.auto_schedules:
        raise app.UsageError(
            f"--auto_schedules={','.join(FLAGS.auto_schedules)}: "
            f"{f'{bad[0]!r} is not one' if bad else 'none given'}; --auto chooses among "
            f"{', '.join(flushing)}"
        )
    try:
        counts = tuple(int(m) for m in FLAGS.auto_microbatches)
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise app.UsageError(
            f"--auto_microbatches={','.join(FLAGS.auto_microbatches)}: give positive micro-batch "
            f"counts, e.g. 2,4,8"
        )
    if not any(FLAGS.batch % (d * m) == 0 for m in counts for d in range(1, devices + 1) if devices % d == 0):
        raise app.UsageError(
            f"--auto_microbatches={','.join(FLAGS.auto_microbatches)}: none of them splits "
            f"--batch={FLAGS.batch} rows over any data split of {devices} devices; give counts "
            f"that divide the batch (e.g. 2,4,8 for --batch=32)"
        )
    return devices, budget, counts


def _auto_configure(jp, say):
    """--auto: ``jp.configure`` over the --stages x --data devices for the model of --stages x
    --blocks_per_stage blocks; the choice is written into the flags (--stages, --data, --schedule,
    --microbatches, --residuals, --blocks_per_stage: the same blocks cut for the chosen stages), which the run
    then builds as given."""
    import optax
    from jaxpipe.cli import factories

    devices, budget, counts = _auto_arguments(jp)
    # the model as given (--stages x --blocks_per_stage blocks), cut into n stages for each candidate
    blocks = FLAGS.stages * FLAGS.blocks_per_stage

    def make(n):
        if blocks % n:
            raise jp.ConfigError(f"{blocks} blocks do not cut into {n} stages")
        # the model's specs name the axes --auto_axes lists (a candidate without them drops the specs)
        FLAGS.blocks_per_stage = blocks // n
        FLAGS.tensor, FLAGS.fsdp = (
            (2 if "tensor" in FLAGS.auto_axes else 1),
            (2 if "fsdp" in FLAGS.auto_axes else 1),
        )
        try:
            return factories.build(FLAGS.model, n, FLAGS.batch, FLAGS.seed).model
        finally:
            FLAGS.blocks_per_stage = blocks // FLAGS.stages
            FLAGS.tensor = FLAGS.fsdp = 1

    sample = jp.training.streams.peek(
        factories.build(FLAGS.model, FLAGS.stages, FLAGS.batch, FLAGS.seed).batches
    )
    split = " x ".join(["stage", "data"] + list(FLAGS.auto_axes))
    say(
        f"--auto: choosing among {split} splits of {devices} devices, {', '.join(FLAGS.auto_schedules)}, "
        f"M in {', '.join(FLAGS.auto_microbatches)}, residuals all / inputs"
        f"{f', within {FLAGS.memory_budget_mb:g} MiB a device' if FLAGS.memory_budget_mb > 0 else ''} ..."
    )
    conf = jp.configure(
        make,
        sample,
        optax.adamw(1e-3),
        devices=devices,
        memory_budget=budget,
        schedules=tuple(FLAGS.auto_schedules),
        microbatches=counts,
        verbose=False,
    )
    best = conf.best
    say(conf.table())
    if conf.cut_note:
        say(f"--auto: cut: {conf.cut_note}")
    axes = "".join(f" --{a}={v}" for a, v in (("tensor", best.tensor), ("fsdp", best.fsdp)) if v > 1)
    say(
        f"--auto chose: --stages={best.stages} --data={best.data}{axes} --schedule={best.schedule} "
        f"--microbatches={best.microbatches} --residuals={best.residuals} "
        f"--blocks_per_stage={blocks // best.model_stages}"
        f"{' --virtual=2' if 'virtual' in best.pipeline_kwargs()['options'] else ''}"
    )
    FLAGS.blocks_per_stage = blocks // best.model_stages
    FLAGS.stages, FLAGS.data, FLAGS.schedule = best.stages, best.data, best.schedule
    FLAGS.tensor, FLAGS.fsdp = best.tensor, best.fsdp
    FLAGS.microbatches, FLAGS.residuals = best.microbatches, best.residuals
    if "virtual" in best.pipeline_kwargs()["options"]:
        FLAGS.virtual = best.pipeline_kwargs()["options"]["virtual"]


def _build_pipeline(jp):
    """The model (``--model``'s factory), the optimizer with its learning-rate schedule, the mesh and the
    :class:`~jaxpipe.Pipeline`; returns (pipe, the factory's parts, the schedule)."""
    import optax

    own = _own_schedule(jp)
    if own is None and FLAGS.schedule not in jp.schedules.METHODS:
        raise app.UsageError(
            f"--schedule={FLAGS.schedule}: choose one of {', '.join(jp.schedules.available())}"
            + cli.OWN_SCHEDULE_HELP
        )
    method = jp.schedules.method(jp.schedules.USER_SCHEDULE if own else FLAGS.schedule)
    # model stages per device (interleaved: --virtual chunks; wpipe: G0 and G1), as the registry declares it
    n_stages = (
        own.num_model_stages if own else FLAGS.stages * method.stages_per_device({"virtual": FLAGS.virtual})
    )
    # the flags that set schedule options, passed to the methods whose registry schema has them
    flag_options = {
        "virtual": FLAGS.virtual,
        "pipelines": FLAGS.chimera_pipelines,
        "concat": FLAGS.chimera_concat,
        "eager_reduce": FLAGS.chimera_eager,
        "advance": "auto" if FLAGS.advance == "auto" else int(FLAGS.advance),
    }
    extra = {"options": {k: v for k, v in flag_options.items() if k in method.options}}
    if FLAGS.pipes != 1 and method.runner != "avgpipe":
        raise app.UsageError(f"--pipes={FLAGS.pipes} is for --schedule=avgpipe (parallel pipelines)")
    from jaxpipe.cli import factories

    parts = factories.build(FLAGS.model, n_stages, FLAGS.batch, FLAGS.seed)
    # a linear warm-up over --warmup (5% of the steps by default, at least one), then --lr_schedule
    try:
        sched = jp.optim.schedule_by_name(FLAGS.lr_schedule, FLAGS.lr, FLAGS.steps, FLAGS.warmup)
    except jp.ConfigError as e:
        raise app.UsageError(str(e))
    opt = optax.chain(optax.clip_by_global_norm(1.0), jp.optim.by_name(FLAGS.optimizer, sched))
    mesh = jp.make_mesh(
        stages=FLAGS.stages, data=FLAGS.data, pipes=FLAGS.pipes, tensor=FLAGS.tensor, fsdp=FLAGS.fsdp
    )
    jp.distributed.check_mesh_covers_processes(mesh)
    if FLAGS.fsdp > 1:
        extra["batch_axes"] = ("data", "fsdp")  # FSDP: data parallelism with sharded weights
    # synchronous schedules guard every update (a non-finite step leaves the state as it was), so a stop
    # can say where the NaN came from with the very weights the step used; --on_nonfinite decides what next
    guard = not method.updates_inside
    if FLAGS.on_nonfinite == "skip" and not guard:
        raise app.UsageError(
            f"--on_nonfinite=skip needs a synchronous schedule: {FLAGS.schedule} updates inside "
            f"the pipeline, so there is no single update to skip; use --on_nonfinite=stop"
        )
    pipe = jp.Pipeline(
        parts.model,
        schedule=own or FLAGS.schedule,
        num_microbatches=FLAGS.microbatches,
        optimizer=opt,
        mesh=mesh,
        nan_bubbles=FLAGS.nan_bubbles,
        skip_nonfinite=guard,
        seed=FLAGS.seed,
        precision=jp.Precision(params="float32", compute=FLAGS.dtype),
        residuals=FLAGS.residuals,
        **extra,
    )
    return pipe, parts, sched


def _own_schedule(jp):
    """The schedule of one's own ``--schedule`` names (a CSV file: :func:`jaxpipe.cli.common.schedule_file`),
    checked against --stages and --microbatches; None for a schedule's name."""
    own = cli.schedule_file(FLAGS.schedule, FLAGS.microbatches)
    if own is None:
        return None
    for flag, value, its in (
        ("stages", FLAGS.stages, own.D),
        ("microbatches", FLAGS.microbatches, own.num_microbatches),
    ):
        if value != its:
            what = "rows (devices)" if flag == "stages" else "micro-batches"
            raise app.UsageError(
                f"--{flag}={value}, but the schedule in {FLAGS.schedule} has {its} {what}: "
                f"give --{flag}={its}"
            )
    FLAGS.schedule = FLAGS.schedule.replace(
        "{M}", str(FLAGS.microbatches)
    )  # the file read, as reports name it
    return own


def _describe(jp, pipe, state, n_proc, say):
    """The run's first lines: the model, the mesh, the schedule's simulated bubble, the model axes' memory."""
    import jax

    r = pipe.schedule.simulate(f=1.0, b=2.0)  # a split backward: B and W share it
    say(
        f"jaxpipe: {FLAGS.model} ({sum(x.size for x in jax.tree.leaves(pipe.model.params)):,} parameters), "
        f"{FLAGS.schedule}, mesh data={FLAGS.data} x stage={FLAGS.stages}"
        f"{f' x fsdp={FLAGS.fsdp}' if FLAGS.fsdp > 1 else ''}"
        f"{f' x tensor={FLAGS.tensor}' if FLAGS.tensor > 1 else ''}, "
        f"M={FLAGS.microbatches}, batch {FLAGS.batch}, {FLAGS.optimizer} lr {FLAGS.lr:g}"
        f"{', residuals=' + FLAGS.residuals if FLAGS.residuals != 'all' else ''}"
    )
    say(
        f"schedule: {r.num_ticks} ticks/step, simulated bubble {r.bubble_ratio:.1%} (lockstep "
        f"{r.lockstep_bubble_ratio:.1%}), peak in-flight micro-batches per device {r.peak_inflight}"
    )
    if FLAGS.tensor > 1 or FLAGS.fsdp > 1:
        held = lambda t: sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(t) if hasattr(x, "nbytes")
        )
        full = lambda t: sum(x.nbytes for x in jax.tree.leaves(t) if hasattr(x, "nbytes"))
        st = (state.params, state.opt_state)
        say(
            f"model axes: tensor={FLAGS.tensor} fsdp={FLAGS.fsdp}: parameters + optimizer state "
            f"{held(st) / 2**20:.2f} MiB on device 0 of {full(st) / 2**20:.2f} MiB in all "
            f"({full(st) / FLAGS.stages / 2**20:.2f} MiB per stage device unsharded)"
        )
    if n_proc > 1:
        say(
            f"multi-host: {n_proc} processes x {jax.local_device_count()} {jax.devices()[0].platform} "
            "devices; "
            f"each feeds its own devices' shards"
        )


def _report(jp, pipe, model, result, primary):
    """The summary and, for the GPT, a sample of text (added to summary.json)."""
    import json
    import jax

    summary, sample_params = result.summary, None
    if FLAGS.model == "gpt" and FLAGS.sample_len:
        # a collective on many hosts: every process gathers, process 0 samples (a jitted function may not
        # close over an array spanning devices of other processes)
        sample_params = jp.distributed.to_host(pipe.params(result.state))
    if not primary:
        return
    print("\n== summary ==")
    for k, v in summary.items():
        print(f"  {k:>26}: {v:.4g}" if isinstance(v, float) else f"  {k:>26}: {v}")
    if sample_params is not None:
        prompt = b"The "
        text = jp.models.sample(
            model, sample_params, prompt, FLAGS.sample_len, FLAGS.seq_len, jax.random.key(FLAGS.seed + 1)
        )
        summary["sample"] = (prompt + text).decode("utf-8", errors="replace")
        print("\n== sample ==\n" + printable(summary["sample"]))
        with open(os.path.join(FLAGS.out_dir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    print(f"\nmetrics: {os.path.join(FLAGS.out_dir, 'metrics.jsonl')}")


def _debug_hook(trainer, done):
    """The fault-injection flags (--throttle_s, --stall_at_step, --fail_at_step, --stop_at_step), after a
    step."""
    import time
    import jax

    if FLAGS.throttle_s:
        time.sleep(FLAGS.throttle_s)
    mine = jax.process_index() == FLAGS.fail_process
    if FLAGS.stall_at_step and done == FLAGS.stall_at_step and mine:
        while True:
            time.sleep(3600)
    if FLAGS.fail_at_step and done == FLAGS.fail_at_step and mine:
        raise RuntimeError(f"--fail_at_step={done}: process {FLAGS.fail_process} fails here (debug)")
    if FLAGS.stop_at_step and done == FLAGS.stop_at_step and done < FLAGS.steps:
        trainer.request_stop(f"--stop_at_step={done}")


def _save_params(jp, pipe, state, primary, to_modules=None):
    """The trained parameters in the model's own layout -- the modules' (``blocks/0/...``, ``embed/...``,
    ``head/...``) where the factory gives ``to_modules`` -- each array named by its tree path (``np.load``
    reads them: ``jp.save_params``); every process takes part (a collective), process 0 writes."""
    params = pipe.params(state)
    if to_modules is not None:
        modules = to_modules(params)
        params = (
            dict(zip(("blocks", "embed", "head"), modules))
            if isinstance(modules, tuple) and len(modules) == 3
            else {"modules": modules}
        )
    path = jp.save_params(FLAGS.save_params, params)
    if primary:
        print(f"parameters written to {path} (np.load: arrays named by their tree paths)")


if __name__ == "__main__":
    define_flags()
    cli.run(main, __doc__)
