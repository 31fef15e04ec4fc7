"""Run planning (interleaving), aggregation (medians, seed-paired AUC gaps) and the headline."""

from __future__ import annotations

from bench.e2e_bench import LAUNCHER_DEFAULT, PROFILES, LatencyPlan, ModelPlan, Profile, SystemPlan, plan, plan_runs
from bench.e2e_bench import command_for
from bench.summary import (HYBRID, SYNC, colocated_label, headline, hybrid_label, latency_rows, mean_curve, summarize,
                           sync_label)
from bench.spec import RunSpec
from synthetic_ctr.manifest import GeneratorConfig


def _profile(repeats=3):
    return Profile(
        name="t",
        data=GeneratorConfig(train_rows=10, test_rows=10),
        models=(
            ModelPlan("mlp400", 10, 10, (SystemPlan("torch"), SystemPlan("persia-hybrid"), SystemPlan("persia-sync", repeats=1))),
            ModelPlan("ffnn", 5, 5, (SystemPlan("torch"),)),
        ),
        repeats=repeats,
    )


def test_runs_are_interleaved_with_seed_per_round():
    specs = plan_runs(_profile(), "d")
    order = [(s.mlp, s.system, s.seed) for s in specs]
    assert order[:5] == [
        ("mlp400", "torch", 0), ("mlp400", "persia-hybrid", 0), ("mlp400", "persia-sync", 0),
        ("mlp400", "torch", 1), ("mlp400", "persia-hybrid", 1),
    ]  # fmt: skip
    assert sum(1 for o in order if o[1] == "persia-sync") == 1
    assert [o for o in order if o[0] == "ffnn"] == [("ffnn", "torch", k) for k in range(3)]
    assert {s.data_dir for s in specs} == {"d"}
    only = plan_runs(_profile(), "d", systems={"torch"})
    assert {s.system for s in only} == {"torch"} and len(only) == 6


