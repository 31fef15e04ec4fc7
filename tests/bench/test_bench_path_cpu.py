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


def test_with_the_ps_colocated_its_cpu_is_the_embedding_workers_and_no_ps_role_is_required():
    small = roles(data_loader=2.0, embedding_worker=4.5, nats=0.2, nn_worker=10.0)
    large = roles(data_loader=2.6, embedding_worker=7.8, nats=0.5, nn_worker=16.0)
    out = marginal_us_per_sample(small, large, 100_000, colocate_ps=True)
    assert out["embedding_path"] == pytest.approx(6 + 33 + 3) and "ps" not in out
    with pytest.raises(ValueError, match=r"\['ps'\]"):  # the separate topology still needs its PS figure
        marginal_us_per_sample(small, large, 100_000)


def test_median_over_pairs_per_role():
    assert median_by_role([{"ps": 1.0}, {"ps": 3.0}, {"ps": 2.0, "nats": 1.0}]) == {"nats": 1.0, "ps": 2.0}


def _measured(embedding_path: float) -> dict:
    per = {"data-loader": 4.0, "embedding-worker": 9.0, "ps": 5.0, "nats": 2.0, "nn-worker": 50.0,
           "embedding_path": embedding_path, "all_roles": 70.0}
    return {"status": "ok", "configuration": "persia-hybrid st=2 ps=1 ew=1 nn-threads=2", "batch_size": 256,
            "rows": [40_000, 160_000], "pairs": [{"us_per_sample": per, "load": 2.1, "samples_per_sec": 1.0}],
            "median_us_per_sample": per}


def test_headline_carries_the_embedding_path_figure_and_its_target():
    from bench.summary import headline

    h = headline([], None, path_cpu=_measured(18.5))
    assert h["embedding_path_us_per_sample"] == 18.5
    assert h["targets"]["embedding_path_us_per_sample"]["passed"] is True
    assert headline([], None, path_cpu=_measured(21.0))["targets"]["embedding_path_us_per_sample"]["passed"] is False
    missing = headline([], None, path_cpu={"status": "failed", "reason": "path CPU run of 40000 rows failed: x"})
    assert missing["embedding_path_us_per_sample"] is None
    assert "40000 rows failed" in missing["notes"]["embedding_path_us_per_sample"]


def test_report_shows_each_pair_and_the_median():
    from bench.report import render_path_cpu

    text = render_path_cpu(_measured(20.0))
    assert "| pair 1 | 4.0 | 9.0 | 5.0 | 2.0 | 20.0 | 50.0 | 70.0 | 2.1 |" in text
    assert "**20.0**" in text and "120,000 extra rows" in text
    assert "Not measured: not part of this profile" in render_path_cpu({"status": "skipped", "reason": "not part of this profile"})


def test_latency_hybrid_runs_skip_the_warm_up_and_the_launcher_env_says_so():
    from bench.e2e_bench import PROFILES, plan
    from bench.persia_local import synthetic_command

    planned = [p for p in plan(PROFILES["full"], "/data", parts=frozenset({"latency"}))]
    hybrid = [p.spec for p in planned if p.spec.system == "persia-hybrid"]
    assert hybrid and all(s.staleness_warmup_steps == 0 for s in hybrid)
    assert all(p.spec.staleness_warmup_steps is None for p in planned if p.spec.system == "persia-sync")
    _, env = synthetic_command(hybrid[0], "persia-launcher")
    assert env["PERSIA_STALENESS_WARMUP_STEPS"] == "0"
    models = [p.spec for p in plan(PROFILES["full"], "/data", parts=frozenset({"models"}))]
    assert all(s.staleness_warmup_steps is None for s in models)  # the model groups keep the default ramp


def test_the_colocated_measurement_is_a_second_table_and_its_own_key():
    from bench.report import render_path_cpu
    from bench.summary import headline

    colocated = _measured(14.0)
    colocated["configuration"] = "persia-hybrid st=2 ps=1 ew=1 colocated nn-threads=2"
    text = render_path_cpu(_measured(20.0), colocated)
    assert text.count("| **median** |") == 2 and "--colocate-ps" in text and "ew=1 colocated" in text
    h = headline([], None, path_cpu=_measured(20.0), path_cpu_colocated=colocated)
    assert h["embedding_path_us_per_sample"] == 20.0 and h["embedding_path_us_per_sample_colocated"] == 14.0
    assert "embedding_path_us_per_sample_colocated" not in headline([], None, path_cpu=_measured(20.0))
