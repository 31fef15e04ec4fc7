"""Options of the operator process (not of a job): scope, timeouts, intervals.

Defaults suit a cluster; tests shorten the interval. Every option can also come from
the environment (PERSIA_OPERATOR_<NAME>), which is how the Helm chart sets them.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field, field_validator, model_validator

# A leader steps down this fraction of the lease after its last renewal (as client-go:
# 10 s of 15 s); the remaining third covers the renewal call and clock skew.
RENEW_DEADLINE_FRACTION = 2 / 3


class OperatorConfig(BaseModel):
    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch; empty means cluster-wide."
    )
    reconcile_interval: float = Field(10.0, gt=0, description="Seconds between reconcile passes of a job.")
    nats_probe_interval: float = Field(
        10.0, gt=0, description="Seconds between probes of a job's NATS (reachability, last checkpoint)."
    )
    liveness: str | None = Field(
        "http://0.0.0.0:8080/healthz", description="Liveness endpoint URL (None: no endpoint)."
    )
    standalone: bool = Field(True, description="No kopf peering (run one replica, strategy Recreate).")
    priority: int = 0
    peering_name: str | None = None
    # Watch timeouts: without them a silently dropped watch freezes the operator (kopf#585).
    watch_server_timeout: float = 300
    watch_client_timeout: float = 330
    watch_connect_timeout: float = 30
    request_timeout: float = 60
    verbose: bool = False
    metrics_port: int | None = Field(8081, description="Port of /metrics (None: no endpoint).")
    leader_elect: bool = Field(False, description="Hold a Lease to be the one active replica.")
    lease_name: str = "persia-operator"
    lease_namespace: str | None = Field(None, description="Namespace of the Lease (default POD_NAMESPACE).")
    identity: str | None = Field(None, description="This replica's name in the Lease (default HOSTNAME).")
    lease_duration: float = Field(
        15.0, ge=1, description="Seconds a Lease lasts unrenewed (whole seconds on the Lease: at least 1)."
    )
    renew_period: float = Field(
        5.0, gt=0, description="Seconds between renewals; at most 2/3 of lease_duration."
    )
    retry_period: float = Field(
        2.0, gt=0, description="Seconds between a standby's tries to take the Lease, and a holder's renewal retries."
    )

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [n.strip() for n in value.split(",") if n.strip()]
        return value

    @model_validator(mode="after")
    def _lease_timings(self) -> "OperatorConfig":
        problem = lease_timing_problem(self.lease_duration, self.renew_period)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> "OperatorConfig":
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name in cls.model_fields:
            key = f"PERSIA_OPERATOR_{name.upper()}"
            if key in env:
                values[name] = env[key]
        if "WATCH_NAMESPACE" in env and "namespaces" not in values:
            values["namespaces"] = env["WATCH_NAMESPACE"]
        if values.get("liveness") == "":
            values["liveness"] = None
        if values.get("metrics_port") in ("", "0"):
            values["metrics_port"] = None
        for key, fallback in (("lease_namespace", "POD_NAMESPACE"), ("identity", "HOSTNAME")):
            if key not in values and env.get(fallback):
                values[key] = env[fallback]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)


def lease_timing_problem(lease_duration: float, renew_period: float) -> str | None:
    """Why these timings would let two replicas be active at once, or None.

    A holder that fails a renewal steps down RENEW_DEADLINE_FRACTION of the lease after
    its last success; it first retries `renew_period` after that success. A longer
    period means its first renewal comes after the step-down deadline (and, from
    `renew_period >= lease_duration` on, after the lease has expired: a standby takes
    it while the holder still runs). retry_period paces a standby (how soon it notices a
    free lease) and the holder's retries of a failed renewal, which never outlast the
    step-down deadline (leader.next_renewal): it cannot cause two leaders and is not
    bounded here.
    Checked even without leader election: the values mean nothing else, and a bad
    pair should not wait until election is switched on to surface.
    """
    limit = lease_duration * RENEW_DEADLINE_FRACTION
    if renew_period <= limit or abs(renew_period - limit) <= 1e-9 * lease_duration:  # float rounding
        return None
    return (
        f"renew_period (PERSIA_OPERATOR_RENEW_PERIOD) = {renew_period:g} must be at most 2/3 of "
        f"lease_duration (PERSIA_OPERATOR_LEASE_DURATION) = {lease_duration:g}, i.e. <= {limit:g}: "
        "a leader that renews later than that can still be running when its lease expires and "
        "a standby takes over (two active operators)"
    )
