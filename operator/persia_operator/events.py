"""Kubernetes Events for condition transitions (`kubectl describe pj` tells the story)."""

from __future__ import annotations

from dataclasses import dataclass

from . import constants as C
from .job import JobStatus


@dataclass(frozen=True)
class JobEvent:
    type: str  # Normal | Warning
    reason: str
    message: str


def _warning(type_: str, status: str, reason: str) -> bool:
    if status == "True":
        return type_ in (C.COND_FAILED, C.COND_RESTARTING)
    return type_ == C.COND_SPEC_ACCEPTED or reason == "ChildCreateFailed"


def transition_events(prev: JobStatus, new: JobStatus) -> list[JobEvent]:
    """One event per condition that flipped, or changed reason while True. A change of
    reason while False is news only for Created and SpecAccepted (a create error, a
    rejected edit). Each new restart is an event of its own."""
    events = []
    for cond in new.conditions:
        old = prev.condition(cond.type)
        before = (old.status, old.reason) if old is not None else ("False", "Pending")
        after = (cond.status, cond.reason)
        restarted = cond.type == C.COND_RESTARTING and cond.status == "True" and new.attempt != prev.attempt
        if before == after and not restarted:
            continue
        if before[0] == after[0] == "False" and cond.type not in (C.COND_CREATED, C.COND_SPEC_ACCEPTED):
            continue
        if after == ("False", "Pending"):
            continue
        text = f"{cond.type} is {cond.status}"
        if cond.message:
            text += f": {cond.message}"
        events.append(JobEvent("Warning" if _warning(cond.type, cond.status, cond.reason) else "Normal",
                               cond.reason, text[:1024]))  # fmt: skip
    return events
