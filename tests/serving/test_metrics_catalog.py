"""docs/metrics.md is the contract: the Grafana dashboard queries only metrics listed there, and
every metric listed there is served by the code: test_online.py scrapes every role of a real job
(`persia-launcher local` plus the serving processes) with :func:`assert_catalogued_metrics_served`;
counters and histograms must be non-zero. Metrics that exist only once their event happened
("on event") are looked up in the source instead."""

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


def dashboard_metrics() -> set[str]:
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            if isinstance(node.get("query"), str):
                exprs.append(node["query"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(DASHBOARD.read_text()))
    return {name for e in exprs for name in re.findall(r"\bpersia_[a-z0-9_]+", e)}


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


def test_serving_and_on_event_metrics_exist_in_the_code():
    cat = catalog()
    serving = {n for n, (_, role, _) in cat.items() if role == "model server"}
    assert serving <= set(SERVING_METRICS)
    source = "\n".join(p.read_text() for p in (ROOT / "runtime" / "persia").rglob("*.py"))
    for name, (_, _, on_event) in cat.items():
        if on_event:
            assert f'"{name.removeprefix("persia_")}"' in source, f"{name} is not in the runtime's source"


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
