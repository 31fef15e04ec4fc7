"""Pure aggregation of benchmark runs: medians, AUC means over seeds, gaps, ratios, targets."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from bench.spec import DEFAULT_HYBRID_STALENESS, persia_label

BASELINE = "torch"  # the system; its fastest thread count (median samples/s) is the baseline


def hybrid_label(staleness: int = DEFAULT_HYBRID_STALENESS, nn_threads: int | None = None) -> str:
    """The headline hybrid configuration: one PS, one embedding worker, this staleness bound."""
    return persia_label("persia-hybrid", staleness, nn_threads=nn_threads)


def sync_label(nn_threads: int | None = None) -> str:
    """The synchronous reference the headline hybrid configuration is compared with."""
    return persia_label("persia-sync", 1, nn_threads=nn_threads)


def colocated_label(label: str) -> str:
    """The same configuration with each PS replica inside its embedding worker (``--colocate-ps``)."""
    head, sep, tail = label.partition(" nn-threads=")
    return f"{head} colocated{sep}{tail}"


HYBRID = hybrid_label()
SYNC = sync_label()
NOT_MEASURED = "not yet measured"

TARGETS = {
    "ratio_mlp400": (">=", 0.6, "hybrid / baseline samples/s, MLP 400-400-400, batch 256"),
    "ratio_mlp400_b1024": (">=", 0.8, "hybrid / baseline samples/s, MLP 400-400-400, batch 1024"),
    "ratio_ffnn": (">=", 0.97, "hybrid / baseline samples/s, FFNN 4096-2048-1024-512-256"),
    "abs_auc_gap_hybrid_sync": ("<=", 0.001, "|AUC(default hybrid) - AUC(sync)|, mean over seeds, MLP 400, 1,563 steps"),
    "abs_auc_gap_30steps": ("<=", 0.001, "|AUC(default hybrid) - AUC(sync)|, mean over seeds, MLP 400, 30 steps"),
    "latency_hybrid_keep_2ms": (">=", 0.9, "hybrid samples/s at 2 ms one-way delay / at 0 ms"),
    "latency_hybrid_over_sync_2ms": (">=", 1.8, "hybrid / sync samples/s at 2 ms one-way delay"),
    "abs_latency_auc_gap_2ms": ("<=", 0.001, "|AUC(hybrid) - AUC(sync)| at 2 ms one-way delay"),
    "adult_auc": (">=", 0.90, "adult-income test AUC (PERSIA published 0.8928)"),
    "embedding_path_us_per_sample": ("<=", 20.0, "CPU µs per training sample of data loader + embedding worker + PS + NATS"),
}
LATENCY_TORCH = "latency_torch"  # the group of the latency benchmark's (undelayed) torch runs
PERSIA_ADULT_AUC = 0.8928


def _ok(run: dict[str, Any]) -> bool:
    return run.get("status") == "ok" and isinstance(run.get("result"), dict)


def _run_memory(run: dict[str, Any]) -> dict[str, float]:
    """Peak MB per role: the sampler's per-process maxima, or the trainer's own ru_maxrss figure
    when it reported one (exact where sampling could miss the last moments)."""
    out = {role: float(v["max_mb"]) for role, v in (run.get("memory") or {}).items() if role != "other"}
    for role, mb in ((run.get("result") or {}).get("peak_rss_mb") or {}).items():
        if mb is not None:
            out[role] = max(out.get(role, 0.0), float(mb))
    return out


def _run_cpu(run: dict[str, Any]) -> dict[str, float]:
    """CPU seconds per role of one run (start-up and evaluation included)."""
    return {role: float(v["cpu_s"]) for role, v in (run.get("memory") or {}).items() if role != "other" and "cpu_s" in v}


def _most_common(values: list[Any]) -> Any:
    """The value most of ``values`` have (the first seen of a tie), None for none (pure)."""
    counts = Counter(v for v in values if v is not None)
    return max(counts, key=counts.__getitem__) if counts else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (mlp, label) in first-seen order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["mlp"], run["label"]), []).append(run)
    out = []
    for (mlp, label), group in groups.items():
        ok = [r for r in group if _ok(r)]
        sps = [r["result"]["samples_per_sec"] for r in ok if r["result"].get("samples_per_sec")]
        auc_by_seed = {r["seed"]: r["result"]["auc"] for r in ok if r["result"].get("auc") is not None}
        aucs = list(auc_by_seed.values())
        memory: dict[str, float] = {}
        for r in ok:
            for role, mb in _run_memory(r).items():
                memory[role] = max(memory.get(role, 0.0), mb)
        train_s = [r["result"]["train_seconds"] for r in ok if r["result"].get("train_seconds")]
        cpu_runs = [_run_cpu(r) for r in ok]
        cpu = {role: statistics.median([c[role] for c in cpu_runs if role in c]) for role in sorted({k for c in cpu_runs for k in c})}
        reasons = sorted({r.get("reason", "") for r in group if not _ok(r) and r.get("reason")})
        out.append(
            {
                "mlp": mlp,
                "label": label,
                "system": group[0]["spec"]["system"] if group[0].get("spec") else label,
                "spec": group[0].get("spec") or {},
                "runs": len(group),
                "ok_runs": len(ok),
                "sps_median": statistics.median(sps) if sps else None,
                "sps_min": min(sps) if sps else None,
                "sps_max": max(sps) if sps else None,
                "sps_all": sps,
                "auc_by_seed": auc_by_seed,
                "auc_mean": statistics.fmean(aucs) if aucs else None,
                "auc_std": statistics.stdev(aucs) if len(aucs) > 1 else None,
                "wall_median": statistics.median([r["wall_seconds"] for r in ok]) if ok else None,
                "max_load": max(
                    (r[k] for r in ok for k in ("loadavg_start", "loadavg_end") if r.get(k) is not None), default=None
                ),
                "train_samples": ok[0]["result"].get("train_samples") if ok else None,
                # the torch threads most of its runs trained on (the tuner's choice can differ per run)
                "threads": _most_common([r["result"].get("threads") for r in ok]),
                "curve": mean_curve([r["result"].get("auc_curve") or [] for r in ok]),
                "memory_mb": memory,
                "cpu_s": cpu,
                "train_seconds_median": statistics.median(train_s) if train_s else None,
                "reasons": reasons,
            }
        )
    return out


def mean_curve(curves: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Point-wise mean of AUC curves (point k of every run), over the runs that have point k."""
    if not curves:
        return []
    out = []
    for k in range(max(len(c) for c in curves)):
        pts = [c[k] for c in curves if len(c) > k and c[k].get("auc") is not None]
        if pts:
            out.append(
                {
                    "samples": statistics.fmean(p["samples"] for p in pts),
                    "auc": statistics.fmean(p["auc"] for p in pts),
                }
            )
    return out


