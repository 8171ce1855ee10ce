"""The train state of a schedule with two chunks a device (ZB-V here; interleaved 1F1B and DualPipeV hold
theirs the same way): each stage leaf as one array per chunk, never stacked in a step (issue #49), and
everything that reads the state in the model's structure -- ``params()``, optax masks, checkpoints moved onto
another cut -- unchanged for the user."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe.runtime.chunk_state import Chunks, is_chunks
from helpers import rel_err
from test_uneven_cuts import mlp, mlp_batch

A, B, ROWS = 24, 40, 8


def _model(n=4, seed=0):
    """``n`` stages of ``tanh(h @ a) @ b``: leaves of shapes no activation or stash has (24 x 40, 40 x 24)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    stage = {"a": jax.random.normal(k[0], (n, A, B)) / 5, "b": jax.random.normal(k[1], (n, B, A)) / 6}
    return jp.PipelineModel(
        stage_fn=lambda p, h: jnp.tanh(h @ p["a"]) @ p["b"],
        stage_params=stage,
        post_loss=lambda p, h, b: jnp.mean((h @ p - b["y"]) ** 2),
        post_params=jax.random.normal(k[2], (A, 2)),
    )


def _batch(seed=1):
    r = np.random.default_rng(seed)
    return {
        "x": r.normal(size=(4 * ROWS, A)).astype(np.float32),
        "y": r.normal(size=(4 * ROWS, 2)).astype(np.float32),
    }


def test_two_chunks_a_device_are_held_apart_and_the_step_never_stacks_them():
    """ZB-V on 2 devices, 4 stages: each stage leaf is two ``[2, ...]`` arrays (chunk c of both devices), the
    model's order comes back from ``params()`` bit-equal, and the compiled step holds no array of both chunks
    of a leaf (``[.., 2, 24, 40]``: the slices and the gradients' stack every step made) nor of every
    stage."""
    model = _model()
    pipe = jp.Pipeline(
        model, "zb_v", num_microbatches=4, optimizer=optax.adamw(1e-2), mesh=jp.make_mesh(stages=2)
    )
    state = pipe.init()
    held = jax.tree.leaves(state.params[0], is_leaf=is_chunks)
    assert all(isinstance(h, Chunks) and len(h) == 2 for h in held)
    assert {tuple(p.shape) for h in held for p in h.parts} == {(2, A, B), (2, B, A)}
    assert rel_err(pipe.params(state), model.params) == 0.0
    hlo = pipe.lower("step", state, pipe.shard_batch(_batch())).compile().as_text()
    stacked = re.findall(rf"\[(?:\d+,)*(?:2|4),(?:{A},{B}|{B},{A})\]", hlo)
    assert not stacked, f"a step stacks the chunks of a leaf: {sorted(set(stacked))}"
    assert re.search(rf"\[1,{A},{B}\]", hlo)  # (the pattern does see the chunks' own shards)
    # nor a copy of a leaf: the chunks' zero gradient sums are filled apart, not one fill copied for the
    # second
    copies = re.findall(rf"= f32\[(?:1,)?(?:{A},{B}|{B},{A})\]\{{[^}}]*\}} copy\(", hlo)
    assert not copies, copies


def test_a_label_tree_in_the_models_structure_applies_to_every_chunk():
    """``optax.multi_transform`` with labels in the model's structure (a prefix of the chunked state): the
    frozen leaves of every chunk keep their values, the others take AdamW's step from ``jax.grad`` of the
    model."""
    model = _model()
    labels = ({"a": "adam", "b": "frozen"}, "frozen", "adam")
    opt = optax.multi_transform(
        {"adam": optax.adamw(1e-2, weight_decay=0.1), "frozen": optax.set_to_zero()}, labels
    )
    pipe = jp.Pipeline(model, "zb_v", num_microbatches=4, optimizer=opt, mesh=jp.make_mesh(stages=2))
    batch = _batch()
    state, _ = pipe.step(pipe.init(), batch)
    got = pipe.params(state)
    grads = jax.grad(model.loss)(model.params, batch)
    upd, _ = opt.update(grads, opt.init(model.params), model.params)
    want = optax.apply_updates(model.params, upd)
    assert np.array_equal(got[0]["b"], model.params[0]["b"]) and np.array_equal(got[1], model.params[1])
    assert rel_err(got, want) <= 1e-5 and rel_err(got[0]["a"], model.params[0]["a"]) > 1e-3


