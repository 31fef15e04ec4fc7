"""A PersiaJob object as the operator's pure functions see it: metadata, spec, status.

The status model is also the source of the CRD's status schema, so that the API server
keeps (does not prune) every field the operator writes.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from . import constants as C
from .spec import JobMeta, PersiaJobSpec

log = logging.getLogger(__name__)


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(_Status):
    """metav1.Condition: lastTransitionTime changes only when `status` flips."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1)
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class ReplicaStatus(_Status):
    desired: int = 0
    active: int = 0
    ready: int = 0
    succeeded: int = 0
    failed: int = 0
    ready_ratio: str = Field("0/0", description='"ready/desired", e.g. "3/4".')


class CheckpointStatus(_Status):
    """What NN rank 0 last reported on NATS (persia.<job>.checkpoint.*, CONTRACTS.md)."""

    step: int | None = Field(None, description="Step of the last complete checkpoint.")
    time: str | None = Field(None, description="When it was written (RFC 3339).")
    path: str | None = None
    resumed_from: str | None = Field(
        None, description="Checkpoint the current attempt resumed from (none: started fresh)."
    )
    resumed_attempt: int | None = Field(None, description="Attempt that resumedFrom refers to.")
    observed_time: str | None = Field(None, description="When the operator last heard of it.")


class RefusedWrite(_Status):
    """A write to a child the API server refused for good, held back until retryAt."""

    kind: str
    name: str
    action: Literal["create", "patch"] = Field("create", description="create (a PodDisruptionBudget), patch (a resize).")
    code: int | None = Field(None, description="The API server's HTTP status.")
    message: str = Field("", description="The API server's answer.")
    fingerprint: str = Field("", description="Hash of what was sent: a changed write is tried at once.")
    tries: int = Field(1, description="Refusals in a row; the backoff doubles with each (1 min to 1 h).")
    retry_at: str = Field(description="When it is tried again (RFC 3339).")


class JobStatus(_Status):
    observed_generation: int | None = None
    phase: str | None = Field(
        None,
        description="Derived for display: Pending|Starting|Running|Restarting|Suspended|Succeeded|Failed.",
    )
    reason: str | None = Field(None, description="Reason of the condition that set the phase.")
    message: str | None = None
    start_time: str | None = Field(None, description="Children first created (reset on resume).")
    completion_time: str | None = None
    attempt_start_time: str | None = Field(None, description="Start of the current attempt.")
    attempt_ready_time: str | None = Field(
        None, description="When the current attempt first became Ready (ends the startup deadline)."
    )
    restart_count: int = Field(0, description="Whole-job restarts after failures (vs backoffLimit).")
    uncounted_restarts: int = Field(
        0, description="Whole-job restarts not counted against backoffLimit (preemption, eviction, PS replaced)."
    )
    attempt: int = Field(
        0, description="Current attempt; bumped by every restart, resume or replica change."
    )
    nats_url: str | None = Field(None, alias="natsURL", description="Without credentials.")
    checkpoint: CheckpointStatus | None = None
    stateful_pods: dict[str, str] = Field(
        default_factory=dict,
        description="role:pod -> uid of the stateful pods started in this attempt (replacement detection).",
    )
    replica_statuses: dict[str, ReplicaStatus] = Field(default_factory=dict)
    conditions: list[Condition] = Field(default_factory=list)
    accepted_spec: dict[str, Any] | None = Field(
        None, description="The spec the job runs (spec changes that are rejected stay out)."
    )
    refused_writes: list[RefusedWrite] | None = Field(
        None,
        description="Writes to children the API server refused for good, tried again with backoff "
        "(kept here so that a restarted operator does not send them again at once).",
    )

    def condition(self, type_: str) -> Condition | None:
        for cond in self.conditions:
            if cond.type == type_:
                return cond
        return None

    def is_true(self, type_: str) -> bool:
        cond = self.condition(type_)
        return cond is not None and cond.status == "True"

    def terminal(self) -> str | None:
        """The terminal condition type that is True, if any."""
        for type_ in C.TERMINAL_CONDITIONS:
            if self.is_true(type_):
                return type_
        return None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")


Loc = tuple[str | int, ...]
_SALVAGE_ROUNDS = 8  # a drop can reveal no new error, so a few rounds always suffice


def _drop(data: dict[str, Any], locs: list[Loc]) -> list[Loc]:
    """Delete, in place, the part of `data` each error location points into: a top-level
    field, or one entry of a list/dict field (one bad condition, not all of them) or one
    field of a nested object. Returns what was deleted."""
    dropped: list[Loc] = []
    for path in sorted({loc[:2] for loc in locs if loc}, key=lambda p: [(isinstance(k, int), k) for k in p],
                       reverse=True):  # fmt: skip  # later list items first: indices stay valid
        parent: Any = data
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        leaf = path[-1]
        if isinstance(parent, dict) and leaf in parent:
            del parent[leaf]
        elif isinstance(parent, list) and isinstance(leaf, int) and 0 <= leaf < len(parent):
            del parent[leaf]
        else:
            continue
        dropped.append(path)
    return dropped


def salvage_status(raw: Any) -> tuple[JobStatus, list[str]]:
    """The previous status, and a note per part of it that did not validate and was
    dropped (empty: it parsed as is). Only the unreadable parts fall back to defaults:
    resetting all of it would zero `attempt` (running children then look stale and are
    replaced) and `restartCount` (fresh retries against backoffLimit)."""
    if raw is None:
        return JobStatus(), []
    if not isinstance(raw, dict):
        return JobStatus(), [f"status is a {type(raw).__name__}, not an object: {raw!r:.200}"]
    data = copy.deepcopy(raw)
    notes: list[str] = []
    for _ in range(_SALVAGE_ROUNDS):
        try:
            return JobStatus.model_validate(data), notes
        except ValidationError as err:
            errors = err.errors(include_url=False)
            dropped = _drop(data, [tuple(e["loc"]) for e in errors])
            notes += [f"{'.'.join(map(str, e['loc'])) or 'status'}: {e['msg']} (got {e.get('input')!r:.200})"
                      for e in errors]  # fmt: skip
            if not dropped:
                break
    return JobStatus(), [*notes, "nothing of it could be kept"]


def parse_status(raw: Any, job: str | None = None) -> JobStatus:
    """Previous status, tolerating garbage (an older operator's, a hand edit): what
    does not validate is dropped, logged, and rewritten by the pass."""
    status, notes = salvage_status(raw)
    if notes:
        who = job or "a PersiaJob"
        log.warning(f"Status of {who} does not validate; dropped the unreadable parts: {'; '.join(notes)}")
    return status


class PersiaJob(BaseModel):
    """A validated PersiaJob; `spec` is the spec to run (see acceptance.py)."""

    metadata: JobMeta
    spec: PersiaJobSpec
    status: JobStatus = Field(default_factory=JobStatus)

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace
