"""A user's own schedule (``jp.schedules.from_actions`` / ``from_csv``): validated with errors that name the
action and the dependency it breaks, simulated, drawn, and run by ``Pipeline`` exactly against ``jax.grad``
with NaN in every bubble -- PyTorch's own orders for Interleaved 1F1B, ZBV and DualPipeV included
(``tests/data/torch_*.csv``, written by ``torch.distributed.pipelining`` itself: ``tests/data/README.md``)."""

import glob
import os

import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe import schedules
from helpers import reference, rel_err, small_model

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
TORCH_CSVS = sorted(glob.glob(os.path.join(DATA, "torch_*.csv")))


def _exact(schedule, kind="mlp", data=1):
    """The schedule's loss and gradients against jax.grad of the unpipelined model, NaN in the bubbles."""
    model, batch_fn = small_model(kind, schedule.num_model_stages)
    pipe = jp.Pipeline(
        model,
        schedule=schedule,
        num_microbatches=schedule.M,
        optimizer=optax.sgd(0.1),
        mesh=jp.make_mesh(stages=schedule.D, data=data),
        nan_bubbles=True,
    )
    batch = batch_fn(2 * schedule.M * data)
    loss, grads = pipe.loss_and_grad(pipe.init(), batch)
    ref_loss, ref_grads = reference(model, batch)
    assert np.isfinite(float(loss))
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-5
    return pipe


def test_pytorchs_orders_are_here():
    names = {os.path.basename(p) for p in TORCH_CSVS}
    assert {"torch_interleaved_1f1b_d2_m4.csv", "torch_zbv_d2_m4.csv", "torch_dualpipev_d2_m4.csv"} <= names


@pytest.mark.parametrize("path", TORCH_CSVS, ids=os.path.basename)
def test_pytorchs_own_order_runs_exactly(path):
    schedule = schedules.from_csv(path)
    assert schedule.name == os.path.splitext(os.path.basename(path))[0]
    pipe = _exact(schedule)
    assert pipe.method.name == "custom" and pipe.schedule is schedule
    # the order each device runs is the file's (computation only; a whole backward in a split schedule as
    # its two halves)
    assert schedules.from_csv(schedules.to_csv(schedule)).actions == schedule.actions


def test_a_hand_written_1f1b_equals_the_built_one_and_trains():
    """1F1B on 2 devices written as PyTorch writes it: the same actions as jaxpipe's builder, exact, and a
    step of it equals the built schedule's step."""
    mine = schedules.from_actions(
        [["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"], ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]]
    )
    built = schedules.build("1f1b", 2, 3)
    assert mine.actions == built.actions and mine.options == {"chunks": 1}
    _exact(mine, kind="gpt", data=2)
    model, batch_fn = small_model("mlp", 2)
    batch = batch_fn(12)
    steps = []
    for schedule in (mine, built):
        pipe = jp.Pipeline(model, schedule=schedule, num_microbatches=3, optimizer=optax.adam(1e-2))
        state, _ = pipe.step(pipe.init(), batch)
        steps.append(pipe.params(state))
    assert rel_err(steps[0], steps[1]) == 0.0


def test_a_whole_backward_in_a_split_schedule_runs_as_its_two_halves():
    """PyTorch's DualPipeV mixes whole backwards (B) with split ones (I, W): a B there is its input
    gradient then its weight gradient, one after the other on its device."""
    mixed = schedules.from_actions([["0F0", "0F1", "0I0", "0W0", "0B1"], ["1F0", "1B0", "1F1", "1I1", "1W1"]])
    assert mixed.has_w()
    assert [str(a) for a in mixed.actions[0]] == ["F0", "F1", "B0", "W0", "B1", "W1"]
    _exact(mixed)


def test_simulated_and_drawn(tmp_path):
    schedule = schedules.from_csv(schedules.to_csv(schedules.build("zb_v", 2, 4)), name="mine")
    assert schedule.name == "mine" and schedule.options == {"chunks": 2}
    report = schedule.simulate(f=1.0, b=2.0)
    assert report.schedule == "mine" and report.num_ticks > 0
    assert schedule.render_text().startswith("mine D=2 M=4")
    schedule.render(str(tmp_path / "mine.png"))
    assert (tmp_path / "mine.png").stat().st_size > 1000


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v"])
def test_every_built_schedule_round_trips_through_the_csv(name):
    virtual = {"virtual": 2} if name == "interleaved_1f1b" else {}
    built = schedules.build(name, 2, 4, **virtual)
    again = schedules.from_csv(schedules.to_csv(built))
    assert again.actions == built.actions and again.num_model_stages == built.num_model_stages


