"""`persia-operator run` as a real process: kubeconfig login, leader election, liveness
and /metrics endpoints, reconciling a job, and a clean exit on SIGTERM (lease released).

What KMock cannot check here (see operator_testkit.py): admission, controllers, garbage
collection; the API server is KMock on loopback, reached through a kubeconfig."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import yaml
from operator_testkit import REPO, job_body, wait_for

from persia_operator import constants as C

from tests.ports import free_ports


async def test_operator_process_runs_a_job(cluster, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    server = str(cluster.k.url).rstrip("/")
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester", "namespace": "ns1"}}],
    }))  # fmt: skip
    port = free_ports(2)
    metrics_port = port + 1
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": "ns1", "HOSTNAME": "operator-0",
           "PERSIA_OPERATOR_METRICS_PORT": str(metrics_port)}  # fmt: skip
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "persia_operator", "run", "-A", "--interval", "0.2", "--leader-elect",
         "--liveness", f"http://127.0.0.1:{port}/healthz"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    try:
        await cluster.create(job_body())
        created = await wait_for(lambda: proc.poll() is not None or cluster.condition("ns1", "demo", C.COND_CREATED),
                                 timeout=30, what="the job reconciled by the process")  # fmt: skip
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert created["reason"] in ("Creating", "ChildrenCreated")
        await wait_for(lambda: "demo-nn-worker" in cluster.names("batch/v1/jobs", "ns1"), timeout=30, what="children")

        def probe() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
                return json.loads(resp.read())

        # kopf caches probe results for 10 s: poll past one refresh.
        deadline = time.monotonic() + 25
        while (report := await asyncio.to_thread(probe))["reconcile_passes"] < 1:
            assert time.monotonic() < deadline, report
            await asyncio.sleep(0.5)
        lease = cluster.get("coordination.k8s.io/v1/leases", "ns1", "persia-operator")
        assert lease["spec"]["holderIdentity"] == "operator-0"

        def scrape() -> dict[str, float]:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
                lines = resp.read().decode().splitlines()
            return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln and not ln.startswith("#")}

        metrics = await asyncio.to_thread(scrape)
        assert metrics['persia_operator_reconcile_total{result="ok"}'] >= 1
        assert metrics["persia_operator_reconcile_duration_seconds_count"] >= 1
        assert sum(v for k, v in metrics.items() if k.startswith("persia_operator_jobs{")) == 1
        assert metrics["persia_operator_leader"] == 1
        # Every request of the operator (kopf's and its own) carried the kubeconfig's token.
        operator_requests = [r for r in list(cluster.k) if r.headers.get("User-Agent", "").startswith(("kopf/", C.MANAGED_BY))]
        assert {r.headers.get("User-Agent", "").split("/")[0] for r in operator_requests} == {"kopf", C.MANAGED_BY}
        assert all(r.headers.get("Authorization") == "Bearer test-token" for r in operator_requests)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = await asyncio.to_thread(proc.communicate, timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, output
    # A clean shutdown gives the lease up: a standby replica takes over at once.
    assert not cluster.get("coordination.k8s.io/v1/leases", "ns1", "persia-operator")["spec"].get("holderIdentity")
    assert "Traceback" not in output, output
