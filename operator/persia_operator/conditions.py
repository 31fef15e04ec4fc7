"""Condition bookkeeping and the derived `phase`.

Conditions are the truth; `phase` is a one-word summary for `kubectl get`. Terminal
conditions (Succeeded, Failed) never change once True.
"""

from __future__ import annotations

from datetime import UTC, datetime

from . import constants as C
from .job import Condition, JobStatus

_ORDER = {t: n for n, t in enumerate(C.CONDITION_TYPES)}


def timestamp(now: datetime) -> str:
    """RFC 3339 in UTC with second precision, as Kubernetes writes times."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: str,
    generation: int | None,
) -> list[Condition]:
    """Return `conditions` with `type_` set; lastTransitionTime moves only on a flip.

    A terminal condition that is already True is left as it is (sticky).
    """
    value = "True" if status else "False"
    result = [c for c in conditions if c.type != type_]
    current = next((c for c in conditions if c.type == type_), None)
    if current is not None and type_ in C.TERMINAL_CONDITIONS and current.status == "True":
        result.append(current)
    else:
        flipped = current is None or current.status != value
        result.append(
            Condition(
                type=type_,
                status=value,
                reason=reason,
                message=message,
                last_transition_time=now if flipped else current.last_transition_time,
                observed_generation=generation,
            )
        )
    return sorted(result, key=lambda c: _ORDER.get(c.type, len(_ORDER)))


def derive_phase(status: JobStatus) -> tuple[str, str, str]:
    """(phase, reason, message): Failed > Succeeded > Suspended > Restarting > Running >
    Starting > Pending. Running means the attempt has been Ready once (see the Ready
    condition for its health now)."""
    for type_, phase in (
        (C.COND_FAILED, "Failed"),
        (C.COND_SUCCEEDED, "Succeeded"),
        (C.COND_SUSPENDED, "Suspended"),
        (C.COND_RESTARTING, "Restarting"),
    ):
        cond = status.condition(type_)
        if cond is not None and cond.status == "True":
            return phase, cond.reason, cond.message
    ready = status.condition(C.COND_READY)
    created = status.condition(C.COND_CREATED)
    if status.attempt_ready_time and ready is not None:
        return "Running", ready.reason, ready.message
    if created is not None and created.status == "True":
        reason = ready.reason if ready else created.reason
        message = ready.message if ready else created.message
        return "Starting", reason, message
    if created is not None:
        return "Pending", created.reason, created.message
    return "Pending", "Pending", ""
