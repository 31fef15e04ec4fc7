"""docs/metrics.md is the contract: the Grafana dashboard queries only metrics listed there, and
every metric listed there is served by the code: test_online.py scrapes every role of a real job
(`persia-launcher local`: PS, embedding worker, NN worker, data loader; plus the serving processes)
with :func:`assert_catalogued_metrics_served`; counters and histograms must be non-zero. Metrics
that exist only once their event happened ("on event") are looked up in the source instead."""

from __future__ import annotations

import json
import re
from pathlib import Path

from persia.serving.metrics import METRIC_NAMES as SERVING_METRICS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "persia-operator" / "dashboards" / "persia-job.json"
_ROW = re.compile(r"^\| `(persia_[a-z0-9_]+)` \| ([a-z ,]+) \| ([a-z_ ]+) \|")


def catalog() -> dict[str, tuple[str, str, bool]]:
    """metric -> (type, role, on_event) from docs/metrics.md's table."""
    out = {}
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        m = _ROW.match(line)
        if m:
            kind, role = m.group(2), m.group(3).strip()
            out[m.group(1)] = (kind.split(",")[0].strip(), role, "on event" in kind)
    return out


def dashboard_exprs(node) -> list[str]:
    """The PromQL of a dashboard (part): every ``expr`` and variable ``query``."""
    if isinstance(node, list):
        return [e for v in node for e in dashboard_exprs(v)]
    if not isinstance(node, dict):
        return []
    own = [node[k] for k in ("expr", "query") if isinstance(node.get(k), str)]
    return own + [e for v in node.values() for e in dashboard_exprs(v)]


def dashboard_metrics() -> set[str]:
    # metric names only: not the label names of selectors ({persia_job=~...}) or of label_values()
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    names = (re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", re.sub(r"\{[^}]*\}", "", e)) for e in exprs)
    return {name for e in names for name in re.findall(r"\bpersia_[a-z0-9_]+", e)}


def base_name(name: str, cat: dict) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in cat:
            return name[: -len(suffix)]
    return name


def test_the_dashboard_queries_only_catalogued_metrics():
    cat = catalog()
    assert len(cat) > 25
    used = {base_name(n, cat) for n in dashboard_metrics()}
    assert used - set(cat) == set(), "dashboard queries metrics missing from docs/metrics.md"
    assert len(used) >= 25  # it draws nearly everything, not one panel


ROLES = {"embedding_parameter_server", "embedding_worker", "nn_worker", "data_loader", "model server"}


def test_every_role_has_metrics_that_a_real_run_must_serve():
    """Each role's /metrics is scraped by test_online.py: a role with only "on event" metrics
    would pass that scrape without being checked at all."""
    cat = catalog()
    assert {role for _, role, _ in cat.values()} == ROLES
    for role in ROLES:
        assert any(r == role and not on_event for _, r, on_event in cat.values()), role


def test_the_dashboard_selects_jobs_by_the_label_scraping_keeps():
    """Prometheus overwrites a target's ``job`` label with its scrape job's name: the dashboard
    tells PERSIA jobs apart by ``persia_job`` (persia.metrics.JOB_LABEL) in every query."""
    board = json.loads(DASHBOARD.read_text())
    [var] = [v for v in board["templating"]["list"] if v["type"] == "query"]
    assert var["name"] == "persia_job" and var["query"] == "label_values(persia_rows, persia_job)"
    exprs = dashboard_exprs(board["panels"])
    selectors = [m for e in exprs for m in re.findall(r"\bpersia_[a-z0-9_]+(\{[^}]*\})?", e)]
    assert len(selectors) >= 25 and all(sel == '{persia_job=~"$persia_job"}' for sel in selectors), selectors


def test_serving_and_on_event_metrics_exist_in_the_code():
    cat = catalog()
    serving = {n for n, (_, role, _) in cat.items() if role == "model server"}
    assert serving <= set(SERVING_METRICS)
    source = "\n".join(p.read_text() for p in (ROOT / "runtime" / "persia").rglob("*.py"))
    for name, (_, _, on_event) in cat.items():
        if on_event:
            assert f'"{name.removeprefix("persia_")}"' in source, f"{name} is not in the runtime's source"


def sample(text: str, name: str | None = None, **labels: str) -> float | None:
    """The value of the first sample in a /metrics text named ``name`` (None: any) whose labels
    include ``labels``, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (name is None or s.name == name) and labels.items() <= s.labels.items():
                return s.value
    return None


def _samples(text: str) -> dict[str, float]:
    """metric name -> the largest value among its series."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
        value = float(line.rsplit(" ", 1)[1])
        out[name] = max(out.get(name, value), value)
    return out


def assert_catalogued_metrics_served(scrapes: list[str]) -> None:
    """Every catalogued role metric (not "on event") is in one of the ``/metrics`` texts, counters
    and histograms non-zero. Called by test_online.py on its real job (every role a process)."""
    samples: dict[str, float] = {}
    for text in scrapes:
        for name, value in _samples(text).items():
            samples[name] = max(samples.get(name, value), value)
    missing, zero = [], []
    for name, (kind, role, on_event) in catalog().items():
        if on_event or role == "model server":
            continue
        key = f"{name}_count" if kind == "histogram" else name
        if key not in samples:
            missing.append(name)
        elif kind in ("histogram", "counter") and samples[key] <= 0:
            zero.append(name)
    assert not missing, f"not served by any role: {missing}\n" + "\n".join(scrapes)[-3000:]
    assert not zero, f"still zero after the run: {zero}"
