"""The operator as a cluster user meets it through real kubectl 1.32: `kubectl apply` of a job
and of edits to it, `kubectl patch` to suspend and resume, `kubectl get pj [-o wide]` in every
phase, a bad spec, a job of another controller. The operator (kopf, in-process) runs against the
e2e stand-in API server (kubectl_harness.py).

What the stand-in cannot check: admission (the CRD's schema and CEL rules are not applied, so a
bad spec reaches the operator's own validation, as it does on a real cluster for the rules CEL
does not state), and there is no kubelet or controllers: the tests write pods and statuses."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time

import pytest
from kubectl_harness import (
    REPO,
    apply,
    body,
    e2e_module,
    get_pj,
    pods_for,
    set_pod_status,
)
from operator_testkit import (
    OperatorThread,
    failed_pod_status,
    job_body,
    running_pod_status,
)

KUBECTL = e2e_module("cluster").KUBECTL
pytestmark = [pytest.mark.integration, pytest.mark.skipif(not os.path.exists(KUBECTL), reason="kubectl not installed")]
NS = "team-a"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    Cluster = e2e_module("cluster").Cluster
    with Cluster(tmp_path_factory.mktemp("kubectl"), kubelet=False) as c:
        c.kubectl("apply", "-f", str(REPO / "crds"))
        apply(c, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        runner = OperatorThread(c.url, interval=0.2)
        asyncio.run(runner.start())
        try:
            yield c
        finally:
            asyncio.run(runner.stop())


def until(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def row(cluster, name: str) -> list[str]:
    """`kubectl get pj NAME -o wide` without the AGE column: NAME PHASE READY RESTARTS SUCCEEDED REASON."""
    header, *rows = get_pj(cluster, NS, name, "-o", "wide")
    assert header == ["NAME", "PHASE", "READY", "RESTARTS", "AGE", "SUCCEEDED", "REASON"], header
    return [cell for n, cell in enumerate(rows[0]) if n != 4]


def condition(cluster, name: str, type_: str) -> dict:
    conditions = ((body(cluster, NS, name) or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def start(cluster, name: str) -> list[str]:
    """The pods of the current attempt, once its workloads are all there."""
    until(lambda: condition(cluster, name, "Created").get("status") == "True", "the children created")
    return pods_for(cluster, NS, name, running_pod_status())


def test_columns_through_the_phases_and_edits(cluster):
    job = job_body("cols", NS)
    apply(cluster, job)
    until(lambda: row(cluster, "cols")[1] == "Starting", "Starting")
    assert row(cluster, "cols") == ["cols", "Starting", "0/2", "0", "False", "ReplicasNotReady"]
    start(cluster, "cols")
    until(lambda: row(cluster, "cols") == ["cols", "Running", "2/2", "0", "False", "AllReplicasReady"], "Running")

    # An edit that is not applied while running (the image), with one that is (a replica count).
    edited = copy.deepcopy(job)
    edited["spec"]["image"] = "mine:2"
    edited["spec"]["embeddingWorker"]["replicas"] = 2
    assert "configured" in apply(cluster, edited)
    until(lambda: row(cluster, "cols")[1:4] == ["Restarting", "0/2", "0"], "Restarting for the new size")
    assert row(cluster, "cols")[5] == "ReplicasChanged"
    rejected = condition(cluster, "cols", "SpecAccepted")
    assert rejected["status"] == "False" and "spec.image" in rejected["message"]
    start(cluster, "cols")
    until(lambda: row(cluster, "cols")[1] == "Running", "Running at the new size")

    # An invalid edit: refused naming the field and the value; the job goes on.
    cluster.kubectl("patch", "pj", "cols", "-n", NS, "--type=merge", "-p", '{"spec":{"nnWorker":{"replicas":0}}}')
    until(lambda: condition(cluster, "cols", "SpecAccepted").get("reason") == "InvalidSpec", "the edit refused")
    assert "spec.nnWorker.replicas: replicas must be between 1 and 1024, got 0" in \
        condition(cluster, "cols", "SpecAccepted")["message"]
    assert row(cluster, "cols")[1] == "Running"
    cluster.kubectl("patch", "pj", "cols", "-n", NS, "--type=merge", "-p", '{"spec":{"nnWorker":{"replicas":2}}}')

    # Suspend and resume.
    cluster.kubectl("patch", "pj", "cols", "-n", NS, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}')
    until(lambda: row(cluster, "cols")[1] == "Suspended", "Suspended")
    assert row(cluster, "cols")[5] == "Suspended"
    cluster.kubectl("patch", "pj", "cols", "-n", NS, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":false}}}')
    until(lambda: row(cluster, "cols")[1] == "Starting", "Starting after resume")
    names = start(cluster, "cols")
    until(lambda: row(cluster, "cols")[1] == "Running", "Running after resume")

    # A retryable failure (signal), then a permanent one (exit 1).
    set_pod_status(cluster, NS, next(n for n in names if "nn-worker" in n), failed_pod_status(137))
    until(lambda: row(cluster, "cols")[1:4] == ["Restarting", "0/2", "1"], "Restarting, RESTARTS 1")
    assert row(cluster, "cols")[5] == "PodFailed"
    names = start(cluster, "cols")
    until(lambda: row(cluster, "cols")[1] == "Running", "Running again")
    set_pod_status(cluster, NS, next(n for n in names if "dataloader" in n), failed_pod_status(1))
    until(lambda: row(cluster, "cols")[1] == "Failed", "Failed")
    assert row(cluster, "cols")[3:] == ["1", "False", "PermanentExitCode"]
    # The workloads cleaned up (cleanPodPolicy Running), their pods gone: READY follows.
    until(lambda: row(cluster, "cols") == ["cols", "Failed", "0/2", "1", "False", "PermanentExitCode"], "READY 0/2")


@pytest.mark.parametrize("name, spec, message", [
    ("bad-qty", {"embeddingWorker": {"replicas": 1, "resources": {"limits": {"memory": "4 GB"}}}},
     "spec.embeddingWorker.resources: limits.memory must be a non-negative quantity such as 500m, 2 or 4Gi, got '4 GB'"),
    ("bad-volume", {"nnWorker": {"replicas": 1, "template": {"spec": {"volumes": ["data"]}}}},
     "spec.nnWorker.template.spec: volumes[0] must be an object with a name, got 'data'"),
])  # fmt: skip
def test_a_bad_spec_is_refused_naming_the_field_and_the_value(cluster, name, spec, message):
    apply(cluster, job_body(name, NS, **spec))
    until(lambda: row(cluster, name)[1] == "Failed", "Failed")
    assert row(cluster, name)[-1] == "InvalidSpec"  # READY is blank: nothing was rendered
    assert message in condition(cluster, name, "Failed")["message"]
    assert message in cluster.kubectl("describe", "pj", name, "-n", NS)
    assert not [n for n in cluster.kubectl("get", "sts,job,svc", "-n", NS, "-o", "name").split() if f"/{name}-" in n]


def test_a_job_of_another_controller_is_left_alone(cluster):
    apply(cluster, job_body("theirs", NS, managedBy="kueue.x-k8s.io/multikueue"))
    apply(cluster, job_body("ours", NS))
    until(lambda: row(cluster, "ours")[1] == "Starting", "the job beside it reconciled")
    time.sleep(1)  # five rounds
    theirs = body(cluster, NS, "theirs")
    assert not theirs.get("status") and "persia.com/last-handled-configuration" not in \
        (theirs["metadata"].get("annotations") or {})
    assert not [n for n in cluster.kubectl("get", "sts,job,svc,secret", "-n", NS, "-o", "name").split() if "/theirs-" in n]


def test_a_secret_deleted_by_hand_then_the_job_deleted_while_it_restarts(cluster):
    apply(cluster, job_body("hand", NS))
    start(cluster, "hand")
    until(lambda: row(cluster, "hand")[1] == "Running", "Running")
    nats_uid = cluster.get("statefulsets", NS, "hand-nats", group="apps")["metadata"]["uid"]
    cluster.kubectl("delete", "secret", "hand-auth", "-n", NS)
    until(lambda: row(cluster, "hand")[1:4] == ["Restarting", "0/2", "0"], "Restarting")
    assert row(cluster, "hand")[5] == "SecretReplaced"
    until(lambda: (cluster.get("statefulsets", NS, "hand-nats", group="apps") or {}).get("metadata", {}).get("uid")
          not in (None, nats_uid), "the NATS replaced, reading the new Secret")  # fmt: skip
    assert cluster.get("secrets", NS, "hand-auth") is not None
    # Deleted while it restarts: the job goes, and owner references take every child with it.
    def children() -> set[str]:
        out = cluster.kubectl("get", "sts,job,svc,cm,secret,pdb,pods", "-n", NS, "-o", "name")
        return {n for n in out.split() if "/hand-" in n}

    uid = body(cluster, NS, "hand")["metadata"]["uid"]
    before = children()
    cluster.kubectl("delete", "pj", "hand", "-n", NS, "--wait=false")
    until(lambda: body(cluster, NS, "hand") is None, "the job gone")
    until(lambda: not before & children(), "every child gone")
    # A pass already under way may still create one; owned by the deleted job, a real garbage
    # collector removes it too (the stand-in collects only when the owner goes).
    for name in children():
        kind, _, short = name.partition("/")
        left = json.loads(cluster.kubectl("get", kind, short, "-n", NS, "-o", "json"))
        assert uid in [r["uid"] for r in left["metadata"].get("ownerReferences") or []], name
