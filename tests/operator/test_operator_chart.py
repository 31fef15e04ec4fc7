"""The Helm chart, linted and rendered offline with helm_python (Helm's Go library) and
validated with kubernetes-validate for 1.30. Nothing is installed: RBAC is checked by
reading the rules, not by using them."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_testkit import REPO

from persia_operator.cli import build_parser
from persia_operator.config import OperatorConfig
from persia_operator.crdgen import crd_yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Linux x86-64 wheels only)")

CHART = REPO / "charts" / "persia-operator"

NEEDED = {
    ("persia.com", "persiajobs"): {"get", "list", "watch", "patch", "delete"},
    ("persia.com", "persiajobs/status"): {"get", "patch"},
    ("persia.com", "persiajobs/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "delete"},
    ("apps", "statefulsets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("batch", "jobs"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "events"): {"create"},
}


def render(values: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values=values, name="demo", namespace="persia-system", is_install=True)
    docs = [d for path, text in out.items() if path.endswith(".yaml") and text.strip()
            for d in yaml.safe_load_all(text) if d]  # fmt: skip
    notes = next((text for path, text in out.items() if path.endswith("NOTES.txt")), "")
    return docs, notes


def test_lint_strict():
    report = helm.lint(str(CHART), strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + list(report["errors"])
    assert not problems, report


@pytest.mark.parametrize(
    "values",
    [{}, {"watchNamespace": "ml"}, {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}},
     {"image": {"repository": "registry.local/persia-operator", "tag": "v9"}, "verbose": True,
      "nodeSelector": {"role": "ops"}, "tolerations": [{"key": "ops", "operator": "Exists"}],
      "extraEnv": [{"name": "PERSIA_OPERATOR_REQUEST_TIMEOUT", "value": "30"}]}],
    ids=["cluster-wide", "namespaced", "no-rbac", "customised"],
)  # fmt: skip
def test_rendered_manifests_validate(values):
    docs, notes = render(values)
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    kinds = {d["kind"] for d in docs}
    assert "Deployment" in kinds
    assert "kubectl get persiajobs" in notes and "kubectl apply --server-side -f" in notes


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment")


def test_deployment_is_a_single_recreated_replica_with_liveness():
    docs, _ = render({})
    deployment = _deployment(docs)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "persiaml/persia-operator:0.1.0"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The arguments and env are what the operator's CLI and config understand.
    args = build_parser().parse_args(container["args"])
    assert args.command == "run" and args.all_namespaces and args.interval == 10
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    env = {e["name"]: e["value"] for e in container["env"]}
    config = OperatorConfig.from_env(env)
    assert (config.watch_server_timeout, config.watch_client_timeout) == (300, 330)


def _rules(docs: list[dict[str, Any]], kind: str) -> dict[tuple[str, str], set[str]]:
    role = next(d for d in docs if d["kind"] == kind)
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_cluster_wide_install_uses_a_cluster_role():
    docs, _ = render({})
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    granted = _rules(docs, "ClusterRole")
    for key, verbs in NEEDED.items():
        assert verbs <= granted.get(key, set()), key
    # Least privilege: nothing on secrets, CRDs or pods/exec; pods are read-only.
    assert not {r for _, r in granted} & {"secrets", "customresourcedefinitions", "pods/exec"}
    assert granted[("", "pods")] == {"get", "list", "watch"}
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-persia-operator", "namespace": "persia-system"}]
    args = _deployment(docs)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args


def test_namespaced_install_uses_a_role_in_that_namespace():
    docs, notes = render({"watchNamespace": "ml"})
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = next(d for d in docs if d["kind"] == "Role")
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ml"
    assert binding["subjects"][0]["namespace"] == "persia-system"
    for key, verbs in NEEDED.items():
        assert verbs <= _rules(docs, "Role").get(key, set()), key
    args = build_parser().parse_args(_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.namespace == ["ml"] and not args.all_namespaces
    assert "namespace ml only" in notes


def test_values_schema_rejects_bad_values():
    with helm.Chart.load(str(CHART)) as chart:
        for bad in ({"reconcileInterval": "often"}, {"watchNamespace": "Not_A_Namespace"},
                    {"image": {"repository": "x", "pullPolicy": "Sometimes"}}, {"replicaCount": 2}):  # fmt: skip
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


def test_chart_ships_the_generated_crd():
    with helm.Chart.load(str(CHART)) as chart:
        crds = list(chart.crds)
    assert len(crds) == 1
    data = crds[0]["data"] if isinstance(crds[0], dict) else crds[0]
    text = data.decode() if isinstance(data, bytes) else data
    assert text == crd_yaml()
    kubernetes_validate.validate(yaml.safe_load(text), "1.30", strict=True)