def test_a_chunked_checkpoint_restores_onto_another_cut(tmp_path):
    """ZB-V's state saved with 8 blocks cut [3, 2, 2, 1] restores onto [1, 2, 2, 3]: the blocks and Adam's
    moments move in the model's order (not in the devices' chunks), so the next step equals the writer's."""
    opt = optax.adamw(1e-2, weight_decay=0.1)
    mesh = jp.make_mesh(stages=2)
    p1 = jp.Pipeline(mlp((3, 2, 2, 1)), "zb_v", num_microbatches=4, optimizer=opt, mesh=mesh)
    s1, _ = p1.step(p1.init(), mlp_batch(8, seed=2))
    ck = jp.Checkpointer(str(tmp_path), p1)
    ck.save(1, s1)
    ck.close()
    p2 = jp.Pipeline(mlp((1, 2, 2, 3)), "zb_v", num_microbatches=4, optimizer=opt, mesh=mesh)
    s2, _, step = jp.Checkpointer(str(tmp_path), p2).restore(p2.init())
    assert step == 1 and rel_err(p2.params(s2), p1.params(s1)) == 0.0
    a, _ = p1.step(s1, mlp_batch(8, seed=3))
    b, _ = p2.step(s2, mlp_batch(8, seed=3))
    assert rel_err(p2.params(b), p1.params(a)) <= 1e-5


@pytest.mark.parametrize(
    "schedule,devices",
    [("zb_v", (2, 4)), ("dualpipe_v", (4, 2)), ("zb_v", (4, 2)), ("interleaved_1f1b", (2, 4))],
)
def test_a_chunked_checkpoint_restores_onto_another_number_of_devices(schedule, devices, tmp_path):
    """8 blocks on 2 devices (cut [2, 2, 2, 2], two chunks each) and on 4 ([1] * 8): a device holds other
    model stages as its chunks, so the saved chunks are read in the writer's layout -- read in the reader's,
    blocks 4 and 5 held saved blocks 6 and 7 (the next loss 1.53 where the writer's is 1.31), without a
    word."""
    opt = optax.adamw(1e-2, weight_decay=0.1)
    kw = {"options": {"virtual": 2}} if schedule == "interleaved_1f1b" else {}
    M = 8 if schedule == "dualpipe_v" else 4  # (DualPipeV fills both chunks of 4 devices: M >= 8)
    pipes = [
        jp.Pipeline(
            mlp((8 // (2 * d),) * (2 * d)),
            schedule,
            num_microbatches=M,
            optimizer=opt,
            mesh=jp.make_mesh(stages=d),
            **kw,
        )
        for d in devices
    ]
    s1, _ = pipes[0].step(pipes[0].init(), mlp_batch(8, seed=2))
    ck = jp.Checkpointer(str(tmp_path), pipes[0])
    ck.save(1, s1)
    ck.close()
    reader = jp.Checkpointer(str(tmp_path), pipes[1])
    s2, _, step = reader.restore(pipes[1].init())
    reader.close()
    assert step == 1 and rel_err(pipes[1].params(s2), pipes[0].params(s1)) == 0.0
    a, ma = pipes[0].step(s1, mlp_batch(8, seed=3))
    b, mb = pipes[1].step(s2, mlp_batch(8, seed=3))
    assert float(mb["loss"]) == pytest.approx(float(ma["loss"]), rel=1e-6)
    assert rel_err(pipes[1].params(b), pipes[0].params(a)) <= 1e-5


def test_a_chunked_checkpoint_without_its_layout_is_refused_on_another_number_of_devices(tmp_path):
    """A checkpoint of an older jaxpipe did not record how its devices held the chunks: on the same devices it
    moves between cuts as before; on another number of devices it is refused by name, never guessed."""
    opt = optax.adamw(1e-2)
    pipe = jp.Pipeline(mlp((1,) * 8), "zb_v", num_microbatches=4, optimizer=opt, mesh=jp.make_mesh(stages=4))
    ck = jp.Checkpointer(str(tmp_path), pipe)
    try:
        old = {"schedule": "zb_v", "mesh": {"stage": 2}}
        with pytest.raises(
            jp.ConfigError,
            match=r"zb_v's state on 2 stage devices; this run has 4.*does not "
            r"record how its devices held the chunks",
        ):
            ck._orders(3, old)
        same = ck._orders(3, {"schedule": "zb_v", "mesh": {"stage": 4}})
        assert same == (ck._stage_order[0], ck._stage_order[1])
    finally:
        ck.close()
