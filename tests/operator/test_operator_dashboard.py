"""The operator's Grafana dashboard queries only metrics the operator exports, and shows
every one of them."""

from __future__ import annotations

import json
import re

from operator_testkit import REPO
from prometheus_client import REGISTRY, generate_latest

from persia_operator import opmetrics

DASHBOARD = REPO / "charts" / "persia-operator" / "dashboards" / "persia-operator.json"


def queried_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in board["templating"]["list"] if v.get("type") == "query"]
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b(persia_[a-z0-9_]+)\b", expr))
    return names


def exported_metrics() -> set[str]:
    """Sample names the code really serves (not a hand-written list)."""
    opmetrics.RECONCILES.labels(result="ok")
    opmetrics.CHILD_ERRORS.labels(kind="Job", code="500")
    opmetrics.RESTARTS.labels(reason="PSReplaced")
    opmetrics.PhaseCounts().set(("ns", "job"), "Running")
    text = generate_latest(REGISTRY).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line.startswith("persia_operator_")}  # fmt: skip


def test_every_queried_metric_is_exported():
    exported = exported_metrics()
    assert set(opmetrics.EXPORTED) <= exported
    assert queried_metrics() - exported == set()


def test_every_exported_metric_is_on_the_dashboard():
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in exported_metrics()}
    queried = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in queried_metrics()}
    assert families - queried == set()


def test_dashboard_is_well_formed():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] == "persia-operator"
    for panel in board["panels"]:
        assert panel["targets"] and all(t["expr"].count("(") == t["expr"].count(")") for t in panel["targets"])


def test_the_jobs_gauge_counts_each_phase_as_jobs_move():
    counts = opmetrics.PhaseCounts()

    def gauge(phase: str) -> float:
        return REGISTRY.get_sample_value("persia_operator_jobs", {"phase": phase})

    for i in range(3):
        counts.set(("ns", f"j{i}"), "Running")
    counts.set(("ns", "j0"), "Succeeded")
    counts.set(("ns", "j1"), "Running")  # no change
    assert (gauge("Running"), gauge("Succeeded"), gauge("Failed")) == (2, 1, 0)
    counts.set(("ns", "j2"), None)  # deleted
    counts.set(("ns", "gone"), None)  # never seen
    assert (gauge("Running"), gauge("Succeeded")) == (1, 1) and counts.keys() == {("ns", "j0"), ("ns", "j1")}
