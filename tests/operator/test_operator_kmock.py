"""The real kopf operator, in-process, against KMock (an emulated API server).

What KMock cannot check, for every test here (see operator_testkit.py): no schema or
CEL validation at admission, no garbage collection through owner references, no
label selectors, no PUT, and no controllers: the tests create the pods and write the
workload statuses that the StatefulSet/Job controllers and the kubelet would.
"""

from __future__ import annotations

from operator_testkit import (
    PJ, Cluster, attempt_of, example_body, failed_pod_status, job_body, start_pods,
    succeeded_pod_status, wait_for, workloads,
)  # fmt: skip

from persia_operator import constants as C

from tests.ports import free_ports

NS, NAME = "ns1", "demo"
TRAINING = ["Job/demo-dataloader", "Job/demo-nn-worker", "StatefulSet/demo-embedding-ps", "StatefulSet/demo-embedding-worker"]


def phase(cluster: Cluster, name: str = NAME) -> str | None:
    return cluster.status(NS, name).get("phase")


def is_true(cluster: Cluster, type_: str, name: str = NAME, namespace: str = NS) -> bool:
    cond = cluster.condition(namespace, name, type_)
    return bool(cond and cond["status"] == "True")


def at_attempt(cluster: Cluster, attempt: int) -> bool:
    """Every training workload exists and belongs to `attempt`."""
    found = workloads(cluster, NS, NAME)
    return all(
        key in found and found[key]["metadata"]["labels"].get(C.LABEL_ATTEMPT) == str(attempt) for key in TRAINING
    )


async def running_job(cluster: Cluster, body: dict | None = None) -> dict:
    await cluster.create(body or job_body())
    await wait_for(lambda: is_true(cluster, C.COND_CREATED), what="children created")
    await start_pods(cluster, NS, NAME)
    await wait_for(lambda: phase(cluster) == "Running", what="phase Running")
    return cluster.job(NS, NAME)


async def test_create_makes_owned_children_and_truthful_status(cluster, operator):
    # KMock cannot: reject the children the way a real API server would if they were
    # invalid (they are checked with kubernetes-validate in test_operator_render.py).
    await cluster.create(job_body())
    await wait_for(lambda: is_true(cluster, C.COND_CREATED), what="Created=True")
    job = cluster.job(NS, NAME)
    uid = job["metadata"]["uid"]
    expected = {
        "v1/configmaps": {"demo-config", "demo-nats-config"},
        "v1/services": {"demo-nats", "demo-nats-headless", "demo-embedding-ps", "demo-embedding-worker",
                        "demo-nn-worker", "demo-dataloader"},
        "apps/v1/statefulsets": {"demo-nats", "demo-embedding-ps", "demo-embedding-worker"},
        "batch/v1/jobs": {"demo-nn-worker", "demo-dataloader"},
    }  # fmt: skip
    for resource, names in expected.items():
        assert cluster.names(resource, NS) == names
        for name in names:
            meta = cluster.get(resource, NS, name)["metadata"]
            assert meta["ownerReferences"][0]["uid"] == uid and meta["ownerReferences"][0]["controller"]
            assert meta["labels"][C.LABEL_JOB] == NAME
    status = job["status"]
    assert [c["type"] for c in status["conditions"]] == list(C.CONDITION_TYPES)
    assert status["natsURL"] == "nats://demo-nats.ns1.svc:4222"
    assert status["phase"] == "Starting" and status["replicaStatuses"]["nnWorker"]["readyRatio"] == "0/2"
    # The operator's own finalizer and annotation prefix.
    assert not job["metadata"].get("finalizers")  # none: uninstalling cannot strand a job
    assert "persia.com/last-handled-configuration" in job["metadata"]["annotations"]

    await start_pods(cluster, NS, NAME)
    await wait_for(lambda: phase(cluster) == "Running", what="phase Running")
    status = cluster.status(NS, NAME)
    assert status["replicaStatuses"]["nnWorker"]["readyRatio"] == "2/2"
    assert is_true(cluster, C.COND_READY) and is_true(cluster, C.COND_NATS_READY)
    reasons = await wait_for(
        lambda: {"ChildrenCreated", "AllReplicasReady"} <= {e["reason"] for e in cluster.events(NS)} and
        {e["reason"] for e in cluster.events(NS)}, what="events")  # fmt: skip
    assert all(e["involvedObject"]["name"] == NAME for e in cluster.events(NS) if e["reason"] in reasons)


