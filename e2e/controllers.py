"""The StatefulSet, Job and Deployment controllers, as pure plans (tested without a server).

Each `plan_*` takes a workload and the pods it owns and returns what to do: pods to
create, pods to delete, and the workload's new status. The kubelet thread applies plans.

What the real controllers do that these do not: StatefulSet OrderedReady start-up,
rolling updates, revisions (ControllerRevisions) and PVC templates (volumeClaimTemplates
are ignored); Jobs: pod failure policies, success policies, suspend, backoff delays between
retries, `ttlSecondsAfterFinished`, non-indexed parallel Jobs beyond "one pod per
completion"; Deployments: ReplicaSets (pods are owned by the Deployment directly), rolling
updates (any template change recreates all pods), progress deadlines. None of them posts
Events.
"""

from __future__ import annotations

import copy
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

NODE_NAME = "e2e-process-kubelet"


@dataclass
class Plan:
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    status: dict[str, Any] | None = None


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owner(workload: dict[str, Any]) -> dict[str, Any]:
    meta = workload["metadata"]
    return {"apiVersion": workload["apiVersion"], "kind": workload["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def _pod(workload: dict[str, Any], name: str, labels: dict[str, str], annotations: dict[str, str] | None = None,
         **spec_extra: Any) -> dict[str, Any]:  # fmt: skip
    template = copy.deepcopy(workload["spec"]["template"])
    tmeta = template.get("metadata") or {}
    spec = template["spec"]
    spec.update(spec_extra)
    spec["nodeName"] = NODE_NAME
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": workload["metadata"]["namespace"],
            "labels": {**(tmeta.get("labels") or {}), **labels},
            "annotations": {**(tmeta.get("annotations") or {}), **(annotations or {})},
            "ownerReferences": [_owner(workload)],
        },
        "spec": spec,
    }


