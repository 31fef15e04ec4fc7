"""The scenarios on a real kind cluster (`e2e/kind/run.sh`, `make e2e-kind`).

Not run on the CI machine (no docker engine, no kind): written against the same kubectl
commands as the stand-in scenarios, with what only a real cluster has in place of the
harness's shortcuts: images built with docker and loaded into kind, the chart installed
with Helm, a PS killed with SIGKILL on the kind node, and admission (the CRD's schema and
CEL rules may reject the invalid spec before the operator sees it; both are accepted).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from e2e.install import CHART, NAMESPACE, RELEASE, namespace_manifest, render_chart  # noqa: E402
from e2e.scenarios import EXTERNAL_NATS, SEED, example_manifest, test_auc  # noqa: E402

IMAGES = {
    "persiaml/persia-cpu-runtime:0.1.0": "images/runtime-cpu.Dockerfile",
    "persiaml/persia-operator:latest": "images/operator.Dockerfile",
}


def sh(*args: str, stdin: str | None = None, check: bool = True) -> str:
    print("+", " ".join(args), flush=True)
    proc = subprocess.run(args, input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc.stdout + (proc.stderr if not check else "")


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    return sh("kubectl", "--context", f"kind-{CLUSTER}", *args, stdin=stdin, check=check)


def wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout}s waiting for {what}")
        time.sleep(2)
    return value


def phase(name: str) -> str:
    return kubectl("get", "pj", name, "-o", "jsonpath={.status.phase}", check=False).strip()


def nn_log(name: str) -> str:
    return kubectl("logs", "-l", f"persia.com/job-name={name},persia.com/role=nn-worker", "--tail=-1", check=False)


def final_line(name: str) -> str:
    line = " ".join(kubectl("get", "pj", name, "--no-headers").split())
    print(f"[{name}] final `kubectl get pj`: {line}", flush=True)
    return line


CLUSTER = "persia-e2e"


def main() -> int:
    global CLUSTER
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cluster", default=CLUSTER)
    parser.add_argument("--keep", action="store_true", help="keep the kind cluster afterwards")
    args = parser.parse_args()
    CLUSTER = args.cluster
    if CLUSTER not in sh("kind", "get", "clusters"):
        sh("kind", "create", "cluster", "--name", CLUSTER, "--wait", "120s")
    try:
        for tag, dockerfile in IMAGES.items():
            sh("docker", "build", "-f", dockerfile, "-t", tag, str(REPO))
            sh("kind", "load", "docker-image", tag, "--name", CLUSTER)
        # 1. Install: Helm's crds/ first, then the release (helm CLI if present, else helm_python's render).
        if shutil.which("helm"):
            sh("helm", "upgrade", "--install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
               "--kube-context", f"kind-{CLUSTER}", "--set", "reconcileInterval=2", "--set", "image.tag=latest", "--wait")
        else:
            kubectl("apply", "-f", str(CHART / "crds"))
            kubectl("apply", "-f", "-", stdin=namespace_manifest(NAMESPACE))
            kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=render_chart({"reconcileInterval": 2, "image": {"tag": "latest"}}))
        kubectl("rollout", "status", "-n", NAMESPACE, f"deploy/{RELEASE}-persia-operator", "--timeout=180s")

        # 2. The example (CPU-only cluster: drop the GPU limit, as kind nodes have none).
        body = yaml.safe_load((REPO / "examples/adult-income/persiajob.yaml").read_text())
        body["spec"]["nnWorker"]["resources"]["limits"].pop("nvidia.com/gpu", None)
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(body))
        wait(lambda: phase("adult-income") in ("Succeeded", "Failed"), 1200, "adult-income to finish")
        assert phase("adult-income") == "Succeeded", nn_log("adult-income")
        auc = test_auc(nn_log("adult-income"))
        assert auc is not None and auc >= 0.89, auc
        final_line("adult-income")
        wait(lambda: not kubectl("get", "sts", "-l", "persia.com/job-name=adult-income", "-o", "name").strip(), 120,
             "servers cleaned up (cleanPodPolicy)")
        kubectl("delete", "pj", "adult-income", "--timeout=180s")

        # 3. PERSIA's manifest, unchanged but for the GPU (kind has none), with an external NATS.
        kubectl("apply", "-f", str(EXTERNAL_NATS))
        kubectl("rollout", "status", "sts/persia-nats", "--timeout=180s")
        seed = yaml.safe_load(SEED.read_text())
        seed["spec"]["nnWorker"]["resources"]["limits"].pop("nvidia.com/gpu", None)
        kubectl("apply", "-f", "-", stdin=yaml.safe_dump(seed))
        wait(lambda: phase("adult-income") in ("Succeeded", "Failed"), 1200, "the seed manifest's job to finish")
        final_line("adult-income")
        kubectl("delete", "pj", "adult-income", "--timeout=180s")

        # 4. A PS process SIGKILLed on the node mid-training: the job restarts and succeeds.
        name = "adult-income-ft"
        kubectl("apply", "-f", "-", stdin=example_manifest(name, nnWorker={"replicas": 1, "nprocPerNode": 1}))
        wait(lambda: re.search(r"batch [5-9]\d loss|batch \d{3,} loss", nn_log(name)), 900, "training past batch 50")
        sh("docker", "exec", f"{CLUSTER}-control-plane", "pkill", "-KILL", "-f", "embedding-parameter-server")
        wait(lambda: kubectl("get", "pj", name, "-o", "jsonpath={.status.restartCount}").strip() == "1", 300, "a restart")
        wait(lambda: phase(name) in ("Succeeded", "Failed"), 1200, f"{name} to finish")
        assert phase(name) == "Succeeded"
        final_line(name)
        kubectl("delete", "pj", name, "--timeout=180s")

        # 5. Invalid spec: rejected at admission (schema/CEL) or Failed/InvalidSpec by the operator.
        bad = "adult-income-invalid"
        out = kubectl("apply", "-f", "-", stdin=example_manifest(bad, nnWorker={"replicas": 0, "nprocPerNode": 1}), check=False)
        if "Invalid" not in out:
            wait(lambda: phase(bad) == "Failed", 120, "InvalidSpec")
            assert "InvalidSpec" in kubectl("get", "pj", bad, "-o", "wide")
            assert "InvalidSpec" in kubectl("describe", "pj", bad)
            kubectl("delete", "pj", bad)
        name = "adult-income-suspend"
        kubectl("apply", "-f", "-", stdin=example_manifest(name, nnWorker={"replicas": 1, "nprocPerNode": 1}))
        wait(lambda: phase(name) == "Running", 600, "running")
        kubectl("patch", "pj", name, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}')
        wait(lambda: not kubectl("get", "pods", "-l", f"persia.com/job-name={name}", "-o", "name").strip(), 300, "pods gone")
        kubectl("patch", "pj", name, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":false}}}')
        wait(lambda: re.search(r"batch \d+ loss", nn_log(name)), 900, "training after resume")
        final_line(name)
        kubectl("delete", "pj", name, "--timeout=300s")
        wait(lambda: not kubectl("get", "pods", "-l", f"persia.com/job-name={name}", "-o", "name").strip(), 300,
             "every pod gone")
        print("e2e/kind: all scenarios passed")
        return 0
    finally:
        if not args.keep:
            sh("kind", "delete", "cluster", "--name", CLUSTER, check=False)


if __name__ == "__main__":
    sys.exit(main())
