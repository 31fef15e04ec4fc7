"""Which spec the job runs when the user edits it.

While the job's workloads exist, only the fields below are applied; any other change
is rejected (the job keeps running what it started with, and the SpecAccepted condition
names the fields). While the job is suspended everything is applied, so "suspend, edit,
resume" is the way to change images, resources or configs of a live job.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .spec import PersiaJobSpec, SpecError, parse_spec

ROLE_FIELDS = ("embeddingParameterServer", "embeddingWorker", "nnWorker", "dataloader")

# Applied while running. Replica counts start a new attempt with the new sizes (or scale
# a Deployment in online mode); run policy is read afresh on every reconcile pass.
APPLIED_PATHS: tuple[tuple[str, ...], ...] = (
    ("runPolicy", "backoffLimit"),
    ("runPolicy", "activeDeadlineSeconds"),
    ("runPolicy", "startupDeadlineSeconds"),
    ("runPolicy", "ttlSecondsAfterFinished"),
    ("runPolicy", "cleanPodPolicy"),
    ("runPolicy", "suspend"),
    *((role, "replicas") for role in ROLE_FIELDS),
)


@dataclass(frozen=True)
class Acceptance:
    spec: PersiaJobSpec | None  # what to run; None when nothing valid was ever accepted
    error: str | None = None  # the current spec is invalid
    rejected: list[str] = field(default_factory=list)  # changed paths that are not applied
    replica_changes: dict[str, tuple[int, int]] = field(default_factory=dict)  # role field -> (old, new)


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _set(d: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(d.get(key), dict):
            if value is None:
                return
            d[key] = {}
        d = d[key]
    if value is None:
        d.pop(path[-1], None)
    else:
        d[path[-1]] = value


def _without_applied(spec: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(spec)
    for path in APPLIED_PATHS:
        _set(stripped, path, None)
    return stripped


def diff_paths(old: Any, new: Any, prefix: str = "spec") -> list[str]:
    """Dotted paths where `old` and `new` differ (lists compare whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        paths = []
        for key in sorted(set(old) | set(new), key=str):
            paths += diff_paths(old.get(key), new.get(key), f"{prefix}.{key}")
        return paths
    return [] if old == new else [prefix]


def accept_spec(raw: Any, accepted: dict[str, Any] | None, *, locked: bool) -> Acceptance:
    """Decide the spec to run. `locked`: the job's workloads exist (not suspended)."""
    if accepted is not None:
        try:
            parse_spec(accepted)
        except SpecError:
            accepted = None  # written by an older operator and no longer valid: start afresh
    try:
        current = parse_spec(raw)
    except SpecError as err:
        if accepted is None:
            return Acceptance(spec=None, error=str(err))
        return Acceptance(spec=parse_spec(accepted), error=str(err))
    if accepted is None or not locked:
        return Acceptance(spec=current)
    current_wire = current.to_wire()
    rejected = diff_paths(_without_applied(accepted), _without_applied(current_wire))
    effective = copy.deepcopy(accepted)
    for path in APPLIED_PATHS:
        old, new = _get(accepted, path), _get(current_wire, path)
        if path[0] in ROLE_FIELDS and (old is None or new is None):
            continue  # an added or removed role is a rejected change, not a resize
        _set(effective, path, new)
    changes = {}
    for role in ROLE_FIELDS:
        old, new = _get(accepted, (role, "replicas")), _get(current_wire, (role, "replicas"))
        if old is not None and new is not None and old != new:
            changes[role] = (old, new)
    try:
        spec = parse_spec(effective)
    except SpecError as err:
        return Acceptance(spec=parse_spec(accepted), error=f"the applied part is invalid: {err}")
    return Acceptance(spec=spec, rejected=rejected, replica_changes=changes)
