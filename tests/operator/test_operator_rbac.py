"""RBAC exactly what the operator calls: the calls are recorded from the operator itself
(the real kopf operator, its leader election and its uninstall hook, driven against KMock
through every path that makes a distinct call), and compared both ways with the rules
the Helm chart grants.

What KMock cannot check: it enforces no RBAC itself, so a missing permission shows here
as a recorded call the chart does not grant, not as a 403.
"""

from __future__ import annotations

import base64
from typing import Any

import kmock
import kopf
import pytest
from operator_testkit import (
    PJ, Cluster, failed_pod_status, job_body, start_pods, succeeded_pod_status, wait_for, workloads,
)  # fmt: skip

from persia_operator import constants as C
from persia_operator.cli import release_finalizers
from persia_operator.kube import KubeApi
from persia_operator.leader import LeaderElector

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Linux x86-64 wheels only)")
from test_operator_chart import render as render_chart  # noqa: E402

NS = "ns1"
VERBS = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
         kmock.action.CREATE: "create", kmock.action.DELETE: "delete"}  # fmt: skip

# Granted without being an API call of the operator, and why.
NOT_CALLS = {
    ("persia.com", "persiajobs/finalizers", "update"): "OwnerReferencesPermissionEnforcement: "
    "blockOwnerDeletion on the children's owner references",
}
# Calls on a path that a scenario cannot reach without faking the API server's answer:
# after a 409 on create the operator GETs the object to see whether it owns it; that
# happens for every kind it creates (the scenario triggers it for Services only).
def conditional(calls: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    return {(g, r, "get") for g, r, v in calls if v == "create" and r not in ("events",)}


def verb(request: Any) -> str:
    if request.action == kmock.action.UPDATE:
        return "patch" if request.method == "PATCH" else "update"
    return VERBS[request.action]


def recorded_calls(cluster: Cluster) -> set[tuple[str, str, str]]:
    calls = set()
    for request in list(cluster.k):
        agent = request.headers.get("User-Agent", "")
        if request.resource is None or not agent.startswith(("kopf/", C.MANAGED_BY)):
            continue
        if request.resource.plural is None:
            continue  # API discovery (/apis/<group>/<version>): allowed to everyone (system:discovery)
        if request.resource.plural in ("namespaces", "customresourcedefinitions"):
            continue  # kopf's scanning is disabled: never called (asserted below)
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        calls.add((request.resource.group or "", resource, verb(request)))
    return calls


def granted_rules(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    granted = set()
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "Role") or doc["metadata"]["name"].endswith(("-edit", "-view")):
            continue
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted |= {(group, resource, v) for v in rule["verbs"]}
    return granted


async def drive_every_path(cluster: Cluster, operator: Any) -> None:
    # A: managed NATS, Volcano gang, a failure (restart: deletes), success, cleanup, TTL.
    await cluster.create(job_body(name="a", scheduling={"gang": "volcano"}, runPolicy={"ttlSecondsAfterFinished": 0}))
    await wait_for(lambda: len(workloads(cluster, NS, "a")) == 5, what="a's workloads")
    await start_pods(cluster, NS, "a")
    await wait_for(lambda: cluster.status(NS, "a").get("phase") == "Running", what="a Running")
    await cluster.set_pod_status(NS, "a-nn-worker-a0-0", failed_pod_status(137))
    await wait_for(lambda: cluster.status(NS, "a").get("attempt") == 1, what="a restarted")
    await wait_for(lambda: all(w["metadata"]["labels"].get(C.LABEL_ATTEMPT) == "1" for k, w in
                               workloads(cluster, NS, "a").items() if not k.endswith("-nats"))
                   and len(workloads(cluster, NS, "a")) == 5, what="a attempt 1")  # fmt: skip
    await start_pods(cluster, NS, "a")
    for i in range(2):
        await cluster.set_pod_status(NS, f"a-nn-worker-a1-{i}", succeeded_pod_status())
    await cluster.patch("batch/v1/jobs", NS, "a-nn-worker", {"status": {
        "succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}}, sub="status")  # fmt: skip
    await wait_for(lambda: cluster.job(NS, "a") is None, what="a deleted after its TTL")
    # B: online mode, external NATS with user Secrets, coscheduling; resized, then suspended.
    for name, data in (("ext-nats", {"user": "u", "password": "p"}), ("ext-tls", {"ca.crt": "x"})):
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS},
                  "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}  # fmt: skip
        assert (await cluster.request("POST", f"/api/v1/namespaces/{NS}/secrets", secret))[0] < 300
    await cluster.create(job_body(name="b", trainingMode="online", scheduling={"gang": "coscheduling"},
                                  nats={"externalURL": "nats://127.0.0.1:1", "auth": {"secretName": "ext-nats"},
                                        "tls": {"secretName": "ext-tls"}}))  # fmt: skip
    await wait_for(lambda: len(workloads(cluster, NS, "b")) == 4, what="b's workloads")
    await start_pods(cluster, NS, "b")
    await wait_for(lambda: cluster.status(NS, "b").get("startTime"), what="b started")
    await cluster.patch(PJ, NS, "b", {"spec": {"nnWorker": {"replicas": 3}}})
    await wait_for(lambda: (cluster.get("apps/v1/deployments", NS, "b-nn-worker") or {}).get("spec", {})
                   .get("replicas") == 3, what="b scaled in place")  # fmt: skip
    await cluster.patch(PJ, NS, "b", {"spec": {"runPolicy": {"suspend": True}}})
    await wait_for(lambda: not workloads(cluster, NS, "b"), what="b suspended")
    # suspend, edit, resume: the job's config ConfigMap is rewritten before its pods come back
    await cluster.patch(PJ, NS, "b", {"spec": {"configs": {"globalConfig": {
        "embedding_worker_config": {"forward_buffer_size": 500}}}}})  # fmt: skip
    await cluster.patch(PJ, NS, "b", {"spec": {"runPolicy": {"suspend": False}}})
    await wait_for(lambda: "forward_buffer_size: 500" in ((cluster.get("v1/configmaps", NS, "b-config") or {})
                                                           .get("data") or {}).get("global_config.yml", ""),
                   what="b's configs rewritten at its resume")  # fmt: skip
    await wait_for(lambda: len(workloads(cluster, NS, "b")) == 4, what="b resumed")
    # C: a child name taken by something else (409, then a GET: not ours).
    taken = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "c-nn-worker", "namespace": NS},
             "spec": {"ports": [{"port": 1}]}}  # fmt: skip
    assert (await cluster.request("POST", f"/api/v1/namespaces/{NS}/services", taken))[0] < 300
    await cluster.create(job_body(name="c"))
    await wait_for(lambda: (cluster.condition(NS, "c", C.COND_CREATED) or {}).get("reason") == "ChildCreateFailed",
                   what="c cannot create the taken name")  # fmt: skip
    # D: a Volcano gang resized (B's resize patched a coscheduling PodGroup): minMember follows.
    group = "scheduling.volcano.sh/v1beta1/podgroups"
    await cluster.create(job_body(name="d", scheduling={"gang": "volcano"}))
    await wait_for(lambda: len(workloads(cluster, NS, "d")) == 5, what="d's workloads")
    before = cluster.get(group, NS, "d-gang")["spec"]["minMember"]
    await cluster.patch(PJ, NS, "d", {"spec": {"nnWorker": {"replicas": 1}}})
    await wait_for(lambda: cluster.get(group, NS, "d-gang")["spec"]["minMember"] == before - 1, what="d's gang resized")


async def test_chart_rbac_is_exactly_what_the_operator_calls(cluster, operator):
    await drive_every_path(cluster, operator)
    # Leader election and the uninstall hook, with the operator's own client.
    api = KubeApi(login=lambda: kopf.ConnectionInfo(server=str(cluster.k.url).rstrip("/")))
    try:
        first = LeaderElector(api, "persia-system", "persia-operator", "replica-1")
        assert await first.try_acquire() and await first.try_acquire()  # create, renew
        await first.release()
        assert await LeaderElector(api, "persia-system", "persia-operator", "replica-2").try_acquire()  # take
        # (the running operator may remove its old finalizer first: kopf drops its own
        # finalizer where no handler needs it; test_release_finalizers checks the hook alone)
        await cluster.patch(PJ, NS, "c", {"metadata": {"finalizers": [C.FINALIZER]}})
        assert await release_finalizers(api, []) in ([], [f"{NS}/c"])
    finally:
        await api.close()

    calls = recorded_calls(cluster)
    needed = calls | conditional(calls)
    granted = granted_rules(render_chart({})[0])
    assert needed - granted == set(), "called but not granted"
    assert granted - needed - set(NOT_CALLS) == set(), "granted but never called"
    # Sanity: the scenario reached the calls that matter for least privilege.
    assert {("", "secrets", "get"), ("", "secrets", "create"), ("apps", "deployments", "patch"),
            ("persia.com", "persiajobs", "delete"), ("scheduling.volcano.sh", "podgroups", "create"),
            ("scheduling.x-k8s.io", "podgroups", "get"), ("coordination.k8s.io", "leases", "patch"),
            ("", "services", "get"), ("persia.com", "persiajobs/status", "patch"),
            ("", "configmaps", "patch")} <= calls  # fmt: skip
    assert not {c for c in calls if c[1] == "secrets" and c[2] in ("list", "watch")}
    assert not [r for r in list(cluster.k) if r.resource is not None and r.resource.plural in ("namespaces", "customresourcedefinitions")
                and r.headers.get("User-Agent", "").startswith(("kopf/", C.MANAGED_BY))]  # fmt: skip


async def test_release_finalizers(cluster):
    """The uninstall hook alone (no operator running): our finalizer goes, others stay."""
    for name, finalizers in (("x", [C.FINALIZER, "example.com/keep"]), ("y", [C.FINALIZER]), ("z", [])):
        body = job_body(name=name)
        body["metadata"]["finalizers"] = finalizers
        await cluster.create(body)
    api = KubeApi(login=lambda: kopf.ConnectionInfo(server=str(cluster.k.url).rstrip("/")))
    try:
        assert sorted(await release_finalizers(api, [NS])) == [f"{NS}/x", f"{NS}/y"]
    finally:
        await api.close()
    assert cluster.job(NS, "x")["metadata"]["finalizers"] == ["example.com/keep"]
    assert not cluster.job(NS, "y")["metadata"].get("finalizers")
