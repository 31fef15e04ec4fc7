"""Helpers and fixtures for the operator tests: sample jobs, child-state builders, and a real kopf
operator running in-process against KMock (an emulated Kubernetes API).

What KMock cannot check, for every test that uses it: it does no schema or CEL
validation (the tests validate manifests with kubernetes-validate and the CRD schema
separately), no garbage collection by owner references, no label selectors, no PUT, and
it runs no controllers: nothing creates pods for a StatefulSet or a Job and nothing
updates workload status. The tests play the kubelet and the controllers by writing pods
and statuses themselves.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest_asyncio
import yaml

from persia_operator import constants as C
from persia_operator.config import OperatorConfig
from persia_operator.handlers import register, run_kwargs
from persia_operator.children import Children
from persia_operator.job import JobStatus, PersiaJob
from persia_operator.reconciler import Reconciler
from persia_operator.render import render
from persia_operator.spec import parse_spec
from persia_operator.status import derive_status, ObservedJob

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "k8s" / "adult-income.train.yaml"

PJ = f"{C.GROUP}/{C.VERSION}/{C.PLURAL}"
RESOURCES = {
    PJ: kmock.ResourceInfo(kind=C.KIND, namespaced=True, subresources={"status"}, shortnames={"pj"}),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True),
    "v1/configmaps": kmock.ResourceInfo(kind="ConfigMap", namespaced=True),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(kind="PodDisruptionBudget", namespaced=True),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True),
    "apps/v1/statefulsets": kmock.ResourceInfo(kind="StatefulSet", namespaced=True, subresources={"status"}),
    "apps/v1/deployments": kmock.ResourceInfo(kind="Deployment", namespaced=True, subresources={"status"}),
    "batch/v1/jobs": kmock.ResourceInfo(kind="Job", namespaced=True, subresources={"status"}),
    "coordination.k8s.io/v1/leases": kmock.ResourceInfo(kind="Lease", namespaced=True),
    "scheduling.volcano.sh/v1beta1/podgroups": kmock.ResourceInfo(kind="PodGroup", namespaced=True),
    "scheduling.x-k8s.io/v1alpha1/podgroups": kmock.ResourceInfo(kind="PodGroup", namespaced=True),
    # kopf's start-up waits on these two being discoverable (operator-prior-art.md §6.4).
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False
    ),
}
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


def with_changes(tree: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of ``tree`` with ``a__b__c=value`` set (``None`` removes the key)."""
    out = copy.deepcopy(tree)
    for path, value in changes.items():
        node = out
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return out


