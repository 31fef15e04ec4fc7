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

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 300.0)

_exporter_started = False
_exporter_port: int | None = None
_exporter_lock = threading.Lock()


def metrics_port(env=None) -> int | None:
    """This process's metrics port: ``PERSIA_METRICS_PORT`` + ``PERSIA_METRICS_PORT_OFFSET`` (the
    local launcher gives each role its own) + ``LOCAL_RANK``; 0 lets the OS choose. None: off."""
    env = os.environ if env is None else env
    raw = env.get("PERSIA_METRICS_PORT")
    if not raw:
        return None
    base = int(raw)
    if base == 0:
        return 0
    return base + int(env.get("PERSIA_METRICS_PORT_OFFSET", "0") or 0) + int(env.get("LOCAL_RANK", "0") or 0)


def start_exporter(port: int | None = None) -> int | None:
    """Serve ``/metrics`` for this process on the bind address (idempotent); returns the port or
    None. A taken port falls back to one the OS chooses, logged, rather than serving nothing."""
    global _exporter_started, _exporter_port
    from persia.security import bind_address

    if port is None:
        port = metrics_port()
        if port is None:
            return None
    with _exporter_lock:
        if _exporter_started:
            return _exporter_port
        from prometheus_client import start_http_server

        addr = bind_address()
        try:
            server, _ = start_http_server(port, addr=addr)
        except OSError as exc:
            log.warning("metrics port %d on %s: %s; letting the OS choose one", port, addr, exc)
            try:
                server, _ = start_http_server(0, addr=addr)
            except OSError as exc2:
                log.warning("cannot serve metrics on %s: %s", addr, exc2)
                return None
        _exporter_started = True
        _exporter_port = int(server.server_port)
        log.info("metrics on %s:%d/metrics", addr, _exporter_port)
    return _exporter_port


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
        from prometheus_client import Gauge, Histogram

        metric = self._prom.get(name)
        if metric is None:
            labels = ["role", "replica"] + (["feat"] if feat else [])
            full = f"persia_{name}"
            # timings are histograms, so dashboards can take quantiles across replicas (docs/metrics.md)
            metric = (Histogram(full, name, labels, buckets=LATENCY_BUCKETS) if op == "observe"
                      else Gauge(full, name, labels))
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