async def test_pod_failure_restarts_the_whole_job(cluster, operator):
    # KMock cannot: garbage-collect the old pods; they stay (as terminating pods would)
    # and must be ignored because they belong to attempt 0.
    await running_job(cluster)
    nats_uid = cluster.get("apps/v1/statefulsets", NS, "demo-nats")["metadata"]["uid"]
    old_ps_uid = cluster.get("apps/v1/statefulsets", NS, "demo-embedding-ps")["metadata"]["uid"]
    await cluster.set_pod_status(NS, "demo-nn-worker-a0-1", failed_pod_status(137, "OOMKilled"))
    await wait_for(lambda: cluster.status(NS, NAME).get("restartCount") == 1, what="restartCount 1")
    assert is_true(cluster, C.COND_RESTARTING)
    assert "exited with code 137 (OOMKilled)" in cluster.condition(NS, NAME, C.COND_RESTARTING)["message"]
    await wait_for(lambda: at_attempt(cluster, 1), what="attempt 1 workloads")
    assert cluster.get("apps/v1/statefulsets", NS, "demo-embedding-ps")["metadata"]["uid"] != old_ps_uid
    assert cluster.get("apps/v1/statefulsets", NS, "demo-nats")["metadata"]["uid"] == nats_uid  # NATS stays
    await start_pods(cluster, NS, NAME)
    await wait_for(lambda: phase(cluster) == "Running", what="recovered")
    assert cluster.condition(NS, NAME, C.COND_RESTARTING)["reason"] == "Recovered"
    assert cluster.status(NS, NAME)["restartCount"] == 1
    await wait_for(lambda: any(e["reason"] == "PodFailed" and e["type"] == "Warning" for e in cluster.events(NS)),
                   what="a Warning event")  # fmt: skip


async def test_backoff_exhausted_fails_and_cleans_up(cluster, operator):
    # KMock cannot: delete the pods of deleted StatefulSets (no garbage collection).
    await running_job(cluster, job_body(runPolicy={"backoffLimit": 1}))
    await cluster.set_pod_status(NS, "demo-embedding-ps-a0-0", failed_pod_status(143))
    await wait_for(lambda: at_attempt(cluster, 1), what="attempt 1")
    await start_pods(cluster, NS, NAME)
    await wait_for(lambda: phase(cluster) == "Running", what="running again")
    await cluster.set_pod_status(NS, "demo-nn-worker-a1-0", failed_pod_status(137))
    await wait_for(lambda: phase(cluster) == "Failed", what="Failed")
    failed = cluster.condition(NS, NAME, C.COND_FAILED)
    assert failed["reason"] == "BackoffLimitExceeded" and "1 of 1 restarts used" in failed["message"]
    # cleanPodPolicy Running: the servers and NATS go, Services and ConfigMaps stay.
    await wait_for(lambda: not cluster.names("apps/v1/statefulsets", NS), what="servers removed")
    assert "demo-embedding-ps" in cluster.names("v1/services", NS)
    assert cluster.status(NS, NAME)["completionTime"]


async def test_permanent_exit_code_fails_at_once(cluster, operator):
    await running_job(cluster)
    await cluster.set_pod_status(NS, "demo-dataloader-a0-0", failed_pod_status(2))
    await wait_for(lambda: phase(cluster) == "Failed", what="Failed")
    assert cluster.condition(NS, NAME, C.COND_FAILED)["reason"] == "PermanentExitCode"
    assert cluster.status(NS, NAME)["restartCount"] == 0