def test_full_profile_measures_every_configuration_the_issue_asks_for():
    full = PROFILES["full"]
    planned = plan(full, "d")
    labels = {(p.group, p.spec.label) for p in planned}
    hybrid, sync = hybrid_label(full.hybrid_staleness, full.persia_nn_threads), sync_label(full.persia_nn_threads)
    # the headline is PERSIA's bound with the runtime's replay; beside it the same bound with stale reads
    st10 = RunSpec(system="persia-hybrid", data_dir="d", staleness=10, nn_threads=full.persia_nn_threads,
                   replay=False).label
    assert full.hybrid_staleness == 10 and "no-replay" in st10
    for needed in [("mlp400", "torch threads=2"), ("mlp400", "torch fused threads=2"), ("mlp400", "torchrec threads=2"),
                   ("mlp400", hybrid), ("mlp400", sync), ("mlp400", st10),  # the issue's staleness 10, beside the headline
                   ("mlp400_b1024", "torch fused threads=2"), ("mlp400_b1024", hybrid),
                   ("mlp400_30steps", hybrid), ("mlp400_30steps", sync),
                   ("ffnn", "torch threads=2"), ("ffnn", hybrid),
                   ("latency_torch", "torch fused threads=2")]:  # fmt: skip
        assert needed in labels
    for group in ("mlp400", "mlp400_30steps"):
        for label in (hybrid, sync):
            seeds = {p.spec.seed for p in planned if p.spec.label == label and p.group == group}
            assert seeds == {0, 1, 2}  # the AUC gap is averaged over 3 seeds
    colocated = [p.spec for p in planned if p.spec.colocate_ps]  # the headline again, with --colocate-ps
    assert {(p.label, p.seed) for p in colocated} == {(colocated_label(hybrid), 0)}  # context: one run
    # what a target is computed from runs every repeat; context runs once (the 30-minute budget)
    # (both baselines where either can be the faster: batch 256 and 1024)
    for group, label in [("mlp400", "torch fused threads=2"), ("mlp400", "torch threads=2"),
                         ("mlp400_b1024", "torch fused threads=2"), ("mlp400_b1024", "torch threads=2"),
                         ("mlp400_b1024", hybrid), ("ffnn", "torch fused threads=2"), ("ffnn", hybrid)]:
        assert {p.spec.seed for p in planned if p.group == group and p.spec.label == label} == {0, 1, 2}
    for group, label in [("mlp400", st10), ("ffnn", "torch threads=2"),
                         ("mlp400_30steps", st10), ("latency_2ms", st10)]:
        assert {p.spec.seed for p in planned if p.group == group and p.spec.label == label} == {0}
    for group in ("latency_0ms", "latency_0.5ms", "latency_2ms"):  # the latency targets: 3 seeds each
        for label in (hybrid, sync):
            assert {p.spec.seed for p in planned if p.group == group and p.spec.label == label} == {0, 1, 2}
    assert full.path_cpu_colocated_pairs == 0 and full.latency.train_rows == 40_000
    assert "--colocate-ps" in command_for(colocated[0], "persia-launcher")[0]
    assert not any(p.spec.colocate_ps for p in planned if p.group != "mlp400")
    assert {p.spec.batch_size for p in planned if p.group == "mlp400_b1024"} == {1024}
    assert {p.spec.batch_size for p in planned if p.group != "mlp400_b1024"} == {full.batch_size}
    assert {p.spec.train_rows for p in planned if p.group == "mlp400_30steps"} == {30 * full.batch_size}
    assert {p.spec.staleness for p in planned if p.spec.system == "persia-hybrid"} == {10}
    stale = [p for p in planned if p.spec.label == st10]  # in the AUC groups and at every delay
    assert {p.group for p in stale} == {"mlp400", "mlp400_30steps", "latency_0ms", "latency_0.5ms", "latency_2ms"}
    assert command_for(stale[0].spec, "persia-launcher")[1]["PERSIA_REPLAY_OWN_UPDATES"] == "0"
    assert command_for(planned[[p.spec.label for p in planned].index(hybrid)].spec,
                       "persia-launcher")[1]["PERSIA_REPLAY_OWN_UPDATES"] == "1"
    assert all(p.spec.staleness is None and p.spec.nn_threads is None for p in planned if not p.spec.system.startswith("persia"))
    # latency: 3 delays x (sync and headline hybrid x 3 seeds, stale reads x 1) behind the proxies,
    # torch once per seed
    delayed = [p for p in planned if p.delay_ms is not None]
    assert sorted({p.delay_ms for p in delayed}) == [0.0, 0.5, 2.0]
    assert {p.spec.label for p in delayed} == {sync, hybrid, st10} and len(delayed) == 3 * (3 + 3 + 1)
    assert all(p.group == f"latency_{p.delay_ms:g}ms" for p in delayed)
    assert [p.spec.seed for p in planned if p.group == "latency_torch"] == [0, 1, 2]


def test_latency_runs_interleave_seeds_and_go_through_the_proxy():
    from bench.e2e_bench import command_for

    prof = Profile(name="t", data=GeneratorConfig(train_rows=10, test_rows=10), models=(), repeats=2,
                   latency=LatencyPlan(train_rows=8, test_rows=4, delays_ms=(0.0, 2.0), systems=(SystemPlan("persia-sync"),)))
    order = [(p.group, p.spec.system, p.spec.seed, p.delay_ms) for p in plan(prof, "d")]
    assert order == [
        ("latency_torch", "torch", 0, None), ("latency_0ms", "persia-sync", 0, 0.0), ("latency_2ms", "persia-sync", 0, 2.0),
        ("latency_torch", "torch", 1, None), ("latency_0ms", "persia-sync", 1, 0.0), ("latency_2ms", "persia-sync", 1, 2.0),
    ]  # fmt: skip
    spec = plan(prof, "d")[2].spec
    argv, _ = command_for(spec, "persia-launcher", delay_ms=2.0)
    assert argv[1:6] == ["-m", "bench.latency_run", "--delay-ms", "2", "--"] and argv[6] == "persia-launcher"
    assert command_for(spec, "persia-launcher")[0][0] == "persia-launcher"
    torch_env = command_for(plan(prof, "d")[0].spec, None)[1]
    assert "OMP_WAIT_POLICY" not in torch_env  # a lone torch process keeps torch's default threading
    assert command_for(spec, "persia-launcher")[1]["OMP_WAIT_POLICY"] == "PASSIVE"


