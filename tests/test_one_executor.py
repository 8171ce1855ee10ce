"""One executor runs every method (issue #13): the flushing schedules' lane plans become streams of one call
that the same executor as the no-flush methods runs; what the plan draws is what the stream runs."""

import jax
import optax
import pytest

import jaxpipe as jp
from helpers import small_model
from jaxpipe import schedules
from jaxpipe.schedules.layout import lane_plan
from jaxpipe.schedules.ir import F
from jaxpipe.schedules.periodic import F2, one_call

PLANS = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved_1f1b", {"virtual": 2}),
    ("zb_h1", {}),
    ("zb_h1", {"max_deferred_w": 1}),
    ("chimera", {}),
    ("chimera", {"pipelines": 4}),
    ("chimera", {"concat": "backward_halving"}),
    ("chimera", {"concat": "forward_doubling"}),
    ("chimera", {"eager_reduce": True}),
    ("avgpipe", {"advance": 2}),
]


@pytest.mark.parametrize("placement", ["lanes", "ordered"])
@pytest.mark.parametrize("name,opts", PLANS)
def test_the_stream_runs_what_the_plan_draws(name, opts, placement):
    """Every op of the plan is in the stream's replay at the plan's tick, device and lane, and nothing else
    is; the stream's units cover every (micro-batch, chunk) once."""
    s = schedules.build(name, 4, 8, **opts)
    p = lane_plan(s, placement)
    st = one_call(p)
    soc = s.stage_of_chunk()
    got = {}
    for t, d, kind, c, g in st.events(s.M, calls=1):
        key = (F if kind == F2 else kind, int(soc[d, c]), g)
        assert key not in got, f"{key} twice"
        got[key] = (t, st.kinds.index(kind), d)
    want = {k: (t, li, p._dev[k]) for k, (t, li) in p.where.items()}
    assert got == want


def test_double_batch_stream_pairs_forwards_in_the_f2_lane():
    s = schedules.build("chimera", 4, 8, concat="forward_doubling", double_batch=True)
    st = one_call(lane_plan(s, "ordered"))
    assert st.kinds == ("F", "F2", "B")
    tab = st.call_table(s.M)
    assert (tab[:, :, 1, 0] >= 0).any() and ((tab[:, :, 1, 0] >= 0) <= (tab[:, :, 0, 0] >= 0)).all()


def _permutes(eager):
    model, batch_fn = small_model("mlp", 4)
    pipe = jp.Pipeline(
        model,
        schedule="chimera",
        num_microbatches=8,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=4),
        options={"eager_reduce": eager},
    )
    state = pipe.init()
    txt = pipe.lower("grad", state, batch_fn(16)).compile().as_text()
    return txt.count("collective-permute-start") + txt.count("collective-permute(")


def test_eager_reduction_sends_gradients_inside_the_program():
    """Chimera §3.2 on the one executor: the finished replica gradients go home between the call's scans --
    more point-to-point transfers in the compiled step than without eager reduction (same numbers: tested
    against jax.grad in test_chimera_interleaved_zb)."""
    assert _permutes(True) > _permutes(False)


def test_no_lane_executor_left():
    import importlib
    import jaxpipe.runtime as rt

    ex = importlib.import_module("jaxpipe.runtime.executor")
    assert hasattr(ex, "make_stream_program") and not hasattr(ex, "lane_plan")
    with pytest.raises(ImportError):
        importlib.import_module("jaxpipe.runtime.async_executor")
    assert rt.make_grad_fn.__module__ == "jaxpipe.runtime.gradient"


@pytest.mark.parametrize("name,opts", [("gpipe", {}), ("zb_h1", {}), ("chimera", {})])
def test_one_collective_permute_per_lane_channel_and_phase(name, opts):
    """The compiled step sends exactly what the plan routes: in each phase's tick, one collective-permute per
    channel of each lane it compiles -- one in all for a channel the plan shares (every device sends and
    receives at most one message on it a tick: the tick's one exchange, issue #49) -- and nothing else in the
    ticks (each is a rendezvous of every device on XLA CPU)."""
    import re

    model, batch_fn = small_model("mlp", 4)
    pipe = jp.Pipeline(
        model,
        schedule=name,
        num_microbatches=8,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=4),
        options=opts or None,
    )
    txt = pipe.lower("grad", pipe.init(), batch_fn(16)).compile().as_text()
    p = pipe.lane_plan
    # Chimera: its replicas fetched and their gradients sent home, one collective-permute per stage leaf each
    # way
    perms = 2 * len(jax.tree.leaves(model.stage_params)) if name == "chimera" else 0
    expect = perms
    for _, _, used in p.phases:
        chans = [ch for li in used for ch in p.channels[li]]
        expect += sum(1 if ch in p.shared else chans.count(ch) for ch in set(chans))
    if name == "chimera":  # (ordered: both directions shared by its lanes; zb_h1's F and B use one each)
        assert (
            p.shared and sum(len(p.channels[li]) for _, _, used in p.phases for li in used) + perms > expect
        )
    assert len(re.findall(r"collective-permute-start\(|collective-permute\(", txt)) == expect
