"""The report keeps hand-written sections, writes the plots and e2e.json."""

from __future__ import annotations

import json

from bench.report import BEGIN, END, splice, write_report
from bench.summary import HYBRID

REQUIRED = ("ratio_mlp400", "ratio_ffnn", "auc_gap_hybrid_sync", "adult_auc", "baseline_sps_mlp400", "hybrid_sps_mlp400")


def test_new_report_has_generated_block_and_placeholders():
    text = splice(None, "GENERATED")
    assert text.startswith("# Benchmarks")
    assert BEGIN in text and END in text and "GENERATED" in text
    assert "## Embedding PS" in text and text.index(END) < text.index("## Embedding PS")


def test_regeneration_replaces_only_the_block():
    first = splice(None, "OLD")
    edited = first.replace("Placeholder for the embedding", "Measured: 1M lookups/s. Placeholder for the embedding")
    edited += "\n## Notes\nhand-written\n"
    second = splice(edited, "NEW")
    assert "NEW" in second and "OLD" not in second
    assert "Measured: 1M lookups/s." in second and "hand-written" in second


def test_file_without_markers_keeps_its_content():
    text = splice("# Benchmarks\n\n## Embedding PS\n\nPS figures\n", "GEN")
    assert text.index("GEN") < text.index("## Embedding PS") and "PS figures" in text


def _doc():
    runs = []
    for seed in range(2):
        for label, sps, auc in (("torch threads=2", 100.0, 0.80), (HYBRID, 80.0, 0.79)):
            runs.append({
                "mlp": "mlp400", "label": label, "seed": seed, "status": "ok", "wall_seconds": 3.0,
                "spec": {"system": label.split(" ")[0]}, "memory": {"trainer": {"max_mb": 400.0}},
                "result": {"samples_per_sec": sps + seed, "auc": auc, "auc_curve": [{"samples": 5, "auc": 0.6}, {"samples": 10, "auc": auc}]},
            })  # fmt: skip
    runs.append({"mlp": "mlp400", "label": "persia-sync ps=1 ew=1", "seed": 0, "status": "skipped",
                 "reason": "not yet measured: x", "spec": {"system": "persia-sync"}, "memory": {}, "result": None})  # fmt: skip
    return {
        "profile": {"name": "t", "models": [{"mlp": "mlp400", "train_rows": 10, "test_rows": 5}], "batch_size": 4,
                    "repeats": 2, "baseline_threads": 2, "eval_points": 2, "curve_eval_rows": 5},
        "machine": {"cpus": 2},
        "data": {"config": {"scale": 0.01, "cardinality_floor": 1000, "zipf_exponent": 1.1, "seed": 0},
                 "train_positive_rate": 0.25, "train_rows": 10, "test_rows": 5, "vocab_ids": 7,
                 "generation_seconds": 0.1, "teacher_test_auc": 0.87},
        "runs": runs,
        "adult_income": {"status": "skipped", "reason": "not yet measured: y"},
        "total_seconds": 1.0,
    }  # fmt: skip


