"""What the operator knows about a job's children: compact summaries built from the
kopf indexes (pods, workloads, Services, ConfigMaps), and the collection the pure
status logic reads.

Summaries keep only the fields the decisions need, so the indexes stay small.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import constants as C

WORKLOAD_KINDS = ("StatefulSet", "Job", "Deployment")


@dataclass(frozen=True)
class Termination:
    container: str
    exit_code: int | None
    reason: str | None
    signal: int | None = None
    finished_at: str | None = None


@dataclass(frozen=True)
class PodState:
    name: str
    role: str
    attempt: str | None
    phase: str = "Pending"
    reason: str | None = None
    message: str | None = None
    ready: bool = False
    deleting: bool = False
    disrupted: bool = False
    restarts: int = 0
    # Terminated containers of this pod: current state, or the last state of a restart.
    terminations: tuple[Termination, ...] = ()
    waiting: tuple[str, ...] = ()  # waiting reasons, e.g. ImagePullBackOff
    uid: str | None = None  # a replaced pod of a StatefulSet keeps its name, not its uid
    started: bool = False  # a container has started (the pod may hold state)
    disruption_reason: str | None = None  # e.g. PreemptionByScheduler, EvictionByEvictionAPI
    disrupted_at: str | None = None
    created: str | None = None
    deleted_at: str | None = None


@dataclass(frozen=True)
class WorkloadState:
    kind: str
    name: str
    role: str
    attempt: str | None
    owner_uid: str | None
    replicas: int | None = None
    ready: int = 0
    active: int = 0
    succeeded: int = 0
    failed: int = 0
    complete: bool = False  # batch/v1 Job condition Complete
    job_failed: bool = False  # batch/v1 Job condition Failed
    job_failed_reason: str | None = None
    deleting: bool = False


@dataclass(frozen=True)
class Children:
    """Everything observed for one PersiaJob."""

    workloads: dict[tuple[str, str], WorkloadState] = field(default_factory=dict)
    objects: dict[tuple[str, str], str | None] = field(default_factory=dict)  # -> owner uid
    pods: tuple[PodState, ...] = ()
    data_hashes: dict[str, str] = field(default_factory=dict)  # ConfigMap name -> data_hash
    pod_group_sizes: dict[str, int] = field(default_factory=dict)  # PodGroup name -> spec.minMember

    @classmethod
    def from_summaries(cls, summaries: Iterable[dict[str, Any]], owner_uid: str | None = None) -> "Children":
        """Build from index summaries, ignoring objects owned by another PersiaJob
        (e.g. left over from a deleted job of the same name)."""
        workloads: dict[tuple[str, str], WorkloadState] = {}
        objects: dict[tuple[str, str], str | None] = {}
        hashes: dict[str, str] = {}
        sizes: dict[str, int] = {}
        pods: list[PodState] = []
        for s in summaries:
            kind = s["kind"]
            if kind == "Pod":
                pods.append(_pod_from_summary(s))
                continue
            if owner_uid and s.get("owner_uid") and s["owner_uid"] != owner_uid:
                continue
            if kind in WORKLOAD_KINDS:
                workloads[(kind, s["name"])] = _workload_from_summary(s)
            if kind == "ConfigMap" and s.get("data_hash"):
                hashes[s["name"]] = s["data_hash"]
            if kind == "PodGroup" and isinstance(s.get("min_member"), int):
                sizes[s["name"]] = s["min_member"]
            objects[(kind, s["name"])] = s.get("owner_uid")
        pods.sort(key=lambda p: p.name)
        return cls(workloads=workloads, objects=objects, pods=tuple(pods), data_hashes=hashes, pod_group_sizes=sizes)

    def pods_of(self, role: str, attempt: int) -> list[PodState]:
        return [p for p in self.pods if p.role == role and p.attempt == str(attempt)]

    def workload(self, kind: str, name: str) -> WorkloadState | None:
        return self.workloads.get((kind, name))


def _workload_from_summary(s: dict[str, Any]) -> WorkloadState:
    return WorkloadState(
        kind=s["kind"],
        name=s["name"],
        role=s.get("role", ""),
        attempt=s.get("attempt"),
        owner_uid=s.get("owner_uid"),
        replicas=s.get("replicas"),
        ready=s.get("ready", 0),
        active=s.get("active", 0),
        succeeded=s.get("succeeded", 0),
        failed=s.get("failed", 0),
        complete=s.get("complete", False),
        job_failed=s.get("job_failed", False),
        job_failed_reason=s.get("job_failed_reason"),
        deleting=s.get("deleting", False),
    )


def _pod_from_summary(s: dict[str, Any]) -> PodState:
    return PodState(
        name=s["name"],
        role=s.get("role", ""),
        attempt=s.get("attempt"),
        phase=s.get("phase", "Pending"),
        reason=s.get("reason"),
        message=s.get("message"),
        ready=s.get("ready", False),
        deleting=s.get("deleting", False),
        disrupted=s.get("disrupted", False),
        restarts=s.get("restarts", 0),
        terminations=tuple(Termination(**t) for t in s.get("terminations", ())),
        waiting=tuple(s.get("waiting", ())),
        uid=s.get("uid"),
        started=s.get("started", False),
        disruption_reason=s.get("disruption_reason"),
        disrupted_at=s.get("disrupted_at"),
        created=s.get("created"),
        deleted_at=s.get("deleted_at"),
    )


# --- summaries of raw objects (run inside the kopf index handlers) ----------------------


def _owner_uid(meta: dict[str, Any]) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == C.KIND and ref.get("controller"):
            return ref.get("uid")
    return None


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def summarize(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """A JSON-able summary of a child object (the value stored in the kopf index)."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = body.get("status") or {}
    spec = body.get("spec") or {}
    summary: dict[str, Any] = {
        "kind": kind,
        "name": meta.get("name"),
        "role": labels.get(C.LABEL_ROLE, ""),
        "attempt": labels.get(C.LABEL_ATTEMPT),
        "owner_uid": _owner_uid(meta),
        "deleting": bool(meta.get("deletionTimestamp")),
    }
    if kind == "Pod":
        summary.update(_summarize_pod(status))
        summary.update(uid=meta.get("uid"), created=meta.get("creationTimestamp"),
                       deleted_at=meta.get("deletionTimestamp"))  # fmt: skip
    elif kind in ("StatefulSet", "Deployment"):
        summary.update(
            replicas=spec.get("replicas", 1),
            ready=status.get("readyReplicas", 0) or 0,
            active=status.get("replicas", 0) or 0,
        )
    elif kind == "Job":
        complete = _condition(status, "Complete") or {}
        failed = _condition(status, "Failed") or {}
        summary.update(
            replicas=spec.get("completions"),
            ready=status.get("ready", 0) or 0,
            active=status.get("active", 0) or 0,
            succeeded=status.get("succeeded", 0) or 0,
            failed=status.get("failed", 0) or 0,
            complete=complete.get("status") == "True",
            job_failed=failed.get("status") == "True",
            job_failed_reason=failed.get("reason"),
        )
    elif kind == "ConfigMap":
        summary["data_hash"] = data_hash(body.get("data") or {})
    elif kind == "PodGroup":
        summary["min_member"] = spec.get("minMember")  # follows the job's size (plan.py)
    return summary


