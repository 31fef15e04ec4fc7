"""Per-role metrics: in-process counters, exported to Prometheus when metrics are enabled.

Counters always exist (tests and logs read them); the HTTP exporter starts only when
``PERSIA_METRICS_PORT`` is set or ``metrics_config.enable_metrics`` is true, so a local run does not
spam warnings the way PERSIA's push-gateway client did.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict

log = logging.getLogger(__name__)

_exporter_started = False
_exporter_lock = threading.Lock()


def start_exporter(port: int | None = None) -> int | None:
    """Serve ``/metrics`` for this process (idempotent); returns the port or None."""
    global _exporter_started
    if port is None:
        raw = os.environ.get("PERSIA_METRICS_PORT")
        if not raw:
            return None
        port = int(raw) + int(os.environ.get("LOCAL_RANK", "0") or 0)
    with _exporter_lock:
        if _exporter_started:
            return port
        try:
            from prometheus_client import start_http_server

            start_http_server(port)
            _exporter_started = True
            log.info("metrics on :%d/metrics", port)
        except OSError as exc:
            log.warning("cannot serve metrics on port %d: %s", port, exc)
            return None
    return port


def register_stats(role: str, replica: int, stats) -> None:
    """Serve ``stats()`` (a dict of numbers, e.g. the PS store's counters) as gauges at scrape time."""
    from prometheus_client.core import REGISTRY, GaugeMetricFamily

    class _Collector:
        def collect(self):
            for name, value in stats().items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                family = GaugeMetricFamily(f"persia_{name}", name, labels=["role", "replica"])
                family.add_metric([role, str(replica)], float(value))
                yield family

    REGISTRY.register(_Collector())


class Metrics:
    """Counters/gauges/timings keyed by name and optional ``feat`` label."""

    def __init__(self, role: str, replica: int):
        self.role = role
        self.replica = replica
        self._lock = threading.Lock()
        self.values: dict[tuple[str, str], float] = defaultdict(float)
        self._prom: dict[str, object] = {}

    def _key(self, name: str, feat: str) -> tuple[str, str]:
        return (name, feat)

    def inc(self, name: str, value: float = 1.0, feat: str = "") -> None:
        with self._lock:
            self.values[self._key(name, feat)] += value
        self._export(name, feat, "inc", value)

    def dec(self, name: str, value: float = 1.0, feat: str = "") -> None:
        self.inc(name, -value, feat)

    def set(self, name: str, value: float, feat: str = "") -> None:
        with self._lock:
            self.values[self._key(name, feat)] = value
        self._export(name, feat, "set", value)

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self.values[(name + "_count", "")] += 1
            self.values[(name + "_sum", "")] += seconds
        self._export(name, "", "observe", seconds)

    def get(self, name: str, feat: str = "") -> float:
        with self._lock:
            return self.values.get(self._key(name, feat), 0.0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {(f"{n}{{feat={f}}}" if f else n): v for (n, f), v in self.values.items()}

    def _export(self, name: str, feat: str, op: str, value: float) -> None:
        if not _exporter_started:
            return
        from prometheus_client import Gauge, Summary

        metric = self._prom.get(name)
        if metric is None:
            labels = ["role", "replica"] + (["feat"] if feat else [])
            full = f"persia_{name}"
            metric = Summary(full, name, labels) if op == "observe" else Gauge(full, name, labels)
            self._prom[name] = metric
        lbl = {"role": self.role, "replica": str(self.replica)}
        if feat:
            lbl["feat"] = feat
        try:
            m = metric.labels(**lbl)
            if op == "observe":
                m.observe(value)
            elif op == "set":
                m.set(value)
            else:
                m.inc(value)
        except ValueError:  # label set mismatch: keep the in-process counter only
            pass
