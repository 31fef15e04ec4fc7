"""Options of the operator process (not of a job): scope, timeouts, intervals.

Defaults suit a cluster; tests shorten the interval. Every option can also come from
the environment (PERSIA_OPERATOR_<NAME>), which is how the Helm chart sets them.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field, field_validator


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
    lease_duration: float = Field(15.0, gt=0)
    renew_period: float = Field(5.0, gt=0)
    retry_period: float = Field(2.0, gt=0)

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [n.strip() for n in value.split(",") if n.strip()]
        return value

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
