"""Bad configurations and inputs (issue #6 part 3): one table, each row a mistake a user can make and the
message it must get -- the value, why it is wrong, what would work.  Every message is checked for all three
with a regex; nothing is allowed to run on silently."""

import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxpipe as jp
from helpers import small_model

MLP2, BATCH = small_model("mlp", 2)
MLP4, _ = small_model("mlp", 4)


def pipe(schedule="1f1b", model=MLP2, stages=2, M=4, data=1, pipes=1, opt=optax.sgd(0.1), **kw):
    return jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=opt,
        mesh=jp.make_mesh(stages=stages, data=data, pipes=pipes),
        **kw,
    )


def step(p, batch):
    return p.step(p.init(), batch)


def nan_batch():
    b = BATCH(8)
    b["x"][3, 2] = np.nan
    return b


def inf_batch():
    b = BATCH(8)
    b["x"][0, 0] = np.inf
    return b


def checkpoint_of_other_model(tmp):
    p = pipe()
    ck = jp.Checkpointer(tmp / "ck", p, async_save=False)
    ck.save(1, p.init())
    other = pipe(model=jp.models.residual_mlp(2, in_dim=12, num_classes=5, width=8))
    jp.Checkpointer(tmp / "ck", other).restore(other.init())


def identity_stage_model():
    return jp.PipelineModel(
        stage_fn=lambda p, x: x[:, :2] @ p,
        stage_params=jnp.zeros((2, 2, 2)),
        post_loss=lambda q, x, b: jnp.mean(x),
    )


def labeled(y):
    b = BATCH(8)
    b["y"] = y
    return b


def other_optimizer_state():
    a, b = pipe(opt=optax.sgd(0.1)), pipe(opt=optax.adam(1e-3))
    return a.step(b.init(), BATCH(8))


def async_batch_size_changes():
    p = pipe("pipedream", M=2)
    st, _ = p.step(p.init(), BATCH(8))
    p.step(st, BATCH(16))