def test_latency_figures_compare_each_configuration_with_its_own_zero_delay():
    H, S = hybrid_label(2), sync_label()
    runs = []
    for seed in range(2):
        runs += [_run("latency_torch", "torch fused threads=2", seed, 100.0, 0.80),
                 _run("latency_0ms", H, seed, 80.0, 0.7990 + seed / 1000), _run("latency_0ms", S, seed, 60.0, 0.7995),
                 _run("latency_2ms", H, seed, 72.0, 0.7985 + seed / 1000), _run("latency_2ms", S, seed, 30.0, 0.7990)]  # fmt: skip
    summary = summarize(runs)
    h = headline(summary, None, hybrid=H)
    assert abs(h["latency_hybrid_keep_2ms"] - 0.9) < 1e-12 and abs(h["latency_hybrid_over_sync_2ms"] - 2.4) < 1e-12
    assert abs(h["latency_auc_gap_2ms"] - (-0.0005 + 0.0005) / 2) < 1e-12
    assert h["targets"]["latency_hybrid_keep_2ms"]["passed"] and h["targets"]["latency_hybrid_over_sync_2ms"]["passed"]
    rows = {(r["delay_ms"], r["label"]): r for r in latency_rows(summary, H, S)}
    assert rows[2.0, S]["keep"] == 0.5 and rows[2.0, S]["over_sync"] is None
    assert rows[2.0, "torch fused threads=2"]["keep"] == 1.0  # no network: the same runs at every delay
    assert rows[0.0, H]["over_sync"] == 80.0 / 60.0 and rows[0.0, H]["headline"]


def test_fused_baseline_counts_for_speed_and_the_ps_formula_for_auc():
    runs = [_run("mlp400", "torch threads=2", 0, 100.0, 0.800), _run("mlp400", "torch fused threads=2", 0, 120.0, 0.790),
            _run("mlp400", SYNC, 0, 60.0, 0.801), _run("mlp400", HYBRID, 0, 90.0, 0.8)]  # fmt: skip
    runs[1]["spec"]["fused"] = True
    h = headline(summarize(runs), None)
    assert h["baseline_mlp400"] == "torch fused threads=2" and h["ratio_mlp400"] == 0.75
    assert h["baseline_auc_mlp400"] == 0.800 and abs(h["auc_gap_baseline_sync"] + 0.001) < 1e-12
    assert h["ratio_mlp400_b1024"] is None and h["notes"]["ratio_mlp400_b1024"].startswith("not yet measured")
    assert h["ratio_mlp400_colocated"] is None
    runs.append(_run("mlp400", colocated_label(HYBRID), 0, 96.0, 0.8))
    assert headline(summarize(runs), None)["ratio_mlp400_colocated"] == 0.8


def test_system_plans_resolve_staleness_and_threads_from_the_profile():
    prof = Profile(
        name="t",
        data=GeneratorConfig(train_rows=10, test_rows=10),
        models=(ModelPlan("mlp400", 10, 10, (SystemPlan("persia-hybrid"), SystemPlan("persia-hybrid", staleness=10),
                                              SystemPlan("persia-sync"), SystemPlan("persia-hybrid", nn_threads=LAUNCHER_DEFAULT))),),
        repeats=1, hybrid_staleness=3, persia_nn_threads=2,
    )  # fmt: skip
    got = [(s.label, s.staleness, s.nn_threads) for s in plan_runs(prof, "d")]
    assert got == [
        ("persia-hybrid st=3 ps=1 ew=1 nn-threads=2", 3, 2),
        ("persia-hybrid st=10 ps=1 ew=1 nn-threads=2", 10, 2),
        ("persia-sync ps=1 ew=1 nn-threads=2", None, 2),
        ("persia-hybrid st=3 ps=1 ew=1", 3, None),  # left to the launcher's thread budget
    ]


