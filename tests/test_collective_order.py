"""Every loop or conditional holding collectives is ordered by data against every other collective of the
step's compiled program (tests/hlo_order.py).  XLA's CPU runtime runs independent instructions in any order,
per device: an unordered pair deadlocked CI once (WPipe, stage x data x tensor: the batch check's all-reduce
ran before the pipeline's loop on one device and after it on another).  Deterministic, where the hang was
not."""

import dataclasses

import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import small_model
from hlo_order import unordered_collectives
from test_model_axes import MLP_SPECS, TP


def _loops_unordered(text):
    """The unordered pairs with a loop in them (the hang CI saw).  Pairs of a plain collective and a
    conditional XLA peeled out of a loop's last tick (1f1b: the loss's psum beside the last B lane's tensor
    all-reduces) are left out: they come from XLA's own restructuring, and no run has hung on them
    (BUILD_NOTES, "The executor")."""
    return [p for p in unordered_collectives(text) if any(n.startswith("while") for n in p)]


def _pipeline(schedule, mesh_axes, model_axes=True, **kw):
    model, batch_fn = small_model("mlp", 4 if schedule == "wpipe" else 2)
    if model_axes:
        model = dataclasses.replace(model, param_specs=MLP_SPECS)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=4,
        optimizer=optax.adam(1e-2),
        mesh=jp.make_mesh(**mesh_axes),
        **kw,
    )
    return pipe, batch_fn(16)


@pytest.mark.parametrize(
    "schedule,what", [("wpipe", "step"), ("pipedream", "step"), ("1f1b", "step"), ("1f1b", "grad")]
)
def test_model_axes_programs_order_their_collectives(schedule, what):
    pipe, batch = _pipeline(schedule, TP)
    state = pipe.init()
    text = pipe.lower(what, state, batch).compile().as_text()
    assert _loops_unordered(text) == []
    # and the program runs: every device reaches every collective (an unordered pair hangs here, or ends in
    # XLA's rendezvous timeout), twice, with finite results
    for _ in range(2):
        if what == "step":
            state, metrics = pipe.step(state, batch)
            loss = metrics["loss"]
        else:
            loss, _ = pipe.loss_and_grad(state, batch)
        pipe.check()
        assert np.isfinite(float(loss)) or (pipe.is_async and np.isnan(float(loss)))


def test_data_parallel_with_integer_checks_orders_its_collectives():
    model, batch_fn = small_model("mlp", 2)
    pipe = jp.Pipeline(
        model,
        schedule="pipedream",
        num_microbatches=4,
        optimizer=optax.adam(1e-2),
        mesh=jp.make_mesh(stages=2, data=4),
    )
    text = pipe.lower("step", pipe.init(), batch_fn(16)).compile().as_text()
    assert _loops_unordered(text) == []


def test_the_loss_leaves_the_last_loop_of_a_phased_call():
    """1F1B on four stages runs its call as several loops (phases); the last one has no last-stage forward.
    The loss sums, left as they were there, used to be forwarded by XLA from an earlier loop, and the loss's
    all-reduces after the call then depended on nothing the last loop computes: two (loop, all-reduce) pairs
    no data orders.  The sums go through every loop now (ticks._loss_carried)."""
    model, batch_fn = small_model("mlp", 4)
    pipe = jp.Pipeline(
        model, schedule="1f1b", num_microbatches=4, optimizer=optax.adam(1e-2), mesh=jp.make_mesh(stages=4)
    )
    text = pipe.lower("step", pipe.init(), batch_fn(16)).compile().as_text()
    assert text.count("while(") >= 2, "one loop: nothing here to order"
    assert _loops_unordered(text) == []


def test_the_helper_sees_the_hazard():
    """The helper reports the pair that hung, in a program written to have it: a sharded sum beside a loop of
    collective-permutes, which depend on nothing of each other."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("s",))

    def loop(x):
        def body(c, _):
            return jax.lax.ppermute(c, "s", [(i, (i + 1) % 8) for i in range(8)]), None

        return jax.lax.scan(body, x, None, length=3)[0]

    def program(x, y):
        return jax.shard_map(loop, mesh=mesh, in_specs=P("s"), out_specs=P("s"))(x), jnp.sum(y)

    x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("s")))
    text = jax.jit(program).lower(x, x).compile().as_text()
    assert len(unordered_collectives(text)) == 1