async def test_nn_workers_complete_succeeds_and_servers_are_cleaned(cluster, operator):
    # KMock cannot: run the Job controller; the test writes the Complete condition.
    await running_job(cluster)
    for i in range(2):
        await cluster.set_pod_status(NS, f"demo-nn-worker-a0-{i}", succeeded_pod_status())
    await cluster.patch("batch/v1/jobs", NS, "demo-nn-worker", {"status": {
        "succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}}, sub="status")  # fmt: skip
    await wait_for(lambda: phase(cluster) == "Succeeded", what="Succeeded")
    assert cluster.condition(NS, NAME, C.COND_SUCCEEDED)["reason"] == "NNWorkersCompleted"
    assert cluster.status(NS, NAME)["replicaStatuses"]["nnWorker"]["succeeded"] == 2
    await wait_for(lambda: set(workloads(cluster, NS, NAME)) == {"Job/demo-nn-worker"}, what="cleanup")
    # Terminal is sticky: a late failure of a leftover pod changes nothing but the counts (a
    # settled finished job has no pass of its own every round, only one when a child changes).
    await cluster.set_pod_status(NS, "demo-embedding-ps-a0-0", failed_pod_status(1))
    await wait_for(lambda: cluster.status(NS, NAME)["replicaStatuses"]["embeddingParameterServer"]["failed"] == 1,
                   what="a pass that saw the failure")  # fmt: skip
    assert phase(cluster) == "Succeeded"
    assert cluster.condition(NS, NAME, C.COND_SUCCEEDED)["status"] == "True"


async def test_suspend_and_resume(cluster, operator):
    await running_job(cluster)
    await cluster.patch(PJ, NS, NAME, {"spec": {"runPolicy": {"suspend": True}}})
    await wait_for(lambda: phase(cluster) == "Suspended", what="Suspended")
    await wait_for(lambda: not workloads(cluster, NS, NAME), what="workloads removed")
    assert "demo-nn-worker" in cluster.names("v1/services", NS)  # cheap objects stay
    assert "startTime" not in cluster.status(NS, NAME)
    await cluster.patch(PJ, NS, NAME, {"spec": {"runPolicy": {"suspend": False}}})
    await wait_for(lambda: at_attempt(cluster, 1), what="workloads restored")
    await wait_for(lambda: cluster.condition(NS, NAME, C.COND_SUSPENDED)["reason"] == "Resumed", what="resumed")
    await start_pods(cluster, NS, NAME)
    await wait_for(lambda: phase(cluster) == "Running", what="running after resume")
    assert cluster.status(NS, NAME)["restartCount"] == 0


async def test_invalid_spec_fails_with_a_message(cluster, operator):
    # KMock cannot: reject this at admission as the CRD's schema/CEL would on a real
    # cluster; the operator's own check is what is tested here.
    body = job_body()
    body["spec"]["nnWorker"]["replicas"] = 0
    await cluster.create(body)
    await wait_for(lambda: phase(cluster) == "Failed", what="Failed")
    failed = cluster.condition(NS, NAME, C.COND_FAILED)
    assert failed["reason"] == "InvalidSpec"
    assert "spec.nnWorker.replicas: replicas must be between 1 and 1024, got 0" in failed["message"]
    assert not cluster.names("v1/services", NS) and not workloads(cluster, NS, NAME)
    await wait_for(lambda: any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in cluster.events(NS)),
                   what="a Warning event")  # fmt: skip


async def test_deleted_children_are_recreated(cluster, operator):
    await running_job(cluster)
    old = cluster.get("apps/v1/statefulsets", NS, "demo-embedding-worker")["metadata"]["uid"]
    assert await cluster.delete("apps/v1/statefulsets", NS, "demo-embedding-worker") == 200
    assert await cluster.delete("v1/services", NS, "demo-nats") == 200
    await wait_for(lambda: cluster.get("v1/services", NS, "demo-nats"), what="Service re-created")
    new = await wait_for(lambda: cluster.get("apps/v1/statefulsets", NS, "demo-embedding-worker"), what="re-created")
    assert new["metadata"]["uid"] != old and new["metadata"]["labels"][C.LABEL_ATTEMPT] == "0"


async def test_spec_changes_are_rejected_or_applied(cluster, operator):
    await running_job(cluster)
    await cluster.patch(PJ, NS, NAME, {"spec": {"embeddingWorker": {"image": "mine:2"}}})
    await wait_for(lambda: cluster.condition(NS, NAME, C.COND_SPEC_ACCEPTED)["status"] == "False", what="rejection")
    message = cluster.condition(NS, NAME, C.COND_SPEC_ACCEPTED)["message"]
    assert "spec.embeddingWorker.image" in message and "suspend" in message
    sts = cluster.get("apps/v1/statefulsets", NS, "demo-embedding-worker")
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == C.DEFAULT_CPU_IMAGE
    await cluster.patch(PJ, NS, NAME, {"spec": {"embeddingWorker": {"image": None, "replicas": 3}}})
    await wait_for(lambda: attempt_of(cluster, NS, "apps/v1/statefulsets", "demo-embedding-worker") == "1", what="resize")
    assert cluster.get("apps/v1/statefulsets", NS, "demo-embedding-worker")["spec"]["replicas"] == 3
    assert cluster.condition(NS, NAME, C.COND_SPEC_ACCEPTED)["status"] == "True"
    assert cluster.status(NS, NAME)["restartCount"] == 0


async def test_child_rejected_by_the_api_fails_the_job(cluster, operator):
    # KMock cannot validate; a reaction plays the API server rejecting the StatefulSet.
    import kmock

    message = 'StatefulSet.apps "demo-embedding-ps" is invalid: spec.template.spec.containers[0].image: Required value'
    cluster.k["post", kmock.resource("apps/v1/statefulsets")] << 422 << {
        "kind": "Status", "code": 422, "reason": "Invalid", "message": message}  # fmt: skip
    await cluster.create(job_body())
    await wait_for(lambda: phase(cluster) == "Failed", what="Failed")
    failed = cluster.condition(NS, NAME, C.COND_FAILED)
    assert failed["reason"] == "ChildCreateFailed" and message in failed["message"]


async def test_ttl_deletes_the_finished_job(cluster, operator):
    # KMock cannot: garbage-collect the children of the deleted job.
    await running_job(cluster, job_body(runPolicy={"ttlSecondsAfterFinished": 0}))
    await cluster.set_pod_status(NS, "demo-nn-worker-a0-0", failed_pod_status(1))
    await wait_for(lambda: cluster.job(NS, NAME) is None, what="job deleted")


async def test_seed_manifest_runs(cluster, operator):
    # KMock cannot: run PERSIA's NatsCluster; the manifest's PERSIA_NATS_URL is used as is.
    await cluster.create(example_body())
    await wait_for(lambda: is_true(cluster, C.COND_CREATED, "adult-income", "default"), what="created")
    status = cluster.status("default", "adult-income")
    assert status["natsURL"] == "nats://persia-nats-service:4222"
    # An external NATS is ready only once the operator connected to it: this one does not exist.
    await wait_for(lambda: cluster.condition("default", "adult-income", C.COND_NATS_READY)["reason"]
                   == "NatsUnreachable", what="NatsUnreachable")  # fmt: skip
    message = cluster.condition("default", "adult-income", C.COND_NATS_READY)["message"]
    assert "cannot connect to nats://persia-nats-service:4222" in message
    assert cluster.names("apps/v1/statefulsets", "default") == {"adult-income-embedding-ps", "adult-income-embedding-worker"}
    assert cluster.names("batch/v1/jobs", "default") == {"adult-income-nn-worker", "adult-income-dataloader"}


async def test_liveness_endpoint_reports_the_reconciler(cluster):
    # KMock cannot: run kubelet probes; the endpoint is fetched directly.
    import json
    import urllib.request

    from operator_testkit import OperatorThread

    port = free_ports(1)  # below the ephemeral range: no port-0 bind takes it before kopf binds it
    runner = OperatorThread(str(cluster.k.url).rstrip("/"), liveness=f"http://127.0.0.1:{port}/healthz")
    await runner.start()
    try:
        await cluster.create(job_body())
        await wait_for(lambda: runner.reconciler.passes > 0, what="a reconcile pass")

        def probe() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
                assert resp.status == 200
                return json.loads(resp.read())

        import asyncio

        report = await asyncio.to_thread(probe)
        assert report["reconcile_passes"] >= 1
    finally:
        await runner.stop()


async def test_namespaced_operator_ignores_other_namespaces(cluster):
    # KMock cannot: enforce the Role that limits a namespaced install; the operator's
    # own scope is what is tested.
    from operator_testkit import OperatorThread

    runner = OperatorThread(str(cluster.k.url).rstrip("/"), namespaces=["ns1"])
    await runner.start()
    try:
        await cluster.create(job_body(namespace="ns2", name="other"))
        await cluster.create(job_body())
        await wait_for(lambda: is_true(cluster, C.COND_CREATED), what="the job in ns1")
        passes = runner.reconciler.passes
        await wait_for(lambda: runner.reconciler.passes >= passes + 3, what="more passes")
        assert cluster.status("ns2", "other") == {}
        assert not cluster.names("v1/services", "ns2")
    finally:
        await runner.stop()


async def test_a_resize_sets_the_pod_group_to_the_new_size(cluster, operator):
    # KMock cannot: run Volcano; the PodGroup's spec is what is checked.
    await running_job(cluster, job_body(scheduling={"gang": "volcano", "queue": "gpu"}))
    group = "scheduling.volcano.sh/v1beta1/podgroups"
    assert cluster.get(group, NS, "demo-gang")["spec"]["minMember"] == 7
    await cluster.patch(PJ, NS, NAME, {"spec": {"nnWorker": {"replicas": 1}}})
    await wait_for(lambda: cluster.get(group, NS, "demo-gang")["spec"]["minMember"] == 6, what="minMember 6")
    await wait_for(lambda: at_attempt(cluster, 1), what="the new attempt's workloads")
    assert cluster.get("batch/v1/jobs", NS, "demo-nn-worker")["spec"]["completions"] == 1
    assert cluster.get(group, NS, "demo-gang")["spec"]["queue"] == "gpu"  # a merge patch: the rest stays


async def test_a_deleted_auth_secret_restarts_nats_and_the_job(cluster, operator):
    # KMock cannot: garbage-collect the old NATS pods (a real API server deletes them with the
    # StatefulSet); nor does it run pods that read the Secret: the credentials are compared here.
    await running_job(cluster)
    old_secret = cluster.get("v1/secrets", NS, "demo-auth")
    nats_uid = cluster.get("apps/v1/statefulsets", NS, "demo-nats")["metadata"]["uid"]
    assert await cluster.delete("v1/secrets", NS, "demo-auth") == 200
    await wait_for(lambda: cluster.status(NS, NAME).get("attempt") == 1, what="a new attempt")
    assert cluster.condition(NS, NAME, C.COND_RESTARTING)["reason"] == "SecretReplaced"
    assert cluster.status(NS, NAME)["restartCount"] == 0 and cluster.status(NS, NAME)["uncountedRestarts"] == 1
    new_secret = await wait_for(lambda: cluster.get("v1/secrets", NS, "demo-auth"), what="the Secret re-created")
    assert new_secret["metadata"]["uid"] != old_secret["metadata"]["uid"]
    await wait_for(lambda: (cluster.get("apps/v1/statefulsets", NS, "demo-nats") or {}).get("metadata", {}).get("uid")
                   not in (None, nats_uid), what="the NATS replaced")  # fmt: skip
    await wait_for(lambda: at_attempt(cluster, 1), what="attempt 1 workloads")
    await start_pods(cluster, NS, NAME)
    await wait_for(lambda: phase(cluster) == "Running", what="running again")
    assert cluster.status(NS, NAME)["attempt"] == 1  # one restart
