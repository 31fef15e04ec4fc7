"""Real kubectl 1.32 against the e2e stand-in API server (e2e/apiserver.py: discovery, printer
columns, watches, owner-reference garbage collection), with the real kopf operator running
in-process (operator_testkit.OperatorThread). No kubelet: the tests play the controllers and the
kubelet by writing pods and workload statuses through the API.

`e2e/` is loaded under another package name: in the whole suite `e2e` is tests/e2e (a package
of its own), collected before this directory."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
_ALIAS = "persia_e2e_harness"


def e2e_module(name: str) -> Any:
    """``e2e.<name>``, imported from the repository's e2e/ under a package name of its own."""
    if _ALIAS not in sys.modules:
        spec = importlib.util.spec_from_file_location(_ALIAS, REPO / "e2e" / "__init__.py",
                                                      submodule_search_locations=[str(REPO / "e2e")])  # fmt: skip
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules[_ALIAS] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{_ALIAS}.{name}")


def apply(cluster: Any, *docs: dict[str, Any], check: bool = True) -> str:
    return cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs), check=check)


def get_pj(cluster: Any, namespace: str, *args: str) -> list[list[str]]:
    """`kubectl get pj` rows (split on whitespace), header first."""
    out = cluster.kubectl("get", "pj", "-n", namespace, *args)
    return [line.split() for line in out.strip().splitlines()]


def body(cluster: Any, namespace: str, name: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", "pj", name, "-n", namespace, "-o", "json", check=False)
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        return None


def pods_for(cluster: Any, namespace: str, job: str, status: dict[str, Any]) -> list[str]:
    """Create the pods of every live workload of ``job`` (as its controller and the kubelet
    would), named with the attempt, owned by their workload."""
    from operator_testkit import pod_body
    from persia_operator import constants as C

    api = cluster.api
    pods = api.type_of("", "v1", "pods")
    names = []
    for plural, group in (("statefulsets", "apps"), ("jobs", "batch"), ("deployments", "apps")):
        for w in cluster.list(plural, namespace, group=group, version="v1"):
            meta = w["metadata"]
            if (meta.get("labels") or {}).get(C.LABEL_JOB) != job or meta.get("deletionTimestamp"):
                continue
            count = w["spec"].get("replicas", w["spec"].get("completions", 1))
            for i in range(count):
                name = f"{meta['name']}-a{meta['labels'].get(C.LABEL_ATTEMPT, 'x')}-{i}"
                if cluster.get("pods", namespace, name) is None:
                    pod = pod_body(w, i, status)
                    pod["metadata"]["name"] = name
                    pod["metadata"]["ownerReferences"] = [{"apiVersion": w["apiVersion"], "kind": w["kind"],
                                                           "name": meta["name"], "uid": meta["uid"], "controller": True}]  # fmt: skip
                    cluster.call(lambda pod=pod: api.create(pods, namespace, pod))
                names.append(name)
    return names


def set_pod_status(cluster: Any, namespace: str, name: str, status: dict[str, Any]) -> None:
    api = cluster.api
    pods = api.type_of("", "v1", "pods")
    cluster.call(lambda: api.patch(pods, namespace, name, {"status": status}, "application/merge-patch+json",
                                   subresource="status"))  # fmt: skip
