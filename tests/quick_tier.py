"""The quick tier (issue #50): ``python -m pytest -q -n auto -m quick tests`` -- a few minutes that run first.

Every method's exactness once (each synchronous schedule against ``jax.grad``, each asynchronous method
against its serial reference loop, both with NaN-filled bubbles: the tests' default), the leak detector
itself, a resume, and the fast unit files (schedules, simulator, errors).  The whole suite still runs every
case; this is the set a new user runs as a smoke test and a developer runs before the whole suite.

``conftest.py`` marks these tests ``quick`` at collection and refuses a name here that the collected files do
not hold (a test renamed or removed must be renamed here too, never silently dropped from the tier).
"""

#: whole files: unit tests that compile little (each well under a minute on 2 cores)
FILES = [
    "tests/test_schedules.py",
    "tests/test_registry.py",
    "tests/test_lockstep_model.py",
    "tests/test_stage_bench.py",
    "tests/test_tune.py",
    "tests/test_policies.py",
    "tests/test_bad_inputs.py",
    "tests/test_errors.py",
    "tests/test_xla_cost.py",
    "tests/test_config_errors_48.py",
    "tests/test_host_ahead.py",
    "tests/test_stop_agreement.py",
    "tests/test_measure_cache.py",
]

#: single tests: one exactness case per method, small configurations
TESTS = [
    # synchronous schedules == jax.grad (MLP; the GPT once)
    "tests/test_exactness.py::test_loss_and_grad_match_jax_grad[2-3-1-gpipe-lanes-mlp]",
    "tests/test_exactness.py::test_loss_and_grad_match_jax_grad[4-4-1-1f1b-lanes-mlp]",
    "tests/test_exactness.py::test_loss_and_grad_match_jax_grad[2-2-2-1f1b-ordered-mlp]",
    "tests/test_exactness.py::test_loss_and_grad_match_jax_grad[2-2-2-1f1b-lanes-gpt]",
    "tests/test_exactness.py::test_nan_mode_detects_a_leak[lanes]",
    "tests/test_chimera_interleaved_zb.py::test_matches_jax_grad[mlp-chimera-4-4-1-opts1]",
    "tests/test_chimera_interleaved_zb.py::test_matches_jax_grad[mlp-chimera-4-8-1-opts9]",
    "tests/test_chimera_interleaved_zb.py::test_matches_jax_grad[mlp-interleaved_1f1b-2-4-1-opts19]",
    "tests/test_chimera_interleaved_zb.py::test_matches_jax_grad[mlp-zb_h1-4-4-1-opts23]",
    "tests/test_v_schedules.py::test_matches_jax_grad_with_nan_bubbles[mlp-zb_v-2-4-1]",
    "tests/test_v_schedules.py::test_matches_jax_grad_with_nan_bubbles[mlp-dualpipe_v-2-4-1]",
    # asynchronous methods == their serial reference loops
    "tests/test_async.py::test_mlp_matches_serial_reference[pipedream-2-sgd]",
    "tests/test_async.py::test_mlp_matches_serial_reference[pipedream_2bw-2-momentum]",
    "tests/test_async.py::test_mlp_matches_serial_reference[pipeoptim-2-adamw]",
    "tests/test_async.py::test_mlp_matches_serial_reference[spectrain-3-momentum]",
    "tests/test_cdp.py::test_mlp_matches_serial_reference[cdp_v1-2-2-sgd]",
    "tests/test_cdp.py::test_mlp_matches_serial_reference[cdp_v2-2-2-adamw]",
    "tests/test_wpipe.py::test_matches_serial_reference[2-2-momentum]",
    "tests/test_avgpipe.py::test_matches_serial_reference[2-2-3-2-sgd-1]",
    "tests/test_cyclic_dp.py::test_matches_serial_reference[v1-2-sgd]",
    # every planted bug still applies (a refactor that moves its text fails here, not in CI)
    "tests/test_mutations.py::test_every_mutation_applies_to_the_code_as_it_is",
    # a checkpoint resumes bit for bit
    "tests/test_checkpoint.py::test_resume_is_bit_equal[1f1b]",
]
