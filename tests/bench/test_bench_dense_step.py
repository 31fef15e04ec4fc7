"""bench/dense_step.py: the NN worker's dense step alone, in this process and in a child process
with its own OpenMP settings (real torch; figures are not asserted, only that they are measured)."""

from bench.dense_step import CONFIGS, measure, run_config


def test_the_dense_step_is_timed_in_process_and_in_a_child_with_its_wait_policy():
    got = measure("8,8", batch_size=32, steps=3)
    assert got["ms_per_step"] > 0 and got["samples_per_sec"] > 0 and got["cpu_per_wall"] > 0
    child = run_config("8,8", 32, 3, threads=1, wait_policy="PASSIVE")
    assert set(child) == set(got) and child["samples_per_sec"] > 0
    assert [c[0] for c in CONFIGS].count("2 threads, spinning") == 1  # the ratios' reference