def test_headline_uses_the_configuration_it_is_given():
    runs = [
        _run("mlp400", "torch threads=2", 0, 100.0, 0.80),
        _run("mlp400", "persia-hybrid st=2 ps=1 ew=1", 0, 70.0, 0.7990),
        _run("mlp400", "persia-hybrid st=10 ps=1 ew=1", 0, 90.0, 0.7900),
        _run("mlp400", SYNC, 0, 40.0, 0.8000),
    ]
    h = headline(summarize(runs), None, hybrid=hybrid_label(2))
    assert h["hybrid_sps_mlp400"] == 70.0 and abs(h["auc_gap_hybrid_sync"] + 0.001) < 1e-12
    assert h["hybrid_configuration"] == "persia-hybrid st=2 ps=1 ew=1" and h["sync_configuration"] == SYNC
    assert headline(summarize(runs), None)["hybrid_sps_mlp400"] == 90.0  # the default: staleness 10


def test_auc_gap_targets_measure_the_default_setting_not_the_headline_bound():
    runs = []
    for mlp in ("mlp400", "mlp400_30steps"):
        runs += [_run(mlp, "persia-hybrid st=2 ps=1 ew=1", 0, 70.0, 0.7990),
                 _run(mlp, "persia-hybrid st=10 ps=1 ew=1", 0, 90.0, 0.7996),
                 _run(mlp, SYNC, 0, 40.0, 0.8000)]  # fmt: skip
    h = headline(summarize(runs), None, hybrid=hybrid_label(2), default=hybrid_label(10))
    assert h["hybrid_sps_mlp400"] == 70.0  # speed: the headline bound
    assert abs(h["auc_gap_hybrid_sync"] + 0.0004) < 1e-12 and abs(h["auc_gap_30steps"] + 0.0004) < 1e-12
    assert h["default_configuration"] == "persia-hybrid st=10 ps=1 ew=1"
    assert h["targets"]["abs_auc_gap_30steps"]["passed"]
    assert abs(headline(summarize(runs), None, hybrid=hybrid_label(2))["auc_gap_hybrid_sync"] + 0.001) < 1e-12


def _run(mlp, label, seed, sps=None, auc=None, status="ok", reason=None, curve=(), memory=None):
    system = label.split(" ")[0]
    return {
        "mlp": mlp, "label": label, "seed": seed, "status": status, "reason": reason, "wall_seconds": 1.0,
        "loadavg_start": 1.5, "loadavg_end": 2.5, "spec": {"system": system}, "memory": memory or {},
        "result": None if status != "ok" else {"samples_per_sec": sps, "auc": auc, "auc_curve": list(curve)},
    }  # fmt: skip


def test_summary_takes_median_throughput_and_paired_auc_gaps():
    runs = [
        _run("mlp400", "torch threads=2", 0, 100.0, 0.80), _run("mlp400", HYBRID, 0, 70.0, 0.79), _run("mlp400", SYNC, 0, 40.0, 0.7905),
        _run("mlp400", "torch threads=2", 1, 300.0, 0.81), _run("mlp400", HYBRID, 1, 50.0, 0.80), _run("mlp400", SYNC, 1, 45.0, 0.7990),
        _run("mlp400", "torch threads=2", 2, 120.0, 0.82), _run("mlp400", HYBRID, 2, 90.0, 0.81), _run("mlp400", SYNC, 2, 30.0, 0.8115),
        _run("ffnn", "torch threads=2", 0, 10.0, 0.7), _run("ffnn", HYBRID, 0, 9.75, 0.69),
    ]  # fmt: skip
    summary = summarize(runs)
    torch400 = next(s for s in summary if s["mlp"] == "mlp400" and s["label"] == "torch threads=2")
    assert torch400["sps_median"] == 120.0 and torch400["sps_min"] == 100.0 and torch400["sps_max"] == 300.0
    h = headline(summary, None)
    assert h["baseline_sps_mlp400"] == 120.0 and h["hybrid_sps_mlp400"] == 70.0
    assert abs(h["ratio_mlp400"] - 70.0 / 120.0) < 1e-12
    assert abs(h["ratio_ffnn"] - 0.975) < 1e-12
    assert abs(h["auc_gap_hybrid_sync"] - (-0.0005 + 0.001 - 0.0015) / 3) < 1e-12
    assert h["targets"]["ratio_mlp400"]["passed"] is False
    assert h["targets"]["ratio_ffnn"]["passed"] is True
    assert h["targets"]["abs_auc_gap_hybrid_sync"]["passed"] is True
    assert h["adult_auc"] is None and h["targets"]["adult_auc"]["passed"] is None
    assert "adult_auc" in h["notes"]


