"""Every loop or conditional holding collectives is ordered by data against every other collective of the
step's compiled program (tests/hlo_order.py).  XLA's CPU runtime runs independent instructions in any order,
per device: an unordered pair deadlocked CI once (WPipe, stage x data x tensor: the batch check's all-reduce
ran before the pipeline's loop on one device and after it on another).  Deterministic, where the hang was
not."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import optax
import pytest

import jaxpipe as jp
from helpers import small_model
from hlo_order import orders_only_on_paper, unordered_collectives
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
    assert orders_only_on_paper(text) == []
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
    assert orders_only_on_paper(text) == []


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
    assert orders_only_on_paper(text) == []


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


#: (model stages, micro-batches, optimizer) a method needs on four devices where the defaults do not fit it
_ON_FOUR = {
    "interleaved_1f1b": (8, 4, None),
    "zb_v": (8, 4, None),
    "dualpipe_v": (8, 8, None),
    "wpipe": (8, 4, None),
    "spectrain": (4, 4, optax.sgd(1e-2, momentum=0.9)),
}


@pytest.mark.parametrize("schedule", sorted(set(jp.schedules.METHODS) - {jp.schedules.USER_SCHEDULE}))
def test_what_follows_the_loops_waits_for_them_in_the_runtime(schedule):
    """Every collective after a loop of collectives reads something the loop writes.  XLA's CPU runtime
    orders instructions by the buffers they touch: a value a loop only passes through (the loss sums in a
    phase without last-stage forwards) orders nothing, and the loss's all-reduce started on two devices
    while the other two still ran ZB-H1's last loop (four stages, widths from 192: a deadlock).  Checked on
    each method's step program, four stages by two data replicas (the data axis's reductions too)."""
    stages, micro_batches, opt = _ON_FOUR.get(schedule, (4, 4, None))
    model, batch_fn = small_model("mlp", stages)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=micro_batches,
        optimizer=opt or optax.adam(1e-2),
        mesh=jp.make_mesh(stages=4, data=2),
    )
    text = pipe.lower("step", pipe.init(), batch_fn(16)).compile().as_text()
    assert orders_only_on_paper(text) == []
    assert _loops_unordered(text) == []


def test_the_helper_sees_an_order_only_on_paper():
    """The helper reports a loop whose output a collective reads when the loop passes that output through
    (the old ``ticks._loss_carried``: an optimization barrier keeps the value a loop output, and XLA removes
    the barrier after its last pass, leaving the body's output its input)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("s",))

    def program(x, total):
        def body(c, tick):
            x, total = c
            total, _ = jax.lax.optimization_barrier((total, tick))  # a loop output XLA cannot forward
            return (jax.lax.ppermute(x, "s", [(i, (i + 1) % 8) for i in range(8)]), total), None

        x, total = jax.lax.scan(body, (x, total), jnp.arange(3))[0]
        return x, jax.lax.psum(total, "s")

    x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("s")))
    total = jax.device_put(np.ones((8,), np.float32), NamedSharding(mesh, P("s")))
    sharded = jax.shard_map(program, mesh=mesh, in_specs=(P("s"), P("s")), out_specs=(P("s"), P()))
    text = jax.jit(sharded).lower(x, total).compile().as_text()
    assert unordered_collectives(text) == []  # the program's data edges order the pair
    (pair,) = orders_only_on_paper(text)
    assert pair[0].startswith("while") and "psum" in pair[1]


_ZB_H1_WIDE = """
import jax, jax.numpy as jnp, numpy as np
import jaxpipe as jp

H, L = 192, 8
w = jax.random.normal(jax.random.PRNGKey(0), (L, H, H)) / H**0.5
x = jax.random.normal(jax.random.PRNGKey(1), (512, H))
y = jax.random.normal(jax.random.PRNGKey(2), (512, H))


def stage(w, h):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)[0]


def post_loss(_, h, batch):
    return jnp.mean((h - batch["y"]) ** 2)


model = jp.PipelineModel(stage_fn=stage, stage_params=w.reshape(4, L // 4, H, H), post_loss=post_loss)
pipe = jp.Pipeline(model, schedule="zb_h1", num_microbatches=4, mesh=jp.make_mesh(stages=4), op_costs="unit")
loss, (grad, _, _) = pipe.loss_and_grad(pipe.init(), {"x": x, "y": y})
ref = jax.grad(lambda w: jnp.mean((stage(w, x) - y) ** 2))(w)
print("relative error", float(jnp.linalg.norm(grad.reshape(ref.shape) - ref) / jnp.linalg.norm(ref)))
"""


def test_zero_bubble_on_four_stages_runs_at_a_width_that_deadlocked():
    """ZB-H1 on four stages at width 192: the loss's all-reduce used to start beside the last loop's
    collective-permutes on half the devices (XLA CPU's runtime, jaxlib 0.10), and the run hung until XLA
    aborted the process -- so it runs in a process of its own, with a deadline.  Four devices in the process,
    as the hang needed (with eight, four of them idle, it ran)."""
    flags = os.environ.get("XLA_FLAGS", "").replace("device_count=8", "device_count=4")
    env = dict(os.environ, XLA_FLAGS=flags)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _ZB_H1_WIDE], capture_output=True, text=True, timeout=120, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail("ZB-H1 on four stages at width 192 did not finish in 120 s (a collective deadlock)")
    assert done.returncode == 0, done.stderr[-3000:]
    error = float(done.stdout.split("relative error")[-1])
    assert error <= 1e-5
