"""The runners: ``python -m experiments.<name>`` from a clone (absl flags; ``--help`` lists them).  What a
user runs is installed as the ``jaxpipe`` command (:mod:`jaxpipe.cli`); the modules of the same name here are
its entries for a clone.  Each runner, by the question it answers (``RUNNERS``; a test runs every ``--help``):
"""

#: runner -> the question it answers.  Helpers the runners share (not runners): ``bench`` (the plain
#: one-device steps and the timing rounds), ``one_device`` (Cyclic Data Parallelism's one-device baselines),
#: ``profiling`` (a ``jax.profiler`` trace cut into operation kinds), ``sketch_two_lane`` (the two-lane 1F1B
#: sketch the accelerator check times beside jaxpipe), ``sketch_interleaved`` (the interleaved sketch
#: ``two_devices --sketch`` and ``peer`` time beside the two-chunk schedules), ``torch_peer`` (PyTorch's side
#: of ``peer``).
RUNNERS = {
    "train": "train a model (jaxpipe train)",
    "launch": "run a multi-process job on this machine (jaxpipe launch)",
    "configure": "which split, schedule and micro-batch count should this model use? (jaxpipe configure)",
    "timeline": "what does a schedule look like, and what is its bubble? (jaxpipe timeline)",
    "bubbles": "does the simulator give each paper's bubble formula, for every synchronous schedule?",
    "schedule_choice": "which synchronous schedule pays off on D real devices, predicted from measured op "
    "costs?",
    "two_devices": "what does each schedule cost on a real two-device pipeline, against the lockstep "
    "prediction?",
    "peer": "is each schedule as fast as PyTorch's same schedule on the same two devices, timed in one "
    "session?",
    "tick_price": "how steady is a tick's price on the two-device testbed, and would another estimator be "
    "steadier?",
    "throughput": "what does a pipelined step cost over the plain one-device step doing the same work?",
    "executor_cost": "what does the executor itself add, each schedule on one core, beside the scan-GPipe?",
    "accelerator_cost": "what do the executor's programs cost a device in XLA's bytes and temp, on any "
    "backend?",
    "gpu_check": "on one accelerator, what does the executor cost at D = 1 against the plain step and the "
    "two-lane sketch, and what does offloading residuals cost?",
    "program_text": "did a change to the executor leave every method's lowered step program as it was?",
    "op_profile": "where does a pipelined step's time go, by operation kind, beside the plain step?",
    "loop_overhead": "what does the training loop add to Pipeline.step, its metrics read while the next step "
    "runs or before it starts?",
    "products": "what do the testbed's matrix products cost under XLA CPU's kernels and PyTorch's, on one "
    "core?",
    "cuts": "is an uneven cut's padding free, and does the balanced cut pay?",
    "weight_memory": "how much weight memory does each no-flush method hold, against PipeOptim's Table II?",
    "convergence": "do the asynchronous methods converge as GPipe does (PipeOptim Table IV, Figs. 2-4)?",
    "tune": "how close is the Chimera-3.4 step-time model to the measured steps (Chimera, sec. 3.4)?",
    "tune_avgpipe": "how close is AvgPipe's profiled choice of (M, N) to the measured best (AvgPipe, sec. "
    "5.2)?",
}


def with_device_count(xla_flags: str, n: int) -> str:
    """``xla_flags`` with the CPU device count set to ``n`` (replacing a count already there, keeping the
    user's other flags)."""
    kept = [f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={n}"])


def emulate_cpu_devices(n: int) -> None:
    """Before JAX is imported: emulate ``n`` CPU devices unless the user's XLA_FLAGS already chose a count."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = with_device_count(flags, n)
