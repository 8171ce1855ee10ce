"""What the no-flush programs send, read from the compiled HLO (issue #13): a reduction over data-parallel
axes of one device each is no reduction -- XLA keeps such an all-reduce (one-device groups), and the
no-flush executors would run a weight-sized one in every tick (``runtime.collectives.psum_over``)."""

import re

import optax
import pytest

import jaxpipe as jp
from helpers import small_model


def _array_all_reduces(pipe, batch):
    state = pipe.prepare(pipe.init(), batch)
    hlo = pipe.lower("step", state, batch).compile().as_text()
    ops = [
        re.split(r" all-reduce(?:-start)?\(", l)[0]
        for l in hlo.splitlines()
        if re.search(r" all-reduce(-start)?\(", l)
    ]
    return [t for t in ops if re.search(r"\w+\[\d[\d,]*\]", t)]  # results with a non-scalar array


@pytest.mark.parametrize("schedule,stages", [("pipeoptim", 4), ("wpipe", 8)])
def test_no_gradient_all_reduce_without_data_parallelism(schedule, stages):
    model, batch_fn = small_model("mlp", stages)
    found = {}
    for data in (1, 2):
        pipe = jp.Pipeline(
            model,
            schedule=schedule,
            num_microbatches=4,
            optimizer=optax.sgd(0.1),
            mesh=jp.make_mesh(stages=4, data=data),
        )
        found[data] = _array_all_reduces(pipe, batch_fn(16))
    assert found[1] == [], found[1]
    assert found[2], "data=2 must average the gradients over its replicas"
