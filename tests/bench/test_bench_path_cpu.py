"""bench/path_cpu.py's arithmetic: marginal CPU per sample from two runs' per-role CPU."""

import pytest

from bench.path_cpu import marginal_us_per_sample, median_by_role


def roles(**cpu):
    return {k.replace("_", "-"): {"cpu_s": v} for k, v in cpu.items()}


def test_marginal_cpu_cancels_start_up_and_sums_the_embedding_path():
    small = roles(data_loader=2.0, embedding_worker=3.0, ps=1.5, nats=0.2, nn_worker=10.0)
    large = roles(data_loader=2.6, embedding_worker=5.4, ps=2.4, nats=0.5, nn_worker=16.0)
    out = marginal_us_per_sample(small, large, 100_000)
    assert out["embedding-worker"] == pytest.approx(24.0)
    assert out["embedding_path"] == pytest.approx(6 + 24 + 9 + 3)
    assert out["all_roles"] == pytest.approx(6 + 24 + 9 + 3 + 60)


def test_a_role_missing_from_one_run_is_an_error_not_a_smaller_sum():
    small = roles(data_loader=2.0, embedding_worker=3.0, ps=1.5, nats=0.2, nn_worker=10.0)
    large = roles(data_loader=2.6, embedding_worker=5.4, nats=0.5, nn_worker=16.0)
    with pytest.raises(ValueError, match=r"\['ps'\]"):
        marginal_us_per_sample(small, large, 100_000)


def test_median_over_pairs_per_role():
    assert median_by_role([{"ps": 1.0}, {"ps": 3.0}, {"ps": 2.0, "nats": 1.0}]) == {"nats": 1.0, "ps": 2.0}
