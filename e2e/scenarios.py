"""Steps the scenarios share, everything through kubectl where a user would use it.

`PjWatch` polls `kubectl get pj <name> --no-headers` and keeps every distinct line, so a
scenario can show the printer columns moving (Pending -> Running -> Succeeded).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .cluster import Cluster, KubectlError, wait_until

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "adult-income" / "persiajob.yaml"
SEED = REPO / "examples" / "k8s" / "adult-income.train.yaml"
EXTERNAL_NATS = Path(__file__).resolve().parent / "manifests" / "persia-nats.yaml"
CHECKPOINT_PVC = Path(__file__).resolve().parent / "manifests" / "checkpoint-pvc.yaml"
AUC = re.compile(r"test AUC ([0-9.]+)")


def example_manifest(name: str, **spec_changes: object) -> str:
    """examples/adult-income/persiajob.yaml under another name (top-level spec keys replaced)."""
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["name"] = name
    body["spec"].update(spec_changes)
    return yaml.safe_dump(body)


@dataclass
class PjWatch:
    cluster: Cluster
    name: str
    namespace: str = "default"
    lines: list[str] = field(default_factory=list)

    def line(self, wide: bool = False) -> str:
        args = ["get", "pj", self.name, "-n", self.namespace, "--no-headers"] + (["-o", "wide"] if wide else [])
        text = " ".join(self.cluster.kubectl(*args).split())
        if not self.lines or self.lines[-1] != text:
            self.lines.append(text)
        return text

    def phase(self) -> str:
        return self.line().split()[1] if len(self.line().split()) > 1 else ""

    def until(self, phases: tuple[str, ...], timeout: float) -> str:
        """Poll until the Phase column is one of `phases`; return that line."""
        wait_until(lambda: self.phase() in phases, timeout,
                   lambda: f"PersiaJob {self.name} to reach {phases} (lines seen: {self.lines})", interval=1.0)
        return self.lines[-1]


def pods_of(cluster: Cluster, job: str, role: str | None = None, namespace: str = "default") -> list[str]:
    selector = f"persia.com/job-name={job}" + (f",persia.com/role={role}" if role else "")
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "name")
    return [line.split("/", 1)[1] for line in out.split()]


def nn_log(cluster: Cluster, job: str, namespace: str = "default") -> str:
    """The NN worker pods' logs, through `kubectl logs` (the harness serves pods/log)."""
    logs = []
    for pod in pods_of(cluster, job, "nn-worker", namespace):
        try:
            logs.append(cluster.kubectl("logs", "-n", namespace, pod))
        except KubectlError:
            pass  # not started yet
    return "\n".join(logs)


def test_auc(log: str) -> float | None:
    found = AUC.findall(log)
    return float(found[-1]) if found else None


test_auc.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def trained_batches(log: str) -> int:
    found = re.findall(r"batch (\d+) loss", log)
    return int(found[-1]) if found else -1


def wait_operator_ready(cluster: Cluster, timeout: float = 120) -> None:
    wait_until(lambda: cluster.kubectl("get", "deploy", "-n", "persia-system", "--no-headers").split()[1:2] == ["1/1"],
               timeout, "the operator Deployment to be ready")  # fmt: skip


def wait_gone(cluster: Cluster, job: str, prefixes: tuple[str, ...], timeout: float, namespace: str = "default") -> None:
    """Until no pod (in the API) and no process (on this machine) of `job` with a name
    starting with one of `prefixes` is left."""
    assert cluster.kubelet is not None

    def gone() -> bool:
        pods = [p for p in pods_of(cluster, job, None, namespace) if p.startswith(prefixes)]
        groups = [g for prefix in prefixes for g in cluster.kubelet.live_groups(namespace, prefix)]
        return not pods and not groups

    wait_until(gone, timeout, f"pods and processes {prefixes} of {job} to be gone", interval=0.5)


@contextlib.contextmanager
def cleanup(cluster: Cluster, *names: str, namespace: str = "default") -> Iterator[None]:
    """Delete these PersiaJobs afterwards, passed or failed, and wait until their pods
    and processes are gone, so that one failed scenario does not fail the next."""
    try:
        yield
    finally:
        for name in names:
            delete_job(cluster, name, namespace)
            wait_gone(cluster, name, (name,), 120, namespace)


def delete_job(cluster: Cluster, name: str, namespace: str = "default", timeout: float = 180) -> None:
    """`kubectl delete pj`, then poll `kubectl get` until the object is gone (its finalizer
    released). kubectl's own wait is not used: on long runs against the stand-in API server
    it has missed the DELETED event (open, see docs/operator.md). On failure the error
    carries the job and the operator's log, to tell a stuck finalizer from a slow one."""
    try:
        cluster.kubectl("delete", "pj", name, "-n", namespace, "--ignore-not-found", "--wait=false")
        wait_until(lambda: "NotFound" in cluster.kubectl("get", "pj", name, "-n", namespace, check=False),
                   timeout, f"PersiaJob {namespace}/{name} to be gone", interval=0.5)  # fmt: skip
    except (KubectlError, AssertionError) as err:
        raise AssertionError(f"deleting PersiaJob {namespace}/{name} failed: {err}\n{diagnostics(cluster, name, namespace)}") from err


def diagnostics(cluster: Cluster, name: str, namespace: str = "default") -> str:
    job = cluster.kubectl("get", "pj", name, "-n", namespace, "-o", "yaml", check=False)
    log = cluster.kubectl("logs", "-n", "persia-system", "deploy/persia-persia-operator", "--tail=80", check=False)
    return f"--- the job:\n{job[:3000]}\n--- the operator's log:\n{log}"