BROKEN = [
    # (actions, what the error says)
    ([["0F0", "0X0"], ["1F0", "1B0"]], r"device 0, position 1: '0X0' is not an action"),
    (
        [["0B0", "0F0"], ["1F0", "1B0"]],
        r"device 0 runs 0B0 \(backward of micro-batch 0 on stage 0\) at position 0, "
        r"before 0F0 \(forward of micro-batch 0 on stage 0\) at position 1, which it needs",
    ),
    (
        [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]],
        r"deadlocks: device 0 waits at 0B0 for 1B0; "
        r"device 1 waits at 1F1 for 0F1",
    ),
    (
        [["0F0", "0B0"], ["1F0"]],
        r"0B0 \(backward of micro-batch 0 on stage 0\) on device 0 needs 1B0 \(backward "
        r"of micro-batch 0 on stage 1\), which no device runs",
    ),
    ([["0F0", "1F0", "1B0", "0B0"], ["1F1"]], r"stage 1 runs on devices 0 and 1"),
    (
        [["0F0", "2F0", "2B0", "0B0"], ["1F0", "1B0"]],
        r"every device must hold the same number of model stages",
    ),
    (
        [["0F0", "0I0"], ["1F0", "1I0"]],
        r"0I0 computes an input gradient, but no action computes a weight gradient",
    ),
    ([["0F0", "0B0", "0F0"], ["1F0", "1B0"]], r"0F0 appears twice \(device 0 and device 0\)"),
    ([["0F0", "0F1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]], r"B1 of stage 0 is never run"),
]


@pytest.mark.parametrize("actions,message", BROKEN)
def test_a_broken_schedule_names_the_action_and_what_it_breaks(actions, message):
    with pytest.raises(schedules.ScheduleError, match=message):
        schedules.from_actions(actions)


def test_pipeline_takes_a_users_schedule_only_as_built():
    model, _ = small_model("mlp", 2)
    with pytest.raises(jp.ConfigError, match=r"jp.schedules.from_actions\(...\) or jp.schedules.from_csv"):
        jp.Pipeline(model, schedule="custom", num_microbatches=2)
    mine = schedules.from_actions([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
    with pytest.raises(
        jp.ConfigError, match=r"built for 2 devices and 2 micro-batches.*pass num_microbatches=2"
    ):
        jp.Pipeline(model, schedule=mine, num_microbatches=4)
    four, _ = small_model("mlp", 4)
    # the schedule fixes the devices: the advice is the model's stages (or the schedule), not another mesh
    with pytest.raises(jp.ConfigError, match=r"the model has 4 stages .* actions name 2 model stages") as e:
        jp.Pipeline(four, schedule=mine, num_microbatches=2, mesh=jp.make_mesh(stages=2))
    assert "make_mesh" not in str(e.value)


def test_a_missing_csv_file_is_named_not_read_as_the_schedules_text(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"from_csv\('.*mine.csv'\): no such file"):
        schedules.from_csv(str(tmp_path / "mine.csv"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        schedules.from_csv("mine.csv")
    assert schedules.from_csv("0F0,0B0").D == 1  # a line of text is still read as the schedule itself


def _command(*args):
    """``python -m experiments.<args>`` in the repository: (return code, stdout and stderr)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, "-m", "experiments." + args[0], *args[1:]],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return p.returncode, p.stdout + p.stderr


def test_the_timeline_command_draws_a_schedule_file_and_names_what_breaks_one(tmp_path):
    """``--schedule=FILE.csv``: PyTorch's order drawn with its own devices and micro-batches (``{M}``:
    --microbatches); a broken file's error names the action and the dependency it breaks."""
    rc, out = _command(
        "timeline",
        "--schedule=tests/data/torch_zbv_d2_m{M}.csv",
        "--microbatches=8",
        f"--out={tmp_path}/zbv.png",
        "--text=false",
    )
    assert rc == 0 and "torch_zbv_d2_m8: D=2 M=8" in out and (tmp_path / "zbv.png").stat().st_size > 0, out
    (tmp_path / "broken.csv").write_text("0F0,0B0\n1B0,1F0\n")
    rc, out = _command("timeline", f"--schedule={tmp_path}/broken.csv", "--out=")
    assert rc != 0 and "1B0" in out and "1F0" in out and "Traceback" not in out, out
    rc, out = _command("timeline", f"--schedule={tmp_path}/missing_{{M}}.csv", "--microbatches=4")
    assert rc != 0 and "missing_4.csv" in out and "Traceback" not in out, out


def test_the_timeline_command_writes_a_built_schedule_as_a_file_that_reads_back(tmp_path):
    """``--csv=FILE``: a built-in schedule's actions in PyTorch's format, a start for one's own; the command
    says where the file does not read back (Chimera's stages run on two devices)."""
    rc, out = _command(
        "timeline", "--schedule=zb_v", "--stages=2", "--microbatches=4", f"--csv={tmp_path}/zbv.csv", "--out="
    )
    assert rc == 0 and "reads it back" in out, out
    again = schedules.from_csv(str(tmp_path / "zbv.csv"))
    assert again.actions == schedules.build("zb_v", 2, 4).actions
    rc, out = _command("timeline", "--schedule=chimera", "--stages=2", f"--csv={tmp_path}/c.csv", "--out=")
    assert rc == 0 and "does not read back" in out and "stage 0 runs on devices 0 and 1" in out, out


def test_the_train_command_refuses_a_schedule_file_for_other_devices_or_micro_batches():
    """``jaxpipe train --schedule=FILE.csv``: the file's rows are the stage devices and its micro-batches the
    step's; a flag that disagrees is named with the value that would work (before anything compiles)."""
    rc, out = _command(
        "train",
        "--model=mlp",
        "--schedule=tests/data/torch_zbv_d2_m{M}.csv",
        "--stages=4",
        "--microbatches=4",
    )
    assert rc != 0 and "--stages=4" in out and "give --stages=2" in out and "Traceback" not in out, out