def test_unmeasured_system_gives_null_figures_with_the_reason():
    why = "not yet measured: persia-launcher is not installed"
    runs = [
        _run("mlp400", "torch threads=2", 0, 100.0, 0.8),
        _run("mlp400", HYBRID, 0, status="skipped", reason=why),
        _run("mlp400", SYNC, 0, status="skipped", reason=why),
    ]
    h = headline(summarize(runs), {"status": "skipped", "reason": why})
    for key in ("ratio_mlp400", "hybrid_sps_mlp400", "auc_gap_hybrid_sync", "adult_auc"):
        assert h[key] is None and h["notes"][key] == why
    assert h["baseline_sps_mlp400"] == 100.0 and "baseline_sps_mlp400" not in h["notes"]
    assert h["notes"]["ratio_ffnn"].startswith("not yet measured: no ffnn")


def test_failed_runs_are_reported_not_averaged():
    runs = [_run("mlp400", "torch threads=2", 0, 100.0, 0.8), _run("mlp400", "torch threads=2", 1, status="failed", reason="exit status 1")]
    s = summarize(runs)[0]
    assert s["ok_runs"] == 1 and s["runs"] == 2 and s["sps_median"] == 100.0
    assert s["reasons"] == ["exit status 1"]


def test_mean_curve_is_pointwise():
    a = [{"samples": 10, "auc": 0.6}, {"samples": 20, "auc": 0.7}]
    b = [{"samples": 10, "auc": 0.8}]
    assert mean_curve([a, b]) == [{"samples": 10, "auc": 0.7}, {"samples": 20, "auc": 0.7}]


def test_memory_per_role_is_the_max_over_runs_and_trainer_figure():
    runs = [
        _run("mlp400", HYBRID, 0, 1.0, 0.5, memory={"ps": {"max_mb": 100.0}, "nn-worker": {"max_mb": 300.0}}),
        _run("mlp400", HYBRID, 1, 1.0, 0.5, memory={"ps": {"max_mb": 150.0}, "other": {"max_mb": 9.0}}),
    ]
    runs[1]["result"]["peak_rss_mb"] = {"nn-worker": 350.0}
    assert summarize(runs)[0]["memory_mb"] == {"ps": 150.0, "nn-worker": 350.0}


def test_cpu_per_role_is_the_median_over_runs_and_load_the_max_seen():
    runs = [_run("mlp400", HYBRID, k, 1.0, 0.5, memory={"ps": {"max_mb": 1.0, "cpu_s": c}, "other": {"max_mb": 1.0, "cpu_s": 9.0}})
            for k, c in enumerate((3.0, 1.0, 2.0))]  # fmt: skip
    runs[2]["loadavg_end"] = 4.0
    s = summarize(runs)[0]
    assert s["cpu_s"] == {"ps": 2.0} and s["max_load"] == 4.0


def test_baseline_is_the_fastest_thread_count():
    runs = [
        _run("mlp400", "torch threads=1", 0, 200.0, 0.80), _run("mlp400", "torch threads=2", 0, 150.0, 0.81),
        _run("mlp400", HYBRID, 0, 120.0, 0.80),
    ]  # fmt: skip
    h = headline(summarize(runs), None)
    assert h["baseline_mlp400"] == "torch threads=1" and h["baseline_sps_mlp400"] == 200.0
    assert h["ratio_mlp400"] == 0.6
