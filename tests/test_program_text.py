"""The lowered-program check (``experiments.program_text``): a program's fingerprint is its text's, the
same on every lowering, and tells programs apart."""

from experiments import program_text


def test_one_program_one_fingerprint_and_other_programs_another():
    """GPipe on the lanes placement runs 1F1B's plan: one step program, one fingerprint (the benchmarks
    measured them apart until each run's first step was settled); ZB-H1's split backward is another."""
    one = program_text.fingerprint("mlp", "1f1b", {}, 2, 1)
    assert program_text.fingerprint("mlp", "1f1b", {}, 2, 1) == one
    assert program_text.fingerprint("mlp", "gpipe", {}, 2, 1) == one
    assert program_text.fingerprint("mlp", "zb_h1", {"placement": "lanes"}, 2, 1) != one