def job_body(name: str = "demo", namespace: str = "ns1", **spec_overrides: Any) -> dict[str, Any]:
    """A small valid PersiaJob (managed NATS, inline configs, all four roles)."""
    spec: dict[str, Any] = {
        "persiaEnv": {
            "PERSIA_NN_WORKER_ENTRY": "/workspace/train.py",
            "PERSIA_DATALOADER_ENTRY": "/workspace/data_loader.py",
        },
        "configs": {
            "globalConfig": {"embedding_worker_config": {"forward_buffer_size": 1000}},
            "embeddingConfig": {"slots_config": {"age": {"dim": 8}}},
        },
        "embeddingParameterServer": {"replicas": 2},
        "embeddingWorker": {"replicas": 1},
        "nnWorker": {"replicas": 2, "nprocPerNode": 1},
        "dataloader": {"replicas": 1},
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def example_body() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


class StampingEmulator(kmock.KubernetesEmulator):
    """KMock that stamps what an API server stamps: uid, resourceVersion, generation,
    creationTimestamp, names from generateName. Without resourceVersions kopf cannot
    tell its own patches from others' changes and replays handlers."""

    _versions = itertools.count(1)

    async def _handle(self, request: Any) -> Any:
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            if request.action == kmock.action.CREATE:
                meta = data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                if request.namespace and not meta.get("namespace"):
                    meta["namespace"] = request.namespace
                meta.setdefault("uid", str(uuid.uuid4()))
                meta["resourceVersion"] = str(next(self._versions))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            elif request.action == kmock.action.UPDATE and request.name is not None:
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = str(next(self._versions))
                key = (request.resource, request.namespace, request.name)
                if "spec" in data and request.subresource is None and key in self.objects:
                    current = self.objects[key]
                    if not current.deleted:
                        meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        return await super()._handle(request)


class Cluster:
    """Test-side view of the emulated cluster, playing the kubelet and controllers."""

    def __init__(self, emulator: StampingEmulator):
        self.k = emulator

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.k.objects or self.k.objects[key].deleted:
            return None
        return copy.deepcopy(self.k.objects[key].raw)

    def names(self, resource: str, namespace: str) -> set[str]:
        return {
            name
            for (res, ns, name), obj in self.k.objects.items()
            if str(res) == str(kmock.resource(resource)) and ns == namespace and not obj.deleted
        }

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        headers = {"Content-Type": content_type}
        async with self.k.request(method, path, json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        group, version = (body["apiVersion"].split("/") if "/" in body["apiVersion"] else ("", body["apiVersion"]))
        plural = {"Pod": "pods", C.KIND: C.PLURAL}[body["kind"]]
        base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
        status, data = await self.request("POST", f"{base}/namespaces/{body['metadata']['namespace']}/{plural}", body)
        assert status < 300, data
        return data

    async def patch(self, resource: str, namespace: str, name: str, patch: dict[str, Any], sub: str | None = None) -> Any:
        group_version, plural = resource.rsplit("/", 1)
        base = f"/api/{group_version}" if group_version == "v1" else f"/apis/{group_version}"
        path = f"{base}/namespaces/{namespace}/{plural}/{name}" + (f"/{sub}" if sub else "")
        status, data = await self.request("PATCH", path, patch, "application/merge-patch+json")
        assert status < 300, data
        return data

    async def delete(self, resource: str, namespace: str, name: str) -> int:
        group_version, plural = resource.rsplit("/", 1)
        base = f"/api/{group_version}" if group_version == "v1" else f"/apis/{group_version}"
        status, _ = await self.request("DELETE", f"{base}/namespaces/{namespace}/{plural}/{name}")
        return status

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(PJ, namespace, name)

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return (self.job(namespace, name) or {}).get("status") or {}

    def condition(self, namespace: str, name: str, type_: str) -> dict[str, Any] | None:
        for cond in self.status(namespace, name).get("conditions", []):
            if cond["type"] == type_:
                return cond
        return None

    def events(self, namespace: str) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj.raw)
            for (res, ns, _), obj in self.k.objects.items()
            if str(res) == str(kmock.resource("v1/events")) and ns == namespace and not obj.deleted
        ]

    async def add_pod(self, namespace: str, workload: dict[str, Any], index: int, **status: Any) -> str:
        """A pod of `workload` as its controller would create it, with the given status."""
        template = workload["spec"]["template"]
        name = f"{workload['metadata']['name']}-{index}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": dict(template["metadata"]["labels"]),
            },
            "spec": copy.deepcopy(template["spec"]),
            "status": status or running_pod_status(),
        }
        await self.create(pod)
        return name

    async def set_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self.patch("v1/pods", namespace, name, {"status": status}, sub="status")


def running_pod_status(ready: bool = True) -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"name": "main", "restartCount": 0, "state": {"running": {}}}],
    }


def failed_pod_status(exit_code: int, reason: str = "Error") -> dict[str, Any]:
    return {
        "phase": "Failed",
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [
            {"name": "main", "restartCount": 0, "state": {"terminated": {"exitCode": exit_code, "reason": reason}}}
        ],
    }


def evicted_pod_status() -> dict[str, Any]:
    return {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "The node was low on resource: memory.",
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}],
    }