def _live(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp")


def _phase(pod: dict[str, Any]) -> str:
    return (pod.get("status") or {}).get("phase", "Pending")


def _ready(pod: dict[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _restarts(pod: dict[str, Any]) -> int:
    return sum(int(cs.get("restartCount") or 0) for cs in (pod.get("status") or {}).get("containerStatuses") or [])


def plan_statefulset(sts: dict[str, Any], pods: list[dict[str, Any]]) -> Plan:
    """Parallel pod management: pods <name>-<i> for every ordinal, failed pods replaced."""
    plan = Plan()
    if sts["metadata"].get("deletionTimestamp"):
        return plan
    name, spec = sts["metadata"]["name"], sts["spec"]
    replicas = int(spec.get("replicas", 1))
    by_name = {p["metadata"]["name"]: p for p in pods}
    for i in range(replicas):
        pod_name = f"{name}-{i}"
        pod = by_name.get(pod_name)
        if pod is None:
            labels = {"apps.kubernetes.io/pod-index": str(i), "statefulset.kubernetes.io/pod-name": pod_name}
            plan.create.append(_pod(sts, pod_name, labels, hostname=pod_name, subdomain=spec.get("serviceName", name)))
        elif _live(pod) and _phase(pod) in ("Succeeded", "Failed"):
            plan.delete.append(pod_name)
    for pod_name, pod in by_name.items():
        ordinal = pod_name.rsplit("-", 1)[-1]
        if _live(pod) and (not ordinal.isdigit() or int(ordinal) >= replicas):
            plan.delete.append(pod_name)
    live = [p for p in pods if _live(p)]
    ready = sum(1 for p in live if _ready(p))
    plan.status = {
        "observedGeneration": sts["metadata"].get("generation", 1),
        "replicas": len(live), "readyReplicas": ready, "currentReplicas": len(live),
        "updatedReplicas": len(live), "availableReplicas": ready,
    }  # fmt: skip
    return plan


def _ranges(indexes: set[int]) -> str:
    """{0,1,2,5} -> "0-2,5" (status.completedIndexes)."""
    out, run = [], []
    for i in sorted(indexes):
        if run and i == run[-1] + 1:
            run.append(i)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _condition(type_: str, reason: str, message: str) -> dict[str, Any]:
    t = now_iso()
    return {"type": type_, "status": "True", "reason": reason, "message": message, "lastProbeTime": t,
            "lastTransitionTime": t}  # fmt: skip


def plan_job(job: dict[str, Any], pods: list[dict[str, Any]]) -> Plan:
    """Indexed (and simple non-indexed) Jobs: one active pod per unfinished index; a
    failed pod counts against backoffLimit (container restarts too, with OnFailure)."""
    plan = Plan()
    meta, spec = job["metadata"], job["spec"]
    status = copy.deepcopy(job.get("status") or {})
    if meta.get("deletionTimestamp"):
        return plan
    done = any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in status.get("conditions") or [])
    completions = int(spec.get("completions", 1) or 1)
    indexed = spec.get("completionMode") == "Indexed"
    live = [p for p in pods if _live(p)]
    active = [p for p in live if _phase(p) not in ("Succeeded", "Failed")]
    succeeded_idx = {int(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"])
                     for p in pods if _phase(p) == "Succeeded"}  # fmt: skip
    failed = sum(1 for p in pods if _phase(p) == "Failed") + sum(_restarts(p) for p in active)
    status.setdefault("startTime", now_iso())
    if done:
        plan.delete += [p["metadata"]["name"] for p in active]
    elif failed > int(spec.get("backoffLimit", 6)):
        plan.delete += [p["metadata"]["name"] for p in active]
        status["conditions"] = [
            _condition("FailureTarget", "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
            _condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
        ]
    elif len(succeeded_idx) >= completions:
        status["conditions"] = [
            _condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
            _condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods"),
        ]
        status["completionTime"] = now_iso()
    else:
        busy = {int(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]) for p in active}
        for i in range(completions):
            if i in succeeded_idx or i in busy:
                continue
            labels = {"batch.kubernetes.io/job-completion-index": str(i), "job-name": meta["name"],
                      "batch.kubernetes.io/job-name": meta["name"], "controller-uid": meta["uid"],
                      "batch.kubernetes.io/controller-uid": meta["uid"]}  # fmt: skip
            annotations = {"batch.kubernetes.io/job-completion-index": str(i)}
            extra: dict[str, Any] = {}
            if indexed and job["spec"]["template"]["spec"].get("subdomain"):
                extra["hostname"] = f"{meta['name']}-{i}"
            pod = _pod(job, f"{meta['name']}-{i}-{uuid.uuid4().hex[:5]}", labels, annotations, **extra)
            if indexed:
                for c in pod["spec"]["containers"]:
                    c.setdefault("env", []).insert(0, {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})  # fmt: skip
            plan.create.append(pod)
    status.update(
        active=len(active) - len([n for n in plan.delete if n in {p["metadata"]["name"] for p in active}]),
        ready=sum(1 for p in active if _ready(p)),
        succeeded=len(succeeded_idx) if indexed else sum(1 for p in pods if _phase(p) == "Succeeded"),
        failed=failed,
        terminating=len(pods) - len(live),
    )
    if indexed:
        status["completedIndexes"] = _ranges(succeeded_idx)
    plan.status = status
    return plan


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def plan_deployment(dep: dict[str, Any], pods: list[dict[str, Any]]) -> Plan:
    """`replicas` pods of the current template; pods of an older template are deleted."""
    plan = Plan()
    if dep["metadata"].get("deletionTimestamp"):
        return plan
    name, spec = dep["metadata"]["name"], dep["spec"]
    want = template_hash(spec["template"])
    replicas = int(spec.get("replicas", 1))
    live = [p for p in pods if _live(p)]
    current = []
    for p in live:
        if p["metadata"].get("labels", {}).get("pod-template-hash") != want or _phase(p) in ("Succeeded", "Failed"):
            plan.delete.append(p["metadata"]["name"])
        else:
            current.append(p)
    for p in current[replicas:]:
        plan.delete.append(p["metadata"]["name"])
    old_alive = len(live) - len(current)
    if old_alive == 0 or spec.get("strategy", {}).get("type") != "Recreate":
        for _ in range(replicas - len(current)):
            plan.create.append(_pod(dep, f"{name}-{want}-{uuid.uuid4().hex[:5]}", {"pod-template-hash": want}))
    ready = sum(1 for p in current[:replicas] if _ready(p))
    plan.status = {
        "observedGeneration": dep["metadata"].get("generation", 1),
        "replicas": len(live), "updatedReplicas": len(current), "readyReplicas": ready, "availableReplicas": ready,
        "conditions": [{"type": "Available", "status": "True" if ready >= replicas else "False",
                        "reason": "MinimumReplicasAvailable" if ready >= replicas else "MinimumReplicasUnavailable"}],
    }  # fmt: skip
    return plan
