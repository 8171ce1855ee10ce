"""Bad configuration fails early with a message that names the value, the reason and a fix."""

import jax
import numpy as np
import jax.numpy as jnp
import optax
import pytest

import jaxpipe as jp
from helpers import small_model


def _pipe(stages=2, M=4, data=1, schedule="1f1b"):
    model, _ = small_model("mlp", stages)
    return jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=M,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=stages, data=data),
    )


def test_batch_not_divisible():
    pipe = _pipe(M=4, data=2)
    with pytest.raises(
        jp.ConfigError, match=r"batch size 12 .* 2 data-parallel .* 4 micro-batches.*multiple of 8"
    ):
        pipe.loss_and_grad(pipe.init(), {"x": jnp.zeros((12, 12)), "y": jnp.zeros((12,), jnp.int32)})


def test_stage_count_mismatch():
    model, _ = small_model("mlp", 3)
    with pytest.raises(jp.ConfigError, match=r"3 stages .* 'stage' axis has 4 devices"):
        jp.Pipeline(
            model, schedule="1f1b", num_microbatches=4, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=4)
        )


def test_unknown_schedule():
    with pytest.raises(jp.ConfigError, match=r"unknown schedule '1f2b'; available: 1f1b, .*gpipe"):
        _pipe(schedule="1f2b")


def test_mesh_larger_than_devices():
    n = len(jax.devices())
    with pytest.raises(
        jp.ConfigError, match=rf"needs {2 * n} devices but {n} .*xla_force_host_platform_device_count"
    ):
        jp.make_mesh(stages=n, data=2)


def test_bad_microbatches_and_model():
    with pytest.raises(jp.ConfigError, match="num_microbatches must be a positive integer"):
        _pipe(M=0)
    with pytest.raises(jp.ConfigError, match="same leading"):
        jp.PipelineModel(
            stage_fn=lambda p, x: x,
            stage_params={"a": jnp.zeros((2, 3)), "b": jnp.zeros((3, 3))},
            post_loss=lambda q, x, b: jnp.mean(x),
        )
    model = jp.PipelineModel(
        stage_fn=lambda p, x: x[:, :2] @ p,
        stage_params=jnp.zeros((2, 2, 2)),
        post_loss=lambda q, x, b: jnp.mean(x),
    )
    pipe = jp.Pipeline(
        model, schedule="gpipe", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match="same shape and dtype"):
        pipe.loss_and_grad(pipe.init(), {"x": jnp.zeros((4, 3))})
    with pytest.raises(jp.ConfigError, match="no key 'x'"):
        pipe.loss_and_grad(pipe.init(), {"inputs": jnp.zeros((4, 2))})


def test_slips_of_a_first_model_get_clear_errors():
    """A tie naming a dict, a stage reading a field it was not given, interleaving without chunks."""
    import dataclasses
    import jax.numpy as jnp
    from helpers import small_model

    model, batch_fn = small_model("gpt", 2)
    with pytest.raises(jp.ConfigError, match="not an array; a tie names one array"):
        jp.Pipeline(
            dataclasses.replace(model, tied=[(("tok",), ("out",))]),
            num_microbatches=2,
            mesh=jp.make_mesh(stages=2),
        )
    ctx_model = jp.PipelineModel(
        stage_fn=lambda w, x, ctx: x * ctx.inputs["mask"][..., None],
        stage_params=jnp.ones((2, 1)),
        stage_inputs=("other",),
        post_loss=lambda p, h, b: jnp.mean(h),
    )
    pipe = jp.Pipeline(ctx_model, num_microbatches=2, mesh=jp.make_mesh(stages=2))
    batch = {
        "x": np.ones((4, 3), np.float32),
        "mask": np.ones((4,), np.float32),
        "other": np.ones(4, np.float32),
    }
    with pytest.raises(jp.ConfigError, match="add 'mask' there"):
        pipe.loss_and_grad(pipe.init(), batch)
    with pytest.raises(jp.ConfigError, match="that is plain 1F1B"):
        jp.Pipeline(
            small_model("mlp", 2)[0],
            schedule="interleaved_1f1b",
            num_microbatches=2,
            mesh=jp.make_mesh(stages=2),
        )


def test_more_slips_get_clear_errors(tmp_path):
    """Issue #31 item 6 / point 10: each of these failed deep inside JAX, Orbax or NumPy without naming the
    cause."""
    import jax
    import numpy as np
    import optax
    import jaxpipe as jp
    from helpers import small_model

    model, batch_fn = small_model("mlp", 2)
    mk = lambda s: jp.Pipeline(
        model, schedule=s, num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    a, b = mk("pipedream"), mk("pipeoptim")
    st, _ = a.step(a.init(), batch_fn(8, 1))
    with pytest.raises(jp.ConfigError, match="this state's policy_state do not match this pipeline's"):
        b.step(st, batch_fn(8, 2))  # another no-flush method's state
    batch = batch_fn(8, 1)
    with pytest.raises(jp.ConfigError, match=r"batch entry \['x'\] holds <U1 values, not numbers"):
        a.step(a.init(), {**batch, "x": np.array([["a"] * 12] * 8)})
    big = {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v for k, v in batch.items()}
    big["x"][0, 0] = 1e39
    with pytest.raises(jp.ConfigError, match=r"1 float64 value\(s\) beyond float32's range"):
        a.step(a.init(), big)
    open(tmp_path / "f", "w").close()
    with pytest.raises(jp.ConfigError, match="is a file, not a directory"):
        jp.Checkpointer(tmp_path / "f", a)
    d = jax.devices()[0]
    with pytest.raises(jp.ConfigError, match="is listed 2 times"):
        jp.make_mesh(stages=2, devices=[d, d])


def test_resuming_another_model_says_what_differs(tmp_path):
    import dataclasses
    import optax
    import jaxpipe as jp
    from helpers import small_model

    model, batch_fn = small_model("mlp", 2)
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    ck = jp.Checkpointer(tmp_path / "ck", pipe, async_save=False)
    ck.save(1, pipe.init())
    ck.close()
    other = dataclasses.replace(model, pre_params=jax_cast(model.pre_params))
    pipe2 = jp.Pipeline(
        other, schedule="1f1b", num_microbatches=2, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=2)
    )
    with pytest.raises(jp.ConfigError, match=r"float32\[.*\] in the checkpoint, bfloat16\[.*\] here"):
        jp.Checkpointer(tmp_path / "ck", pipe2).restore(pipe2.init())


def jax_cast(tree):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)
