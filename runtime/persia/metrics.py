"""Per-role metrics: in-process counters, exported to Prometheus when metrics are enabled.

Counters always exist (tests and logs read them); the HTTP exporter starts only when
``PERSIA_METRICS_PORT`` is set or ``metrics_config.enable_metrics`` is true, so a local run does not
spam warnings the way PERSIA's push-gateway client did. Every series carries ``role``, ``replica``
and ``persia_job`` (:func:`job_label`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Mapping, MutableMapping

if TYPE_CHECKING:
    from persia.config import MetricsConfig

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 300.0)

# The label that tells jobs apart. Not ``job``: Prometheus overwrites a target's ``job`` label with
# its scrape job's name (unless honor_labels is set), so a ``job`` exported here would never show.
JOB_LABEL = "persia_job"
# metrics_config.job_name, passed by persia-launcher to the processes it starts (configure_from)
JOB_NAME_ENV = "PERSIA_METRICS_JOB_NAME"
DEFAULT_PORT = 9090  # enable_metrics without PERSIA_METRICS_PORT (the operator's port too)

_exporter_started = False
_exporter_port: int | None = None
_exporter_lock = threading.Lock()
# prometheus families by name, shared by every Metrics of the process: two contexts of one role
# (a DataCtx per epoch) or two roles in one process must not register a name twice
_families: dict[str, object] = {}
_families_lock = threading.Lock()


def job_label(env: Mapping[str, str] | None = None) -> str:
    """The ``persia_job`` label: ``PERSIA_JOB_NAME`` (the operator's job name, unique in its
    namespace, and local mode's ``--job-name``), else ``metrics_config.job_name`` (which
    persia-launcher passes as ``PERSIA_METRICS_JOB_NAME``), else that key's default."""
    env = os.environ if env is None else env
    name = env.get("PERSIA_JOB_NAME") or env.get(JOB_NAME_ENV)
    if name:
        return name
    from persia.config import MetricsConfig

    return MetricsConfig.model_fields["job_name"].default


def configure_from(metrics_config: MetricsConfig, env: MutableMapping[str, str] | None = None) -> None:
    """Pass ``metrics_config`` on to this process and the role processes it starts, through their
    environment (an NN worker's ranks and a data loader's script read no config file for it):
    ``enable_metrics`` sets ``PERSIA_METRICS_PORT`` (9090) and ``job_name`` ``PERSIA_METRICS_JOB_NAME``,
    each unless already set (the operator's and local mode's values win)."""
    env = os.environ if env is None else env
    if metrics_config.enable_metrics:
        env.setdefault("PERSIA_METRICS_PORT", str(DEFAULT_PORT))
    env.setdefault(JOB_NAME_ENV, metrics_config.job_name)


def metrics_port(env=None) -> int | None:
    """This process's metrics port: ``PERSIA_METRICS_PORT`` + ``PERSIA_METRICS_PORT_OFFSET`` (the
    local launcher gives each role its own) + ``LOCAL_RANK``; 0 lets the OS choose. None: off."""
    from persia.env import int_in_range

    env = os.environ if env is None else env
    raw = env.get("PERSIA_METRICS_PORT")
    if not raw:
        return None
    base = int_in_range("PERSIA_METRICS_PORT", raw, 0, 65535)
    if base == 0:
        return 0
    offset = int_in_range("PERSIA_METRICS_PORT_OFFSET", env.get("PERSIA_METRICS_PORT_OFFSET") or "0", 0, 65535)
    local_rank = int_in_range("LOCAL_RANK", env.get("LOCAL_RANK") or "0", 0, 65535)
    port = base + offset + local_rank
    if port > 65535:
        raise ValueError(f"metrics port PERSIA_METRICS_PORT {base} + PERSIA_METRICS_PORT_OFFSET {offset} + LOCAL_RANK "
                         f"{local_rank} = {port} is over 65535")
    return port


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
        from persia.metrics_server import serve_metrics

        addr = bind_address()
        try:
            server = serve_metrics(addr, port)
        except OSError as exc:
            log.warning("metrics port %d on %s: %s; letting the OS choose one", port, addr, exc)
            try:
                server = serve_metrics(addr, 0)
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

    job = job_label()

    class _Collector:
        def collect(self):
            for name, value in stats().items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                family = GaugeMetricFamily(f"persia_{name}", name, labels=["role", "replica", JOB_LABEL])
                family.add_metric([role, str(replica), job], float(value))
                yield family

    REGISTRY.register(_Collector())


class Metrics:
    """Counters/gauges/timings keyed by name and optional ``feat`` label."""

    def __init__(self, role: str, replica: int):
        self.role = role
        self.replica = replica
        self.job = job_label()
        self._lock = threading.Lock()
        self.values: dict[tuple[str, str], float] = defaultdict(float)

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
        metric = _family(name, op == "observe", bool(feat))
        lbl = {"role": self.role, "replica": str(self.replica), JOB_LABEL: self.job}
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


def _family(name: str, histogram: bool, with_feat: bool):
    """The process's prometheus metric ``persia_<name>``, made by its first use."""
    metric = _families.get(name)  # no lock once made: every export of every role comes here
    if metric is not None:
        return metric
    from prometheus_client import Gauge, Histogram

    with _families_lock:
        metric = _families.get(name)
        if metric is None:
            labels = ["role", "replica", JOB_LABEL] + (["feat"] if with_feat else [])
            full = f"persia_{name}"
            # timings are histograms, so dashboards can take quantiles across replicas (docs/metrics.md)
            metric = (Histogram(full, name, labels, buckets=LATENCY_BUCKETS) if histogram
                      else Gauge(full, name, labels))
            _families[name] = metric
        return metric