def succeeded_pod_status() -> dict[str, Any]:
    return {
        "phase": "Succeeded",
        "containerStatuses": [
            {"name": "main", "restartCount": 0, "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
        ],
    }


async def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest_asyncio.fixture()
async def cluster() -> AsyncIterator[Cluster]:
    async with StampingEmulator() as emulator, kmock.Server(emulator):
        for resource, info in RESOURCES.items():
            info.verbs = set(VERBS)
            emulator.resources[resource] = info
        yield Cluster(emulator)


class OperatorThread:
    """The real kopf operator with persia_operator's handlers, in its own thread and
    event loop. kopf cancels every task created in its loop after its start when it
    stops, and a kopf timer re-spawned during shutdown would hold it up; a loop of its
    own keeps the test's tasks out of that, and stopping by cancellation is prompt."""

    def __init__(self, server: str, interval: float = 0.1, liveness: str | None = None,
                 namespaces: list[str] | None = None):  # fmt: skip
        self.registry = kopf.OperatorRegistry()
        self.config = OperatorConfig(reconcile_interval=interval, nats_probe_interval=0.5, liveness=liveness,
                                     namespaces=namespaces or [])
        self.reconciler = register(self.registry, self.config, login=lambda **_: kopf.ConnectionInfo(server=server))
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kopf-operator", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(
            kopf.operator(registry=self.registry, ready_flag=self.ready, **run_kwargs(self.config))
        )
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass
        except BaseException as err:  # surfaced by stop()
            self.error = err
        finally:
            self.loop.run_until_complete(self.reconciler.close())
            self.loop.close()

    async def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.ready.is_set():
            assert time.monotonic() < deadline, "the operator did not start within 30s"
            assert self.thread.is_alive(), f"the operator died at start-up: {self.error!r}"
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.task is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.task.cancel)
        deadline = time.monotonic() + 30
        while self.thread.is_alive():
            assert time.monotonic() < deadline, "the operator did not stop within 30s"
            await asyncio.sleep(0.01)
        assert self.error is None, f"the operator failed: {self.error!r}"


@pytest_asyncio.fixture()
async def operator(cluster: Cluster) -> AsyncIterator[Reconciler]:
    runner = OperatorThread(str(cluster.k.url).rstrip("/"))
    await runner.start()
    try:
        yield runner.reconciler
    finally:
        await runner.stop()


# --- builders for the pure-function tests --------------------------------------------

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
UID = "uid-1"


def with_uid(body: dict[str, Any], uid: str = UID, generation: int = 1) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["metadata"].update(uid=uid, generation=generation)
    return body


def pod_body(manifest: dict[str, Any], index: int, status: dict[str, Any]) -> dict[str, Any]:
    """A pod of a rendered workload manifest, as its controller would create it."""
    template = manifest["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{manifest['metadata']['name']}-{index}",
            "namespace": manifest["metadata"]["namespace"],
            "labels": dict(template["metadata"]["labels"]),
        },
        "spec": copy.deepcopy(template["spec"]),
        "status": copy.deepcopy(status),
    }


def replicas_of(manifest: dict[str, Any]) -> int:
    spec = manifest["spec"]
    return spec.get("replicas", spec.get("completions", 1))