def find(summary: list[dict[str, Any]], mlp: str, label: str) -> dict[str, Any] | None:
    return next((s for s in summary if s["mlp"] == mlp and s["label"] == label), None)


def baseline(summary: list[dict[str, Any]], mlp: str) -> dict[str, Any] | None:
    """The single-process torch configuration with the highest median throughput for ``mlp``
    (the strongest baseline this machine gave); the first one if none has a figure."""
    cands = [s for s in summary if s["mlp"] == mlp and s["system"] == BASELINE]
    measured = [s for s in cands if s["sps_median"]]
    if measured:
        return max(measured, key=lambda s: s["sps_median"])
    return cands[0] if cands else None


def reference_baseline(summary: list[dict[str, Any]], mlp: str) -> dict[str, Any] | None:
    """The AUC reference: the fastest torch configuration with the PS's optimizer formula."""
    cands = [s for s in summary if s["mlp"] == mlp and s["system"] == BASELINE and not (s.get("spec") or {}).get("fused")]
    measured = [s for s in cands if s["sps_median"]]
    return max(measured, key=lambda s: s["sps_median"]) if measured else (cands[0] if cands else None)


def latency_groups(summary: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """(delay ms, group) of the latency benchmark's delayed groups, by delay."""
    out = {}
    for s in summary:
        m = s["mlp"]
        if m.startswith("latency_") and m.endswith("ms"):
            out[float(m[len("latency_"):-2])] = m
    return sorted(out.items())


def latency_rows(summary: list[dict[str, Any]], hybrid: str, sync: str) -> list[dict[str, Any]]:
    """Per delay and configuration: median samples/s, its ratio to the same configuration at 0 ms,
    AUC, and (hybrid rows) hybrid/sync and the seed-paired AUC gap to sync at that delay."""
    groups = latency_groups(summary)
    zero = dict(groups).get(0.0)
    torch_runs = [s for s in summary if s["mlp"] == LATENCY_TORCH]
    rows = []
    for delay, group in groups:
        members = [s for s in summary if s["mlp"] == group]
        sync_entry = next((s for s in members if s["label"] == sync), None)
        for s in torch_runs + members:
            own0 = s if s["mlp"] == LATENCY_TORCH else (find(summary, zero, s["label"]) if zero else None)
            rows.append({
                "delay_ms": delay, "label": s["label"], "system": s["system"], "sps": s["sps_median"],
                "keep": ratio(s, own0), "auc": s["auc_mean"], "headline": s["label"] == hybrid,
                "over_sync": ratio(s, sync_entry) if s["system"] == "persia-hybrid" else None,
                "auc_gap": paired_gap(s, sync_entry) if s["system"] == "persia-hybrid" else None,
                "proxy_cpu_s": (s.get("cpu_s") or {}).get("delay-proxy"), "max_load": s.get("max_load"),
            })  # fmt: skip
    return rows


def paired_gap(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """Mean over the seeds both have of AUC(a) - AUC(b)."""
    if not a or not b:
        return None
    seeds = sorted(set(a["auc_by_seed"]) & set(b["auc_by_seed"]))
    if not seeds:
        return None
    return statistics.fmean(a["auc_by_seed"][s] - b["auc_by_seed"][s] for s in seeds)


def ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> float | None:
    if not num or not den or not num["sps_median"] or not den["sps_median"]:
        return None
    return num["sps_median"] / den["sps_median"]


def _missing(deps: list[tuple[str, dict[str, Any] | None, str]]) -> str:
    """Why a figure is null: the first configuration it needs that has no value for ``field``."""
    for what, entry, field in deps:
        if entry is None:
            return f"{NOT_MEASURED}: no {what} run in this profile"
        if entry[field] is None:
            if entry["reasons"]:
                reason = entry["reasons"][0]
                return reason if reason.startswith(NOT_MEASURED) else f"{what}: {reason}"
            return f"{NOT_MEASURED}: {what} gave no {field}"
    return f"{NOT_MEASURED}"


def headline(
    summary: list[dict[str, Any]], adult: dict[str, Any] | None, hybrid: str = HYBRID, sync: str = SYNC,
    default: str | None = None, path_cpu: dict[str, Any] | None = None,
    path_cpu_colocated: dict[str, Any] | None = None, path_cpu_targets: dict[str, dict[str, Any]] | None = None,
    cores: int | None = None, dense_step: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The figures for bench/results/e2e.json; every null has its reason under ``notes``.
    ``path_cpu``: bench/path_cpu.py's measurement (``embedding_path_us_per_sample``); with
    ``path_cpu_targets`` (the same for the other throughput targets, by target key) and ``cores``,
    also ``cpu_bound``: what the cores allow each throughput target at the measured CPU per sample.
    ``hybrid`` / ``sync`` label the headline hybrid configuration and its synchronous reference;
    ``default`` (None: ``hybrid``) the setting a PERSIA user gets, whose AUC gap the targets bound
    (``auc_gap_hybrid_sync``, ``auc_gap_30steps``). ``dense_step`` (bench/dense_step.py's
    ``measure_for_bound`` by target key) adds ``dense_bound``: what the dense step alone allows each
    throughput target."""
    default = default or hybrid
    get = {
        (mlp, name): find(summary, mlp, label)
        for mlp in ("mlp400", "ffnn")
        for name, label in (("hybrid", hybrid), ("sync", sync))
    }
    for mlp in ("mlp400", "ffnn"):
        get[mlp, "baseline"] = baseline(summary, mlp)
        get[mlp, "torchrec"] = next((s for s in summary if s["mlp"] == mlp and s["system"] == "torchrec"), None)
    b4, h4, s4 = get["mlp400", "baseline"], get["mlp400", "hybrid"], get["mlp400", "sync"]
    c4 = find(summary, "mlp400", colocated_label(hybrid))
    r4 = reference_baseline(summary, "mlp400")
    bK, hK = baseline(summary, "mlp400_b1024"), find(summary, "mlp400_b1024", hybrid)
    d4, h30, s30 = find(summary, "mlp400", default), find(summary, "mlp400_30steps", default), find(summary, "mlp400_30steps", sync)
    lat = dict(latency_groups(summary))
    hL0, hL2, sL2 = (find(summary, lat[d], lbl) if d in lat else None for d, lbl in ((0.0, hybrid), (2.0, hybrid), (2.0, sync)))
    bF, hF, t4 = get["ffnn", "baseline"], get["ffnn", "hybrid"], get["mlp400", "torchrec"]
    sps, auc = "sps_median", "auc_mean"
    adult = adult or {}
    figures: dict[str, tuple[Any, list[tuple[str, dict[str, Any] | None, str]]]] = {
        "ratio_mlp400": (ratio(h4, b4), [(hybrid, h4, sps), (BASELINE, b4, sps)]),
        "ratio_mlp400_colocated": (ratio(c4, b4), [(colocated_label(hybrid), c4, sps), (BASELINE, b4, sps)]),
        "ratio_mlp400_b1024": (ratio(hK, bK), [(f"batch 1024 {hybrid}", hK, sps), (f"batch 1024 {BASELINE}", bK, sps)]),
        "ratio_ffnn": (ratio(hF, bF), [(f"ffnn {hybrid}", hF, sps), (f"ffnn {BASELINE}", bF, sps)]),
        "auc_gap_hybrid_sync": (paired_gap(d4, s4), [(default, d4, auc), (sync, s4, auc)]),
        "auc_gap_30steps": (paired_gap(h30, s30), [(f"30 steps {default}", h30, auc), (f"30 steps {sync}", s30, auc)]),
        "latency_hybrid_keep_2ms": (ratio(hL2, hL0), [(f"2 ms {hybrid}", hL2, sps), (f"0 ms {hybrid}", hL0, sps)]),
        "latency_hybrid_over_sync_2ms": (ratio(hL2, sL2), [(f"2 ms {hybrid}", hL2, sps), (f"2 ms {sync}", sL2, sps)]),
        "latency_auc_gap_2ms": (paired_gap(hL2, sL2), [(f"2 ms {hybrid}", hL2, auc), (f"2 ms {sync}", sL2, auc)]),
        "adult_auc": ((adult.get("result") or {}).get("auc") if adult.get("status") == "ok" else None, []),
        "baseline_sps_mlp400": (b4[sps] if b4 else None, [(BASELINE, b4, sps)]),
        "hybrid_sps_mlp400": (h4[sps] if h4 else None, [(hybrid, h4, sps)]),
        "auc_gap_baseline_sync": (paired_gap(r4, s4), [(BASELINE, r4, auc), (sync, s4, auc)]),
        "baseline_sps_mlp400_b1024": (bK[sps] if bK else None, [(f"batch 1024 {BASELINE}", bK, sps)]),
        "hybrid_sps_mlp400_b1024": (hK[sps] if hK else None, [(f"batch 1024 {hybrid}", hK, sps)]),
        "baseline_sps_ffnn": (bF[sps] if bF else None, [(f"ffnn {BASELINE}", bF, sps)]),
        "hybrid_sps_ffnn": (hF[sps] if hF else None, [(f"ffnn {hybrid}", hF, sps)]),
        "torchrec_sps_mlp400": (t4[sps] if t4 else None, [("torchrec", t4, sps)]),
        "baseline_auc_mlp400": (r4[auc] if r4 else None, [(BASELINE, r4, auc)]),
        "hybrid_auc_mlp400": (h4[auc] if h4 else None, [(hybrid, h4, auc)]),
        "sync_auc_mlp400": (s4[auc] if s4 else None, [(sync, s4, auc)]),
    }
    h: dict[str, Any] = {key: value for key, (value, _) in figures.items()}
    h["hybrid_configuration"] = hybrid
    h["default_configuration"] = default
    h["sync_configuration"] = sync
    h["baseline_mlp400"] = b4["label"] if b4 else None
    h["baseline_ffnn"] = bF["label"] if bF else None
    h["baseline_mlp400_b1024"] = bK["label"] if bK else None
    notes: dict[str, str] = {}
    for key, (value, deps) in figures.items():
        if value is None:
            if key == "adult_auc":
                notes[key] = adult.get("reason") or f"{NOT_MEASURED}: adult-income did not run"
            else:
                notes[key] = _missing(deps)
    path_cpu = path_cpu or {"status": "skipped", "reason": f"{NOT_MEASURED}: no path CPU measurement"}
    per_role = path_cpu.get("median_us_per_sample") if path_cpu.get("status") == "ok" else None
    h["embedding_path_us_per_sample"] = per_role.get("embedding_path") if per_role else None
    h["embedding_path_configuration"] = path_cpu.get("configuration")
    if per_role is None:
        notes["embedding_path_us_per_sample"] = path_cpu.get("reason") or NOT_MEASURED
    if path_cpu_colocated is not None and path_cpu_colocated.get("status") == "ok":  # --colocate-ps
        h["embedding_path_us_per_sample_colocated"] = path_cpu_colocated["median_us_per_sample"].get("embedding_path")
    others = path_cpu_targets or {}
    h["cpu_bound"] = cpu_bounds(cores, {"ratio_mlp400": (path_cpu, b4, h4),
                                        "ratio_mlp400_b1024": (others.get("ratio_mlp400_b1024"), bK, hK),
                                        "ratio_ffnn": (others.get("ratio_ffnn"), bF, hF)})
    h["dense_bound"] = dense_bounds(cores, dense_step or {}, {
        "ratio_mlp400": (path_cpu, b4, h4), "ratio_mlp400_b1024": (others.get("ratio_mlp400_b1024"), bK, hK),
        "ratio_ffnn": (others.get("ratio_ffnn"), bF, hF)})
    h["targets"] = check_targets(h)
    h["notes"] = notes
    return h


def dense_bound(batch_size: int, baseline_sps: float, target_ratio: float, dense: dict[str, dict[str, float]],
                cores: int | None = None, all_roles_us: float | None = None, trained_threads: int | None = None,
                measured_sps: float | None = None) -> dict[str, Any]:
    """What the NN worker's dense step allows a throughput target, per thread count (pure).

    A training step cannot take less than its dense step alone (``dense``: bench/dense_step.py's
    ``ms_per_step`` and ``cpu_per_wall`` by thread count), so at ``n`` threads samples/s is at
    most ``batch_size`` per that time. With the run's CPU per sample (``all_roles_us``, measured
    while it trained on ``trained_threads``) the step also cannot take less than the CPU it needs
    spread over ``cores``: the dense step's own CPU at ``n`` threads plus everything else (all roles'
    CPU less the dense step's at ``trained_threads``; assumed not to change with the count). The
    larger of the two is the step's least time; ``ratio_bound`` is the baseline's step time over
    it, and ``best`` the count that allows most.
    """
    if batch_size <= 0 or baseline_sps <= 0 or not dense:
        raise ValueError(f"batch_size and baseline_sps must be positive and dense measured, got "
                         f"{batch_size}, {baseline_sps}, {sorted(dense)}")
    baseline_ms = batch_size * 1e3 / baseline_sps
    trained = dense.get(str(trained_threads)) if trained_threads is not None else None
    rest_ms = None
    if all_roles_us is not None and all_roles_us > 0 and trained is not None and cores:
        rest_ms = max(0.0, all_roles_us * batch_size / 1e3 - trained["ms_per_step"] * trained["cpu_per_wall"])
    counts = {}
    for n, d in sorted(dense.items(), key=lambda kv: int(kv[0])):
        wall, cpu = d["ms_per_step"], d["ms_per_step"] * d["cpu_per_wall"]
        cpu_ms = (cpu + rest_ms) / cores if rest_ms is not None else None
        step = max(wall, cpu_ms) if cpu_ms is not None else wall
        counts[n] = {"dense_ms": wall, "dense_cpu_ms": cpu, "cpu_bound_ms": cpu_ms, "step_bound_ms": step,
                     "limited_by": "CPU" if cpu_ms is not None and cpu_ms > wall else "dense step",
                     "ratio_bound": baseline_ms / step}
    best = max(counts, key=lambda n: counts[n]["ratio_bound"])
    return {"batch_size": batch_size, "baseline_sps": baseline_sps, "baseline_ms": baseline_ms,
            "target_ratio": target_ratio, "rest_ms": rest_ms, "trained_threads": trained_threads,
            "threads": counts, "best": best, "ratio_bound": counts[best]["ratio_bound"],
            "measured_ratio": measured_sps / baseline_sps if measured_sps else None}


def dense_bounds(cores: int | None, dense_step: dict[str, dict[str, Any]],
                 measured: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]],
                 ) -> dict[str, dict[str, Any]]:
    """``dense_bound`` per throughput target key with a dense-step measurement, from (path CPU
    measurement, baseline summary row, our summary row); ``{"missing": why}`` where one is lacking."""
    out: dict[str, dict[str, Any]] = {}
    for key, d in dense_step.items():
        pc, base, ours = measured.get(key, (None, None, None))
        if d.get("status") != "ok":
            out[key] = {"missing": d.get("reason") or "dense step not measured"}
        elif not base or not base.get("sps_median"):
            out[key] = {"missing": "no baseline run"}
        else:
            per_role = pc.get("median_us_per_sample") if pc and pc.get("status") == "ok" else None
            all_roles = per_role.get("all_roles") if per_role else None
            out[key] = {"mlp": d.get("mlp"), **dense_bound(
                d["batch_size"], base["sps_median"], TARGETS[key][1], d["threads"], cores,
                all_roles if all_roles and all_roles > 0 else None, (ours or {}).get("threads"),
                (ours or {}).get("sps_median"))}
    return out


def cpu_bound(cores: int, all_roles_us: float, baseline_sps: float, target_ratio: float,
              measured_sps: float | None = None) -> dict[str, Any]:
    """What the machine allows at the measured CPU cost, whatever the scheduling: with every role on
    ``cores`` cores, samples/s can be at most ``cores / CPU seconds per sample`` (all roles, marginal).
    A target whose ``bound_ratio`` is below it needs less CPU per sample (``needed_us_per_sample``),
    not better scheduling; ``packing`` is how much of the bound the measured run reached. Pure."""
    if cores <= 0 or all_roles_us <= 0 or baseline_sps <= 0 or target_ratio <= 0:
        raise ValueError(f"cores, all_roles_us, baseline_sps and target_ratio must be positive, got "
                         f"{cores}, {all_roles_us}, {baseline_sps}, {target_ratio}")
    bound_sps = cores * 1e6 / all_roles_us
    return {
        "cpu_us_per_sample": all_roles_us,
        "baseline_sps": baseline_sps,
        "bound_sps": bound_sps,
        "bound_ratio": bound_sps / baseline_sps,
        "target_ratio": target_ratio,
        "needed_us_per_sample": cores * 1e6 / (target_ratio * baseline_sps),
        "measured_ratio": measured_sps / baseline_sps if measured_sps else None,
        "packing": measured_sps / bound_sps if measured_sps else None,
    }


def cpu_bounds(cores: int | None, measured: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None,
                                                            dict[str, Any] | None]]) -> dict[str, dict[str, Any]]:
    """``cpu_bound`` per throughput target key, from (path CPU measurement, baseline summary row,
    our summary row); a key whose inputs are missing has ``{"missing": why}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, (pc, base, ours) in measured.items():
        per_role = pc.get("median_us_per_sample") if pc and pc.get("status") == "ok" else None
        all_roles = per_role.get("all_roles") if per_role else None
        if not cores:
            out[key] = {"missing": "no CPU count"}
        elif all_roles is None:
            out[key] = {"missing": (pc or {}).get("reason") or "no path CPU measurement"}
        elif all_roles <= 0:  # start-up noise larger than the rows' CPU (the smoke profile's few rows)
            out[key] = {"missing": f"marginal CPU per sample not positive ({all_roles:.1f} µs): too few rows"}
        elif not base or not base.get("sps_median"):
            out[key] = {"missing": "no baseline run"}
        else:
            out[key] = {"configuration": pc.get("configuration"), "mlp": pc.get("mlp"),
                        "batch_size": pc.get("batch_size"),
                        **cpu_bound(cores, all_roles, base["sps_median"], TARGETS[key][1],
                                    ours.get("sps_median") if ours else None)}
    return out


def check_targets(h: dict[str, Any]) -> dict[str, dict[str, Any]]:
    values = dict(h)
    for key in ("auc_gap_hybrid_sync", "auc_gap_30steps", "latency_auc_gap_2ms"):
        gap = h.get(key)
        values["abs_" + key] = abs(gap) if gap is not None else None
    out = {}
    for key, (op, bound, what) in TARGETS.items():
        v = values.get(key)
        passed = None if v is None else (v >= bound if op == ">=" else v <= bound)
        out[key] = {"what": what, "target": f"{op} {bound}", "value": v, "passed": passed}
    return out
