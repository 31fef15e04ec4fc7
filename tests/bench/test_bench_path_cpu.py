"""bench/path_cpu.py's arithmetic: marginal CPU per sample from two runs' per-role CPU."""

import pytest

from bench.path_cpu import marginal_us_per_sample, median_by_role, training_marginal


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


def test_the_training_window_figure_uses_the_cpu_spent_inside_each_runs_window():
    small = {"memory": roles(ps=9.0), "training_cpu_s": {"data-loader": 0.5, "embedding-worker": 1.0, "ps": 0.5,
                                                         "nats": 0.1, "nn-worker": 3.0, "launcher": 0.0}}
    large = {"memory": roles(ps=99.0), "training_cpu_s": {"data-loader": 1.1, "embedding-worker": 3.4, "ps": 1.4,
                                                          "nats": 0.4, "nn-worker": 9.0, "launcher": 0.0}}
    out = training_marginal(small, large, 100_000)
    assert out["embedding_path"] == pytest.approx(6 + 24 + 9 + 3)  # the lifetime figures (memory) play no part
    assert out["nn-worker"] == pytest.approx(60.0)
    assert training_marginal({"memory": {}}, large, 100_000) is None  # a trainer that reports no window
    del large["training_cpu_s"]["ps"]
    with pytest.raises(ValueError, match=r"\['ps'\]"):
        training_marginal(small, large, 100_000)


def _measured(embedding_path: float) -> dict:
    per = {"data-loader": 4.0, "embedding-worker": 9.0, "ps": 5.0, "nats": 2.0, "nn-worker": 50.0,
           "embedding_path": embedding_path, "all_roles": 70.0}
    return {"status": "ok", "configuration": "persia-hybrid st=2 ps=1 ew=1 nn-threads=2", "batch_size": 256,
            "rows": [40_000, 160_000], "pairs": [{"us_per_sample": per, "load": 2.1, "samples_per_sec": 21_503.6}],
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
    assert "| pair 1 | 4.0 | 9.0 | 5.0 | 2.0 | 20.0 | 50.0 | 70.0 | — | 21,504 | 2.1 |" in text  # no window
    assert "**20.0**" in text and "120,000 extra rows" in text
    windowed = _measured(20.0)
    windowed["pairs"][0]["training_us_per_sample"] = {"embedding_path": 17.5}
    windowed["median_training_us_per_sample"] = {"embedding_path": 17.5}
    text = render_path_cpu(windowed)
    assert "| 70.0 | 17.5 | 21,504 | 2.1 |" in text and "| **70.0** | **17.5** |  |  |" in text
    assert "path, training only" in text
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


def test_cpu_bound_is_cores_over_cpu_per_sample_and_says_what_a_target_needs():
    from bench.summary import cpu_bound

    b = cpu_bound(2, 80.0, 50_000.0, 0.6, measured_sps=20_000.0)
    assert b["bound_sps"] == pytest.approx(25_000.0) and b["bound_ratio"] == pytest.approx(0.5)
    assert b["needed_us_per_sample"] == pytest.approx(2e6 / 30_000)  # 0.6 x 50k samples/s on 2 cores
    assert b["measured_ratio"] == pytest.approx(0.4) and b["packing"] == pytest.approx(0.8)
    assert cpu_bound(2, 80.0, 50_000.0, 0.6)["packing"] is None
    with pytest.raises(ValueError, match="must be positive"):
        cpu_bound(2, 0.0, 50_000.0, 0.6)


def _summary_row(mlp: str, label: str, system: str, sps: float) -> dict:
    return {"mlp": mlp, "label": label, "system": system, "sps_median": sps, "auc_mean": 0.8, "auc_std": None,
            "ok": 3, "runs": 3, "auc_by_seed": {}}


def test_headline_bounds_each_throughput_target_from_its_own_path_measurement():
    from bench.report import render_cpu_bound
    from bench.summary import HYBRID, headline

    summary = [_summary_row("mlp400", "torch threads=2", "torch", 50_000.0),
               _summary_row("mlp400", HYBRID, "persia-hybrid", 24_000.0),
               _summary_row("mlp400_b1024", "torch threads=2", "torch", 40_000.0),
               _summary_row("ffnn", "torch threads=2", "torch", 2_000.0),
               _summary_row("ffnn", HYBRID, "persia-hybrid", 1_800.0)]
    b1024 = _measured(10.0)
    b1024["median_us_per_sample"] = {**b1024["median_us_per_sample"], "all_roles": 40.0}
    b1024["batch_size"] = 1024
    ffnn = _measured(10.0)
    ffnn["median_us_per_sample"] = {**ffnn["median_us_per_sample"], "all_roles": 950.0}
    ffnn["mlp"] = "ffnn"
    h = headline(summary, None, path_cpu=_measured(20.0),
                 path_cpu_targets={"ratio_mlp400_b1024": b1024, "ratio_ffnn": ffnn}, cores=2)
    b256, bK, bF = (h["cpu_bound"][k] for k in ("ratio_mlp400", "ratio_mlp400_b1024", "ratio_ffnn"))
    assert b256["bound_sps"] == pytest.approx(2e6 / 70.0) and b256["packing"] == pytest.approx(24_000 * 70.0 / 2e6)
    assert bK["bound_ratio"] == pytest.approx(50_000 / 40_000) and bK["packing"] is None  # no hybrid run at 1024
    assert bF["bound_ratio"] == pytest.approx(2e6 / 950.0 / 2_000) and bF["target_ratio"] == 0.97
    text = render_cpu_bound(h["cpu_bound"], 2)
    assert "| 50,000 | 70.0 | 28,571 | 0.571 | >= 0.6 | 66.7 | 0.480 | 0.84 |" in text
    assert "mlp400, batch 1024 | 40,000 | 40.0 | 50,000 | 1.250 | >= 0.8 |" in text
    assert "ffnn, batch 256 | 2,000 | 950.0 | 2,105 | 1.053 | >= 0.97 | 1030.9 | 0.900 | 0.86 |" in text
    missing = headline(summary, None, path_cpu=_measured(20.0), cores=2)["cpu_bound"]["ratio_mlp400_b1024"]
    assert missing == {"missing": "no path CPU measurement"}
    assert "not measured: no path CPU measurement" in render_cpu_bound({"ratio_mlp400_b1024": missing}, 2)
    assert headline(summary, None, path_cpu=_measured(20.0))["cpu_bound"]["ratio_mlp400"] == {"missing": "no CPU count"}
    noisy = _measured(20.0)  # a few rows: start-up noise larger than their CPU
    noisy["median_us_per_sample"] = {**noisy["median_us_per_sample"], "all_roles": -200.0}
    assert "not positive (-200.0 µs)" in headline(summary, None, path_cpu=noisy, cores=2)["cpu_bound"]["ratio_mlp400"]["missing"]


def test_the_full_profile_measures_the_path_of_every_throughput_target():
    from bench.e2e_bench import PROFILES

    from bench.summary import TARGETS

    full = PROFILES["full"]
    assert full.path_cpu_rows
    plans = {t.target: t for t in full.path_cpu_targets}
    assert set(plans) == {"ratio_mlp400_b1024", "ratio_ffnn"} <= set(TARGETS)
    models = {m.key: m for m in full.models}
    for t in plans.values():  # each measured as that target's own runs are: model and batch size
        group = models["mlp400_b1024" if t.target == "ratio_mlp400_b1024" else "ffnn"]
        assert t.mlp == group.mlp and t.batch_size == (group.batch_size or full.batch_size)
        assert 0 < t.rows[0] < t.rows[1] <= full.data.train_rows
