"""What the operator learns from a job's NATS, as plain data for `derive_status`.

The operator connects to each running job's NATS (with the job's credentials) to know
that it is reachable (`NatsReady` of an external NATS) and to ask NN rank 0 for the
last checkpoint (`persia.<job>.checkpoint.latest`, docs/architecture.md, "Checkpoints"). Replies are JSON,
checked against a schema, never unpickled. Credentials never leave this process:
`redact` strips them from anything that is logged or written to the status.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]*@", re.IGNORECASE)


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """`text` without URL user-info and without any of `secrets`."""
    out = _USERINFO.sub(lambda m: m.group("scheme") + "***@", text)
    for secret in secrets:
        if secret and len(secret) >= 4:
            out = out.replace(secret, "***")
    return out


def latest_subject(job: str) -> str:
    return f"persia.{job}.checkpoint.latest"


def published_subject(job: str) -> str:
    return f"persia.{job}.checkpoint.published"


class CheckpointReport(BaseModel):
    """The reply of NN rank 0 (docs/architecture.md, "Checkpoints"): {step, time, path, resumed_from}."""

    model_config = ConfigDict(extra="ignore")

    step: int = Field(ge=0)
    time: float | str
    path: str = Field(max_length=4096)
    resumed_from: str | None = Field(None, max_length=4096)

    def time_rfc3339(self) -> str:
        if isinstance(self.time, (int, float)):
            return datetime.fromtimestamp(self.time, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return self.time


def parse_report(data: bytes) -> CheckpointReport:
    """Raise ValueError naming the problem for anything but a valid report."""
    if len(data) > 64 * 1024:
        raise ValueError(f"checkpoint report of {len(data)} bytes is too large")
    try:
        raw = json.loads(data)
    except ValueError as err:
        raise ValueError(f"checkpoint report is not JSON: {err}") from None
    try:
        return CheckpointReport.model_validate(raw)
    except ValidationError as err:
        raise ValueError(f"invalid checkpoint report: {err.errors()[0]['loc']} {err.errors()[0]['msg']}") from None


@dataclass(frozen=True)
class NatsObservation:
    """The latest probe of a job's NATS. `error` is already redacted."""

    connected: bool
    error: str | None = None
    checkpoint: CheckpointReport | None = None
    checkpoint_error: str | None = None
    url: str | None = None  # redacted
    at: datetime | None = None  # when the probe ran