def test_write_report_produces_markdown_plots_and_headline(tmp_path):
    head = write_report(_doc(), docs_dir=tmp_path / "docs", results_dir=tmp_path / "results")
    saved = json.loads((tmp_path / "results" / "e2e.json").read_text())
    assert saved == json.loads(json.dumps(head))
    assert all(k in saved for k in REQUIRED)
    assert saved["baseline_sps_mlp400"] == 100.5 and saved["ratio_mlp400"] == 80.5 / 100.5
    assert saved["auc_gap_hybrid_sync"] is None and saved["notes"]["auc_gap_hybrid_sync"] == "not yet measured: x"
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "| torch threads=2 | 2/2 | 100 |" in md.replace(",", "")
    assert "not yet measured: x" in md and "## Embedding PS" in md
    for name in ("e2e_throughput.png", "e2e_auc_curve.png", "e2e_memory.png"):
        assert (tmp_path / "docs" / "img" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_section_and_plot_and_merge_keep_the_model_runs(tmp_path):
    from bench.e2e_bench import merge_latency

    doc = _doc()
    doc["profile"]["latency"] = {"train_rows": 8, "test_rows": 4}
    lat = []
    for delay, sps in ((0.0, 80.0), (2.0, 76.0)):
        lat.append({"mlp": f"latency_{delay:g}ms", "label": HYBRID, "seed": 0, "status": "ok", "wall_seconds": 3.0,
                    "delay_ms": delay, "spec": {"system": "persia-hybrid"},
                    "memory": {"delay-proxy": {"max_mb": 30.0, "cpu_s": 1.5}},
                    "result": {"samples_per_sec": sps, "auc": 0.79, "auc_curve": []}})  # fmt: skip
    runs_file = tmp_path / "runs.json"
    runs_file.write_text(json.dumps({**doc, "runs": doc["runs"] + [dict(lat[0], result=None, status="failed")]}))
    probe = {"cpus": 2, "wake_round_trip_us_cross_cpu": 143.0, "wake_round_trip_us_same_cpu": 8.3}
    merged = merge_latency(runs_file, {**doc, "machine": probe, "runs": lat})
    assert merged["machine"] == doc["machine"] and merged["latency_machine"] == probe  # neither probe lost
    assert [r["mlp"] for r in merged["runs"]].count("mlp400") == len(doc["runs"])  # model runs kept
    assert [r for r in merged["runs"] if r["mlp"].startswith("latency")] == lat  # old latency runs replaced
    head = write_report(merged, docs_dir=tmp_path / "docs", results_dir=tmp_path / "results")
    assert head["latency_hybrid_keep_2ms"] == 76.0 / 80.0
    assert head["notes"]["latency_hybrid_over_sync_2ms"].startswith("not yet measured")
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    section = md[md.index("### Network latency"):]
    assert f"| 2 | **{HYBRID}** | 76 | 0.950 |" in section and "| 1.5 |" in section
    assert "a wake-up round trip across CPUs 143 µs (8 µs on one CPU)" in section  # the latency runs' machine
    assert "latency_2ms" not in md[: md.index("### Network latency")]  # not among the models' tables
    assert (tmp_path / "docs" / "img" / "e2e_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_models_run_replaces_only_its_groups_and_the_report_says_so(tmp_path):
    """``--models``: the groups it ran replace theirs in runs.json; the others, the path CPU and
    adult-income stay; the re-run group's section says it comes from a later run, and on what."""
    from bench.e2e_bench import merge_models

    doc = _doc()
    doc["profile"]["models"].append({"mlp": "ffnn", "train_rows": 10, "test_rows": 5})
    ffnn_old = [dict(r, mlp="ffnn") for r in doc["runs"] if r["status"] == "ok"]
    doc["runs"] = doc["runs"] + ffnn_old
    doc["path_cpu"] = {"status": "skipped", "reason": "the full run's"}
    runs_file = tmp_path / "runs.json"
    runs_file.write_text(json.dumps(doc))
    assert merge_models(tmp_path / "none.json", doc) is doc  # nothing earlier: the run alone

    probe = {"cpus": 2, "wake_round_trip_us_cross_cpu": 99.0, "wake_round_trip_us_same_cpu": 7.0}
    ffnn_new = [dict(r, result=dict(r["result"], samples_per_sec=r["result"]["samples_per_sec"] * 2)) for r in ffnn_old]
    merged = merge_models(runs_file, {**doc, "machine": probe, "runs": ffnn_new, "path_cpu": {"status": "skipped", "reason": "not part"}})
    assert [r for r in merged["runs"] if r["mlp"] == "ffnn"] == ffnn_new  # replaced, not appended
    assert [r for r in merged["runs"] if r["mlp"] == "mlp400"] == [r for r in doc["runs"] if r["mlp"] == "mlp400"]
    assert merged["path_cpu"]["reason"] == "the full run's" and merged["machine"] == doc["machine"]
    assert set(merged["groups_updated"]) == {"ffnn"} and merged["groups_updated"]["ffnn"]["machine"] == probe

    write_report(merged, docs_dir=tmp_path / "docs", results_dir=tmp_path / "results")
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    ffnn = md[md.index("### FFNN"):]
    assert "from a later run of this group alone" in ffnn[:600] and "across CPUs 99 µs" in ffnn[:600]
    mlp = md[md.index("### MLP 400-400-400"):md.index("### FFNN")]
    assert "later run" not in mlp
