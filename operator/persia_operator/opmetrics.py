"""The operator's own Prometheus metrics (served by `persia-operator run` on
PERSIA_OPERATOR_METRICS_PORT, 8081): reconcile counts, errors and latency, per-phase
job counts, restarts by reason, and which replica leads.

Module-level, registered once per process (several reconcilers in one test process
share them). charts/persia-operator/dashboards/persia-operator.json queries only these;
a test checks that.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PHASES = ("Pending", "Starting", "Running", "Restarting", "Suspended", "Succeeded", "Failed")

RECONCILES = Counter("persia_operator_reconcile", "Reconcile passes by result (ok, error).", ["result"])
RECONCILE_SECONDS = Histogram(
    "persia_operator_reconcile_duration_seconds",
    "Duration of one reconcile pass.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CHILD_ERRORS = Counter("persia_operator_child_errors", "API errors on children by kind and code.", ["kind", "code"])
JOBS = Gauge("persia_operator_jobs", "PersiaJobs seen by this operator, by phase.", ["phase"])
RESTARTS = Counter("persia_operator_job_restarts", "Whole-job restarts by reason.", ["reason"])
LEADER = Gauge("persia_operator_leader", "1 while this replica is the active one (holds the lease).")

EXPORTED = (
    "persia_operator_reconcile_total",
    "persia_operator_reconcile_duration_seconds_bucket",
    "persia_operator_reconcile_duration_seconds_sum",
    "persia_operator_reconcile_duration_seconds_count",
    "persia_operator_child_errors_total",
    "persia_operator_jobs",
    "persia_operator_job_restarts_total",
    "persia_operator_leader",
)


class PhaseCounts:
    """Phase of every job this operator reconciled; the JOBS gauge follows it."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}
        self._counts: dict[str, int] = {}
        for name in PHASES:  # every phase shown, at 0 until a job is in it
            JOBS.labels(phase=name).set(0)

    def keys(self) -> set[tuple[str, str]]:
        return set(self._phases)

    def set(self, key: tuple[str, str], phase: str | None) -> None:
        """The job's phase now (None: gone); only the two phases it moved between are counted
        again (recounting every job at every pass was quadratic in the jobs per round)."""
        old = self._phases.pop(key, None) if phase is None else self._phases.get(key)
        if phase is not None:
            self._phases[key] = phase
        if old == phase:
            return
        for name, delta in ((old, -1), (phase, +1)):
            if name is not None:
                self._counts[name] = self._counts.get(name, 0) + delta
                JOBS.labels(phase=name).set(self._counts[name])