# (id, action(tmp_path), regex the message must match: value, reason, fix)
CASES = [
    (
        "label_past_num_classes",
        lambda t: step(pipe(), labeled(np.full(8, 99, np.int32))),
        r"batch\['y'\] holds 99, outside \[0, 5\).*NaN.*integer_inputs",
    ),
    (
        "label_negative",
        lambda t: step(pipe("pipeoptim"), labeled(np.full(8, -1, np.int32))),
        r"batch\['y'\] holds -1, outside \[0, 5\).*negative ids read the last rows",
    ),
    (
        "float_labels",
        lambda t: step(pipe(), labeled(np.full(8, 2.7, np.float32))),
        r"batch\['y'\] is float32 but the model reads integer ids.*truncated.*astype",
    ),
    (
        "token_past_vocabulary",
        lambda t: step(
            pipe(model=small_model("gpt", 2)[0]),
            {"x": np.full((8, 8), 40, np.int32), "y": np.zeros((8, 8), np.int32)},
        ),
        r"batch\['x'\] holds 40, outside \[0, 32\)",
    ),
    (
        "zero_row_batch",
        lambda t: step(pipe(), {"x": np.zeros((0, 12), np.float32), "y": np.zeros(0, np.int32)}),
        r"the batch has 0 rows.*NaN loss",
    ),
    (
        "scalar_batch_leaf",
        lambda t: step(pipe(), {"x": np.zeros((8, 12), np.float32), "y": np.int32(1)}),
        r"batch entry \['y'\] is a scalar: every entry needs a leading batch axis",
    ),
    (
        "batch_as_tuple",
        lambda t: step(pipe(), (np.zeros((8, 12), np.float32), np.zeros(8, np.int32))),
        r"the batch is a tuple; give a dict of arrays",
    ),
    (
        "optimizer_not_called",
        lambda t: pipe(opt=optax.adam),
        r"not an optax optimizer: .*adam is the function.*call it",
    ),
    (
        "step_of_none",
        lambda t: pipe().step(None, BATCH(8)),
        r"state is None: start from state = pipe.init\(\)",
    ),
    (
        "step_of_params",
        lambda t: pipe().step(MLP2.params, BATCH(8)),
        r"step\(\) got the model's parameters; it needs this pipeline's train state \(PipelineState",
    ),
    (
        "state_of_other_schedule",
        lambda t: pipe("pipedream").step(pipe().init(), BATCH(8)),
        r"step\(\) got a PipelineState; it needs this pipeline's train state \(AsyncState",
    ),
    (
        "state_of_other_optimizer",
        lambda t: other_optimizer_state(),
        r"this state's opt_state do not match this pipeline's.*another model, optimizer or schedule",
    ),
    (
        "async_batch_size_changes",
        lambda t: async_batch_size_changes(),
        r"holds micro-batches shaped \[4, 12\] in flight.*this batch gives \[8, 12\].*same batch shapes",
    ),
    (
        "batch_not_divisible",
        lambda t: pipe(M=4, data=2).loss_and_grad(pipe(M=4, data=2).init(), BATCH(12)),
        r"batch size 12 does not split into 2 data-parallel .* 4 micro-batches .*multiple of 8",
    ),
    (
        "batch_smaller_than_microbatches",
        lambda t: step(pipe(M=8), BATCH(4)),
        r"batch size 4 .* 8 micro-batches .*multiple of 8",
    ),
    (
        "batch_leaves_differ",
        lambda t: step(pipe(), {"x": np.zeros((8, 12), np.float32), "y": np.zeros(4, np.int32)}),
        r"same leading \(batch\) size; found \[4, 8\]",
    ),
    (
        "batch_missing_x",
        lambda t: step(pipe(), {"inputs": np.zeros((8, 12), np.float32), "y": np.zeros(8, np.int32)}),
        r"the model reads batch\['x'\], which the batch lacks \(it has \['inputs', 'y'\]\)",
    ),
    (
        "empty_batch",
        lambda t: step(pipe(), {}),
        r"the batch \{\} has no arrays: give a pytree of arrays with a leading batch axis",
    ),
    (
        "nan_in_batch",
        lambda t: step(pipe(), nan_batch()),
        r"NaN or Inf in \['x'\] \(1 value\(s\)\).*np.nan_to_num.*check_inputs=False",
    ),
    ("inf_in_batch", lambda t: step(pipe("pipeoptim"), inf_batch()), r"NaN or Inf in \['x'\]"),
    ("microbatches_zero", lambda t: pipe(M=0), r"num_microbatches must be a positive integer, got 0"),
    ("microbatches_negative", lambda t: pipe(M=-2), r"num_microbatches must be a positive integer, got -2"),
    ("microbatches_float", lambda t: pipe(M=2.5), r"num_microbatches must be a positive integer, got 2.5"),
    (
        "too_few_microbatches_wpipe",
        lambda t: pipe("wpipe", model=small_model("mlp", 8)[0], stages=4, M=2),
        r"M=2|2 micro-batches|num_microbatches",
    ),
    (
        "interleaved_microbatches_not_groups",
        lambda t: pipe("interleaved_1f1b", model=MLP4, M=3, options={"virtual": 2}),
        r"3 micro-batches do not form whole groups of D=2",
    ),
    (
        "chimera_odd_stages",
        lambda t: pipe("chimera", model=small_model("mlp", 3)[0], stages=3),
        r"chimera needs an even number of stages",
    ),
    (
        "chimera_bad_pipelines",
        lambda t: pipe("chimera", options={"pipelines": 3}),
        r"pipelines=3 is not 2f with f dividing D/2=1",
    ),
    (
        "chimera_unknown_option",
        lambda t: pipe("chimera", options={"pipes": 2}),
        r"unknown option\(s\) \['pipes'\]; known",
    ),
    (
        "option_for_other_schedule",
        lambda t: pipe("1f1b", options={"pipelines": 2}),
        r"unknown option\(s\) \['pipelines'\]",
    ),
    (
        "stage_count_mismatch",
        lambda t: pipe(model=small_model("mlp", 3)[0], stages=4),
        r"the model has 3 stages .* 'stage' axis has 4 devices .*jp.make_mesh\(stages=",
    ),
    (
        "stage_fn_changes_shape",
        lambda t: pipe("gpipe", model=identity_stage_model(), M=2).loss_and_grad(
            pipe("gpipe", model=identity_stage_model(), M=2).init(), {"x": jnp.zeros((4, 3))}
        ),
        r"stage_fn must map an activation to one of the same shape and dtype",
    ),
    (
        "stage_leading_axes_differ",
        lambda t: jp.PipelineModel(
            stage_fn=lambda p, x: x,
            stage_params={"a": jnp.zeros((2, 3)), "b": jnp.zeros((3, 3))},
            post_loss=lambda q, x, b: jnp.mean(x),
        ),
        r"same leading \(stage\) axis; leading sizes found: \['2', '3'\]",
    ),
    (
        "stage_structures_differ",
        lambda t: jp.stack_stages([{"w": jnp.zeros(3)}, {"w": jnp.zeros(3), "b": jnp.zeros(1)}]),
        r"stage 1's parameters have another pytree structure than stage 0's.*same parameter structure",
    ),
    (
        "stage_shapes_differ",
        lambda t: jp.stack_stages([{"w": jnp.zeros(3)}, {"w": jnp.zeros(4)}]),
        r"stage 1's parameter leaf 0 is float32\[4\] but stage 0's is float32\[3\]",
    ),
    (
        "spectrain_with_adam",
        lambda t: pipe("spectrain", opt=optax.adam(1e-3)),
        r"spectrain predicts future weights from the SGD-momentum buffer",
    ),
    (
        "mesh_larger_than_devices",
        lambda t: jp.make_mesh(stages=len(jax.devices()), data=2),
        r"needs \d+ devices but \d+ CPU device\(s\) are visible.*xla_force_host_platform_device_count",
    ),
    ("mesh_zero_size", lambda t: jp.make_mesh(stages=0), r"stages must be a positive integer, got 0"),
    (
        "mesh_negative_data",
        lambda t: jp.make_mesh(stages=2, data=-1),
        r"data must be a positive integer, got -1",
    ),
    ("unknown_schedule", lambda t: pipe("1f2b"), r"unknown schedule '1f2b'; available: 1f1b, .*gpipe"),
    (
        "unknown_optimizer",
        lambda t: jp.optim.by_name("adamax", 1e-3),
        r"unknown optimizer 'adamax'; choose one of sgd, momentum, adam, adamw",
    ),
    (
        "model_not_pipeline_model",
        lambda t: jp.Pipeline(lambda x: x, schedule="1f1b"),
        r"model must be a jp.PipelineModel, got function",
    ),
    ("step_without_optimizer", lambda t: step(pipe(opt=None), BATCH(8)), r"Pipeline.step needs an optimizer"),
    (
        "async_without_optimizer",
        lambda t: pipe("pipedream", opt=None),
        r"updates the weights inside the pipeline",
    ),
    (
        "loss_and_grad_of_async",
        lambda t: pipe("pipeoptim").loss_and_grad(pipe("pipeoptim").init(), BATCH(8)),
        r"pipeoptim is asynchronous.*use step\(\)",
    ),
    (
        "skip_nonfinite_async",
        lambda t: pipe("pipedream", skip_nonfinite=True),
        r"skip_nonfinite=True needs one update per step to skip; pipedream.*synchronous schedule",
    ),
    (
        "avgpipe_negative_advance",
        lambda t: pipe("avgpipe", pipes=2, options={"advance": -1}),
        r"options\['advance'\]=-1 \(int\); it must be an integer >= 0, or 'auto' \(forwards issued beyond "
        r"1F1B, "
        r"0 = 1F1B",
    ),
    (
        "wpipe_unknown_option",
        lambda t: pipe("wpipe", model=MLP4, options={"recomp": True}),
        r"unknown option\(s\) \['recomp'\]; known: \['apc', 'recompute'\]",
    ),
    (
        "cdp_bad_rule",
        lambda t: jp.CyclicDataParallel(MLP4, optax.sgd(0.1), rule="v3", mesh=jp.make_mesh(data=4)),
        r"rule='v3': choose 'v1'",
    ),
    (
        "checkpoint_keep_zero",
        lambda t: jp.Checkpointer(t / "c", None, keep=0),
        r"keep=0: give how many checkpoints",
    ),
    (
        "checkpoint_every_negative",
        lambda t: jp.Checkpointer(t / "c", None, every=-5),
        r"every=-5: give a step interval",
    ),
    (
        "restore_from_empty_dir",
        lambda t: jp.Checkpointer(t / "empty", None).restore(None),
        r"no finalized checkpoint in .*empty",
    ),
    (
        "checkpoint_from_other_model",
        checkpoint_of_other_model,
        r"from another model: it holds .* parameters .*this run's model has .*start afresh",
    ),
    (
        "multihost_no_coordinator",
        lambda t: jp.distributed.settings(None, 2, 0),
        r"num_processes=2 needs the coordinator's address: --coordinator=HOST:PORT",
    ),
    (
        "multihost_bad_process_id",
        lambda t: jp.distributed.settings("127.0.0.1:1234", 2, 2),
        r"process_id=2: give this process's index in \[0, 1\]",
    ),
    (
        "multihost_bad_address",
        lambda t: jp.distributed.settings("localhost", 2, 0),
        r"coordinator='localhost': give HOST:PORT",
    ),
    (
        "lower_names_no_program",  # it once lowered the step for any name but "grad"
        lambda t: pipe().lower("gradient", None, BATCH(8)),
        r"lower\(what='gradient'\): a pipeline has two programs, 'grad' .*'loss_and_grad'.* and 'step'",
    ),
]


def test_table_is_large_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,action,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_clear_error(name, action, pattern, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "")
    with pytest.raises(jp.ConfigError, match=pattern) as e:
        action(tmp_path)
    assert len(str(e.value)) > 30  # a sentence, not a bare value


def test_lower_takes_the_method_name_for_the_gradient_program():
    p = pipe()
    state, batch = p.init(), BATCH(8)
    by_method = p.lower("loss_and_grad", state, batch).as_text()
    assert by_method == p.lower("grad", state, batch).as_text()
    assert by_method != p.lower("step", state, batch).as_text()
