"""The stand-in cluster itself, through real kubectl 1.32: what kubectl needs of the API
server (discovery of a CRD created through the API, printer columns, watches, waits,
generateName, finalizers, garbage collection) and what the process kubelet does with
pods (readiness probes, restarts after SIGKILL, Indexed Jobs, Service names, deletion).

Small workloads (python one-liners), a few seconds in all. What the stand-ins cannot
check is listed in e2e/apiserver.py and e2e/kubelet.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest
import yaml

from e2e.cluster import KUBECTL, Cluster, KubectlError, wait_until
from e2e.scenarios import REPO

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not os.path.exists(KUBECTL), reason="kubectl not installed")]

IMAGE = "persiaml/persia-cpu-runtime:0.1.0"
SERVER = "import http.server, os; http.server.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), http.server.SimpleHTTPRequestHandler).serve_forever()"  # noqa: E501


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("stand-in")) as c:
        yield c
        assert not c.kubelet.errors, c.kubelet.errors


def apply(cluster: Cluster, *docs: dict) -> str:
    return cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))


def test_crd_printer_columns_watch_wait_and_finalizers(cluster):
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    job = {"apiVersion": "persia.com/v1", "kind": "PersiaJob", "metadata": {"name": "j1"},
           "spec": {"nnWorker": {"replicas": 1}, "embeddingWorker": {"replicas": 1},
                    "embeddingParameterServer": {"replicas": 1}}}  # fmt: skip
    assert "created" in apply(cluster, job)
    assert cluster.kubectl("get", "pj").split()[:5] == ["NAME", "PHASE", "READY", "RESTARTS", "AGE"]
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    watcher = subprocess.Popen([KUBECTL, "get", "pj", "j1", "-w", "--no-headers", "--request-timeout=20s"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    waiter = subprocess.Popen([KUBECTL, "wait", "pj/j1", "--for=jsonpath={.status.phase}=Running", "--timeout=20s"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    try:
        first = watcher.stdout.readline()  # the watch is established: the current line
        assert first.split()[0] == "j1", first
        status = {"status": {"phase": "Running", "restartCount": 2, "replicaStatuses": {"nnWorker": {"readyRatio": "1/1"}}}}
        cluster.kubectl("patch", "pj", "j1", "--subresource=status", "--type=merge", "-p", json.dumps(status))
        assert waiter.wait(20) == 0 and "condition met" in waiter.stdout.read()
        update = watcher.stdout.readline()  # the watch event, as a Table row
        assert update.split()[1:4] == ["Running", "1/1", "2"], update
    finally:
        watcher.terminate()
        watcher.communicate(timeout=20)
    # A patch of the main resource does not touch the status (status subresource).
    cluster.kubectl("patch", "pj", "j1", "--type=merge", "-p", '{"status":{"phase":"Failed"},"metadata":{"finalizers":["x/y"]}}')
    assert cluster.kubectl("get", "pj", "j1", "-o", "jsonpath={.status.phase}") == "Running"
    # Deleting keeps the object while a finalizer is on it; removing it completes the deletion.
    cluster.kubectl("delete", "pj", "j1", "--wait=false")
    assert cluster.kubectl("get", "pj", "j1", "-o", "jsonpath={.metadata.deletionTimestamp}")
    cluster.kubectl("patch", "pj", "j1", "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
    with pytest.raises(KubectlError, match="NotFound"):
        cluster.kubectl("get", "pj", "j1")


def test_generate_name_namespaces_and_selectors(cluster):
    apply(cluster, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns2"}})
    event = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "cm-", "namespace": "ns2",
                                                                    "labels": {"tier": "a"}}}  # fmt: skip
    names = {cluster.kubectl("create", "-f", "-", "-o", "name", stdin=yaml.safe_dump(event)).strip() for _ in range(2)}
    assert len(names) == 2 and all(n.startswith("configmap/cm-") for n in names)
    assert cluster.kubectl("get", "cm", "-n", "ns2", "-l", "tier in (a,b)", "-o", "name").split() == sorted(names)
    assert cluster.kubectl("get", "cm", "-n", "ns2", "-l", "tier!=a", "-o", "name") == ""
    assert "ns2" in cluster.kubectl("get", "ns", "-o", "name")


def test_kubelet_runs_readiness_restarts_jobs_and_deletes(cluster):
    labels = {"app": "web"}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web"},
           "spec": {"replicas": 1, "serviceName": "web", "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
                        "name": "web", "image": IMAGE, "command": ["python", "-c", SERVER],
                        "env": [{"name": "PORT", "value": "8080"}], "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}}]}}}}  # fmt: skip
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
           "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": "http"}]}}  # fmt: skip
    # The URL in env is rewritten when the container starts; the one built at run time
    # ("web" + ".default" + ":80") is resolved by the DNS shim when it is used.
    client = ("import os, urllib.request; print('index', os.environ['JOB_COMPLETION_INDEX'], "
              "urllib.request.urlopen(os.environ['URL']).status, "
              "urllib.request.urlopen('http://' + 'web' + '.default' + ':80/').status)")
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "client"},
           "spec": {"completionMode": "Indexed", "completions": 2, "parallelism": 2, "backoffLimit": 0,
                    "template": {"spec": {"restartPolicy": "Never", "containers": [{
                        "name": "client", "image": IMAGE, "command": ["python", "-c", client],
                        "env": [{"name": "URL", "value": "http://web.default.svc:80/"}]}]}}}}  # fmt: skip
    apply(cluster, svc, sts)
    wait_until(lambda: cluster.kubectl("get", "sts", "web", "--no-headers").split()[1] == "1/1", 30, "web ready")
    apply(cluster, job)
    wait_until(lambda: "Complete" in cluster.kubectl("get", "job", "client", "--no-headers"), 60, "the Job to complete")
    logs = [cluster.kubectl("logs", p.split("/")[1]) for p in cluster.kubectl("get", "pods", "-l", "job-name=client",
                                                                              "-o", "name").split()]  # fmt: skip
    assert sorted(logs) == ["index 0 200 200\n", "index 1 200 200\n"]  # through the Service name, to the web pod
    # SIGKILL: the kubelet restarts the container and reports the kill.
    os.kill(cluster.kubelet.pid_of("default", "web-0"), signal.SIGKILL)
    wait_until(lambda: cluster.kubectl("get", "pod", "web-0", "-o", "jsonpath={.status.containerStatuses[0].restartCount}")
               == "1", 30, "the restart to be counted")  # fmt: skip
    last = json.loads(cluster.kubectl("get", "pod", "web-0", "-o", "jsonpath={.status.containerStatuses[0].lastState}"))
    assert last["terminated"]["exitCode"] == 137
    wait_until(lambda: cluster.kubectl("get", "sts", "web", "--no-headers").split()[1] == "1/1", 30, "web ready again")
    # `kubectl apply` of a changed StatefulSet (a strategic merge patch) keeps the container.
    sts["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "EXTRA", "value": "1"})
    assert "configured" in apply(cluster, sts)
    container = json.loads(cluster.kubectl("get", "sts", "web", "-o", "jsonpath={.spec.template.spec.containers[0]}"))
    assert container["image"] == IMAGE and container["command"][0] == "python" and len(container["env"]) == 2
    # Deleting the StatefulSet garbage-collects its pod; the kubelet ends the process.
    cluster.kubectl("delete", "sts", "web", "--timeout=30s")
    wait_until(lambda: cluster.kubectl("get", "pods", "-l", "app=web", "-o", "name") == "", 30, "the pod to go")
    wait_until(lambda: not cluster.kubelet.live_groups("default", "web-"), 30, "the process to end")


def test_kind_script_skips_with_a_message_without_docker_and_kind():
    if shutil.which("kind") and shutil.which("docker"):
        pytest.skip("kind and docker exist here: run `make e2e-kind`")
    proc = subprocess.run([str(REPO / "e2e" / "kind" / "run.sh")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "SKIPPED" in proc.stdout and "kind" in proc.stdout
