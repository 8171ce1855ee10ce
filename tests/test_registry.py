"""Methods as data (issue #17): one registry entry per method, options checked against its schema, the runner
chosen by the entry, no code outside the registry and the builders asks a method's name."""

import ast
import glob
import warnings

import optax
import pytest

import jaxpipe as jp
from jaxpipe import schedules
from helpers import small_model


def test_every_method_is_declared_once_with_a_builder_and_a_runner():
    # every method builds by name but a user's own schedule, which from_actions / from_csv build
    assert set(schedules.METHODS) == set(schedules.BUILDERS) | {schedules.USER_SCHEDULE}
    assert schedules.method(schedules.USER_SCHEDULE).builder is None
    for name, m in schedules.METHODS.items():
        if m.builder is None:
            continue
        assert m.name == name and m.runner in ("sync", "async", "wpipe", "avgpipe")
        assert m.flushes == (m.runner == "sync") and m.updates_inside == (m.runner != "sync")
        assert set(m.builder_keys) <= set(m.options)
        opts = m.resolve({}, 8, 4)
        schedules.build(name, 4, 8, **m.builder_options(opts))  # the defaults build


def test_unknown_options_name_the_valid_ones_and_their_owner():
    with pytest.raises(
        schedules.ScheduleError,
        match=r"unknown option\(s\) \['virtual'\]; known: none "
        r"\('virtual' is an option of interleaved_1f1b\)",
    ):
        schedules.options_for("1f1b", 4, 4, {"virtual": 2})
    model, _ = small_model("mlp", 4)
    with pytest.raises(
        jp.ConfigError, match=r"known: \['concat', 'double_batch', 'eager_reduce', 'pipelines'\]"
    ):
        jp.Pipeline(
            model,
            schedule="chimera",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=4),
            options={"pipes": 2},
        )
    with pytest.raises(jp.ConfigError, match="give a dict"):
        jp.Pipeline(
            model,
            schedule="chimera",
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=4),
            options=["direct"],
        )


@pytest.mark.parametrize(
    "removed,spelling",
    [
        (
            {"chimera": {"concat": "backward_halving"}},
            r"schedule='chimera', options=\{'concat': 'backward_halving'\}",
        ),
        ({"virtual": 2}, r"schedule='interleaved_1f1b', options=\{'virtual': 2\}\); virtual= carried"),
        ({"zb": {"max_deferred_w": 2}}, r"schedule='zb_h1', options=\{'max_deferred_w': 2\}"),
        ({"avgpipe": {}}, r"schedule='avgpipe', options=\{\}"),
        ({"wpipe": {"recompute": True}}, r"schedule='wpipe'"),
        ({"recompute": True}, r"recompute=True\) was removed: use residuals='inputs'"),
    ],
)
def test_the_removed_keywords_name_their_new_spelling(removed, spelling):
    """The per-method keywords of the unreleased 0.1.0 are refused with the spelling that replaced them."""
    model, _ = small_model("mlp", 4)
    kw = dict(schedule="chimera", num_microbatches=8, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=4))
    with pytest.raises(TypeError, match=spelling):
        jp.Pipeline(model, **kw, **removed)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chimeras'"):
        jp.Pipeline(model, **kw, chimeras={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the options= form builds without a warning
        pipe = jp.Pipeline(model, options={"concat": "backward_halving"}, **kw)
    assert pipe.schedule.M == 16  # backward halving: each micro-batch split in two


def test_a_built_schedule_runs_with_its_own_options():
    model, batch_fn = small_model("mlp", 4)
    sched = schedules.build("chimera", 4, 4, concat="direct", eager_reduce=True)
    pipe = jp.Pipeline(
        model, schedule=sched, num_microbatches=4, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=4)
    )
    assert pipe.schedule is sched and pipe.options["eager_reduce"] is True
    state, m = pipe.step(pipe.init(), batch_fn(8))
    assert float(m["loss"]) > 0
    with pytest.raises(jp.ConfigError, match="built for 4 devices and 4 micro-batches"):
        jp.Pipeline(
            model, schedule=sched, num_microbatches=8, optimizer=optax.sgd(0.1), mesh=jp.make_mesh(stages=4)
        )


def _name_comparisons(path):
    names = set(schedules.METHODS)
    n = 0
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Compare):
            for c in [node.left] + node.comparators:
                items = [c] if isinstance(c, ast.Constant) else getattr(c, "elts", [])
                if any(isinstance(i, ast.Constant) and i.value in names for i in items):
                    n += 1
                    break
    return n


def test_the_pipeline_and_its_runners_never_ask_a_method_name():
    files = ["jaxpipe/pipeline.py", "jaxpipe/optim/policies.py"] + glob.glob("jaxpipe/runners/*.py")
    assert {f: _name_comparisons(f) for f in files} == {f: 0 for f in files}


@pytest.mark.parametrize(
    "name, opts, says",
    [
        ("wpipe", {"apc": "false"}, r"options\['apc'\]='false' \(str\); it must be True or False"),
        ("wpipe", {"recompute": 1}, r"options\['recompute'\]=1 \(int\); it must be True or False"),
        ("chimera", {"eager_reduce": "no"}, r"options\['eager_reduce'\]='no'"),
        ("chimera", {"pipelines": 2.0}, r"options\['pipelines'\]=2.0 \(float\); it must be an integer >= 2"),
        ("chimera", {"concat": "doubling"}, r"one of 'direct', 'forward_doubling', 'backward_halving'"),
        (
            "zb_h1",
            {"max_deferred_w": 2.7},
            r"options\['max_deferred_w'\]=2.7 \(float\); it must be an integer >= 0, "
            r"or None",
        ),
        ("zb_v", {"w_from": "frontiers"}, r"one of 'frontier', 'recompute'"),
        ("avgpipe", {"advance": -1}, r"an integer >= 0, or 'auto'"),
        ("avgpipe", {"alpha": 1.5}, r"a number >= 0 <= 1"),
        ("pipeoptim", {"prediction": "decay"}, r"one of 'update', 'decay_free'"),
        ("pipedream_2bw", {"timeline": "lane"}, r"one of 'auto', 'lanes', 'alternating'"),
        ("interleaved_1f1b", {"virtual": 1}, r"an integer >= 2, or None"),
    ],
)
def test_option_types_and_ranges_are_checked_before_anything_is_built(name, opts, says):
    with pytest.raises(schedules.ScheduleError, match=says):
        schedules.options_for(name, 8, 4, opts)


@pytest.mark.parametrize(
    "name, opts",
    [
        ("wpipe", {"apc": True, "recompute": False}),
        ("chimera", {"pipelines": 4, "eager_reduce": True}),
        ("zb_h1", {"max_deferred_w": 3}),
        ("avgpipe", {"advance": 2, "alpha": 0.25, "memory_limit": 1.5}),
        ("pipeoptim", {"distance": "code", "prediction": "decay_free"}),
        ("interleaved_1f1b", {"virtual": 2}),
    ],
)
def test_well_typed_options_pass(name, opts):
    import numpy as np

    out = schedules.options_for(name, 8, 4, opts)
    assert all(out[k] == v for k, v in opts.items())
    if name == "zb_h1":  # a NumPy integer is an integer
        assert schedules.options_for(name, 8, 4, {"max_deferred_w": np.int64(3)})["max_deferred_w"] == 3
