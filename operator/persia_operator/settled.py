"""Finished jobs the periodic loop need not read: pure decisions.

A Succeeded or Failed job keeps only its counts moving, its cleanup and its TTL. Once a pass of
it changed nothing (no status write, no action), another pass changes nothing either until the
job itself changes, its children change (both seen without a call: kopf's indexes) or its TTL
is due; yet every periodic round read it and its Secrets, PDBs and PodGroup (about 5 GETs a job
every 10 s, for as long as finished jobs are kept).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .job import JobStatus
from .plan import ttl_due_at


@dataclass(frozen=True)
class Settled:
    """What the last pass of a finished job saw, and when it must run again (its TTL)."""

    version: str | None  # the job's resourceVersion
    children: str  # fingerprint of the summaries of its children
    wake_at: datetime | None


def fingerprint(summaries: Iterable[dict[str, Any]]) -> str:
    """The children as the indexes show them, order aside."""
    lines = sorted(json.dumps(s, sort_keys=True, default=str) for s in summaries)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def settled_after(status: JobStatus, changed: bool, version: str | None, children: str) -> Settled | None:
    """A pass's outcome: settled when the job is finished and the pass changed nothing
    (``changed``: it wrote the status, or planned an action)."""
    if status.terminal() is None or changed:
        return None
    return Settled(version, children, ttl_due_at(status))


def pass_due(settled: Settled | None, version: str | None, children: str, now: datetime) -> bool:
    """Whether the periodic loop runs a pass: always, unless the job settled and neither it nor
    its children changed since, and its TTL is not due."""
    if settled is None or version != settled.version or children != settled.children:
        return True
    return settled.wake_at is not None and now >= settled.wake_at