def observe(
    manifests: list[dict[str, Any]],
    pod_status: dict[str, Any] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    workload_status: dict[str, dict[str, Any]] | None = None,
    skip: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Index summaries of `manifests` as if they existed, plus their pods.

    pod_status: the status of every pod (None: no pods). overrides: pod name -> status.
    workload_status: workload name -> its .status. skip: "Kind/name" not to observe."""
    from persia_operator.children import summarize

    summaries = []
    for manifest in manifests:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if f"{kind}/{name}" in skip:
            continue
        body = copy.deepcopy(manifest)
        body["status"] = (workload_status or {}).get(name, {})
        summaries.append(summarize(kind, body))
        if kind in ("StatefulSet", "Job", "Deployment") and pod_status is not None:
            for i in range(replicas_of(manifest)):
                pod = pod_body(manifest, i, pod_status)
                pod["status"] = (overrides or {}).get(pod["metadata"]["name"], pod["status"])
                summaries.append(summarize("Pod", pod))
    jobs = {m["metadata"]["labels"][C.LABEL_JOB] for m in manifests}
    for job in sorted(jobs):  # the generated Secret is not rendered (random content) but exists
        if f"Secret/{job}-auth" not in skip:
            summaries.append({"kind": "Secret", "name": f"{job}-auth", "owner_uid": None})
    return summaries


# --- a job going through reconcile passes (pure) -------------------------------------

RUNNING = {
    "phase": "Running",
    "conditions": [{"type": "Ready", "status": "True"}],
    "containerStatuses": [{"name": "c", "restartCount": 0, "state": {"running": {}}}],
}
PENDING = {
    "phase": "Pending",
    "containerStatuses": [{"name": "c", "restartCount": 0, "state": {"waiting": {"reason": "ImagePullBackOff"}}}],
}


def failed(code: int, reason: str = "Error") -> dict:
    return {"phase": "Failed", "containerStatuses": [
        {"name": "c", "restartCount": 0, "state": {"terminated": {"exitCode": code, "reason": reason}}}]}  # fmt: skip


def restarted(code: int) -> dict:
    """A server pod whose container the kubelet restarted after it exited with `code`."""
    return {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}], "containerStatuses": [
        {"name": "c", "restartCount": 1, "state": {"running": {}},
         "lastState": {"terminated": {"exitCode": code, "reason": "Error"}}}]}  # fmt: skip


EVICTED = {"phase": "Failed", "reason": "Evicted", "message": "low on memory"}


class Sim:
    """A job going through reconcile passes: status feeds back into the next pass."""

    def __init__(self, body: dict | None = None):
        self.body = with_uid(body or job_body())
        self.status = JobStatus()
        self.now = NOW

    def step(self, summaries=(), seconds: float = 1, errors=(), nats=None) -> JobStatus:
        self.now = self.now + timedelta(seconds=seconds)
        job = ObservedJob.from_body({**self.body, "status": self.status.to_wire()})
        self.status = derive_status(job, Children.from_summaries(summaries, owner_uid="uid-1"), self.now, errors, nats)
        return self.status

    def manifests(self) -> list[dict]:
        job = PersiaJob.model_validate(
            {"metadata": self.body["metadata"], "spec": parse_spec(self.status.accepted_spec), "status": self.status}
        )
        return render(job)

    def children(self, pods=RUNNING, **kwargs) -> list[dict]:
        return observe(self.manifests(), pods, **kwargs)

    def running(self) -> "Sim":
        self.step()
        self.step(self.children())
        assert self.status.phase == "Running"
        return self


# --- playing the Kubernetes controllers in KMock tests --------------------------------

WORKLOADS = ("apps/v1/statefulsets", "batch/v1/jobs", "apps/v1/deployments")


def workloads(cluster: Cluster, namespace: str, job: str) -> dict[str, dict[str, Any]]:
    """The job's live StatefulSets/Jobs/Deployments by "Kind/name"."""
    found = {}
    for resource in WORKLOADS:
        for name in cluster.names(resource, namespace):
            body = cluster.get(resource, namespace, name)
            if body and body["metadata"].get("labels", {}).get(C.LABEL_JOB) == job:
                found[f"{body['kind']}/{name}"] = body
    return found


async def start_pods(cluster: Cluster, namespace: str, job: str, status: dict[str, Any] | None = None) -> list[str]:
    """Create the pods of every workload of `job` (as its controller and the kubelet
    would), named with the attempt so that pods of earlier attempts can linger."""
    names = []
    for workload in workloads(cluster, namespace, job).values():
        attempt = workload["metadata"]["labels"].get(C.LABEL_ATTEMPT, "x")
        for i in range(replicas_of(workload)):
            name = f"{workload['metadata']['name']}-a{attempt}-{i}"
            if cluster.get("v1/pods", namespace, name) is None:
                pod = pod_body(workload, i, status or running_pod_status())
                pod["metadata"]["name"] = name
                await cluster.create(pod)
            names.append(name)
    return names


def attempt_of(cluster: Cluster, namespace: str, resource: str, name: str) -> str | None:
    body = cluster.get(resource, namespace, name)
    return None if body is None else body["metadata"]["labels"].get(C.LABEL_ATTEMPT)
