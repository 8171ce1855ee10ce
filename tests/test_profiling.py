"""`experiments.profiling`: a jax.profiler trace read back into operation categories."""

import jax
import jax.numpy as jnp

from experiments.profiling import Breakdown, category, plot_breakdowns, trace_steps


def test_categories_of_xla_operation_names():
    assert category("ynn_fusion.14") == "matmul"
    assert category("dot.3") == "matmul"
    assert category("ppermute.29") == "collective"
    assert category("Rendezvous") == "collective"
    assert category("all-reduce.1") == "collective"
    assert category("conditional.21") == "control"
    assert category("while.70") == "control"
    assert category("dynamic-slice_bitcast_fusion.41") == "data movement"
    assert category("copy.223") == "data movement"
    assert category("Wait: pending_threads=1/4") == "pool wait"
    assert category("wrapped_tanh") == "elementwise"
    # fusions: data movement only when every fused operation moves values
    assert category("select_dynamic-update-slice_fusion.7") == "data movement"
    assert category("slice_bitcast_fusion.14") == "data movement"
    assert category("broadcast_multiply_fusion") == "elementwise"
    assert category("pad_add_fusion.1") == "elementwise"


def test_trace_of_a_step_counts_its_matmuls_and_collectives(tmp_path):
    mesh = jax.make_mesh((4,), ("s",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("s")

    def body(x, w):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return jax.lax.ppermute(x, "s", [(i, (i + 1) % 4) for i in range(4)])

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, None), out_specs=spec))
    x = jax.device_put(jnp.ones((64, 128)), jax.sharding.NamedSharding(mesh, spec))
    w = jnp.eye(128) * 0.5
    b = trace_steps(lambda: f(x, w), steps=2, log_dir=str(tmp_path))
    assert isinstance(b, Breakdown) and b.wall_ms > 0
    # 3 matmuls and 1 collective-permute per device per step, 4 devices
    assert b.calls["matmul"] >= 12 and b.ms["matmul"] > 0
    assert b.calls["collective"] >= 4 and b.ms["collective"] > 0
    assert all(
        n == "ppermute" or n.startswith(("ppermute", "Rendezvous", "collective"))
        for n, _, _ in b.top("collective", 5)
    )
    assert abs(b.total - sum(b.ms.values())) < 1e-9
    # the picture: one bar per device of the traced step, beside a one-device row
    out = tmp_path / "prof.png"
    plot_breakdowns([("sharded", b), ("plain", Breakdown({"matmul": 1.0}, {}, {}, wall_ms=2.0))], str(out))
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_operation_kinds_sum_the_numbered_copies_of_an_operation():
    from experiments.profiling import by_kind

    b = Breakdown(
        ms={},
        ops={"dot": 1.0, "dot.12": 2.0, "ynn_fusion.3.clone": 0.5, "copy.1": 0.25},
        calls={},
        op_calls={"dot": 1, "dot.12": 3, "ynn_fusion.3.clone": 1, "copy.1": 1},
    )
    rows = by_kind(b)
    assert rows[0] == ("matmul", "dot", 3.0, 4, 0.75)
    assert [r[1] for r in rows] == ["dot", "ynn_fusion", "copy"]
    assert rows[2][0] == "data movement" and len(by_kind(b, 1)) == 1