def data_hash(data: dict[str, Any]) -> str:
    """A ConfigMap's content, as a short fingerprint (what the index keeps of it)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _summarize_pod(status: dict[str, Any]) -> dict[str, Any]:
    ready = _condition(status, "Ready") or {}
    disruption = _condition(status, "DisruptionTarget") or {}
    terminations = []
    waiting = []
    restarts = 0
    started = False
    for cs in status.get("containerStatuses") or []:
        restarts += cs.get("restartCount", 0) or 0
        state = cs.get("state") or {}
        started = started or "running" in state or "terminated" in state or bool(cs.get("restartCount"))
        last = cs.get("lastState") or {}
        term = state.get("terminated") or (last.get("terminated") if cs.get("restartCount") else None)
        if term:
            terminations.append(
                {
                    "container": cs.get("name", ""),
                    "exit_code": term.get("exitCode"),
                    "reason": term.get("reason"),
                    "signal": term.get("signal"),
                    "finished_at": term.get("finishedAt"),
                }
            )
        if (state.get("waiting") or {}).get("reason"):
            waiting.append(state["waiting"]["reason"])
    return {
        "phase": status.get("phase", "Pending"),
        "reason": status.get("reason"),
        "message": status.get("message"),
        "ready": ready.get("status") == "True",
        "disrupted": disruption.get("status") == "True",
        "disruption_reason": disruption.get("reason") if disruption.get("status") == "True" else None,
        "disrupted_at": disruption.get("lastTransitionTime") if disruption.get("status") == "True" else None,
        "restarts": restarts,
        "terminations": terminations,
        "waiting": waiting,
        "started": started,
    }
