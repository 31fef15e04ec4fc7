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


VALUES = {
    "cluster-wide": {},
    "namespaced": {"watchNamespace": "ml"},
    "several-namespaces": {"watchNamespaces": ["ml", "ads"]},
    "no-rbac": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}},
    "no-leader-election": {"leaderElection": {"enabled": False}},
    "monitors": {"metrics": {"service": {"enabled": True}, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                             "podMonitor": {"enabled": True}}},
    "dashboards": {"dashboards": {"enabled": True}},
    "no-hooks-no-aggregation": {"hooks": {"preDelete": {"enabled": False}}, "rbac": {"aggregate": False}},
    "customised": {"image": {"repository": "registry.local/persia-operator", "tag": "v9"}, "verbose": True,
                   "nodeSelector": {"role": "ops"}, "tolerations": [{"key": "ops", "operator": "Exists"}],
                   "extraEnv": [{"name": "PERSIA_OPERATOR_REQUEST_TIMEOUT", "value": "30"}], "replicaCount": 3},
}  # fmt: skip
# prometheus-operator kinds are not in Kubernetes' schemas: checked by hand below.
CRD_KINDS = {"ServiceMonitor", "PodMonitor"}


@pytest.mark.parametrize("values", list(VALUES.values()), ids=list(VALUES))
def test_rendered_manifests_validate(values):
    docs, notes = render(values)
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, "1.30", strict=True)
    kinds = {d["kind"] for d in docs}
    assert "Deployment" in kinds
    assert "kubectl get persiajobs" in notes and "kubectl apply --server-side -f" in notes


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment")


def test_deployment_runs_replicas_with_one_leader_and_liveness():
    docs, _ = render({"replicaCount": 2})
    deployment = _deployment(docs)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate"}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert build_parser().parse_args(container["args"]).leader_elect
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    assert _deployment(render({})[0])["spec"]["replicas"] == 1  # the default: set 2 for a standby
    single = _deployment(render({"leaderElection": {"enabled": False}, "replicaCount": 3})[0])
    assert single["spec"]["replicas"] == 1 and single["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in single["spec"]["template"]["spec"]["containers"][0]["args"]
    assert container["image"] == "persiaml/persia-operator:0.1.0"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The arguments and env are what the operator's CLI and config understand.
    args = build_parser().parse_args(container["args"])
    assert args.command == "run" and args.all_namespaces and args.interval == 10
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["POD_NAMESPACE"] = "persia-system"  # from the downward API
    config = OperatorConfig.from_env(env)
    assert (config.watch_server_timeout, config.watch_client_timeout) == (300, 330)
    assert (config.metrics_port, config.lease_name, config.lease_namespace) == (8081, "demo-persia-operator", "persia-system")
    assert (config.lease_duration, config.renew_period, config.retry_period) == (15, 5, 2)


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
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Role"] == ["demo-persia-operator-leader"]
    granted = _rules(docs, "ClusterRole")
    # Least privilege: nothing on CRDs or pods/exec; pods are read-only; Secrets are never listed.
    assert not {r for _, r in granted} & {"customresourcedefinitions", "pods/exec"}
    assert granted[("", "pods")] == {"list", "watch"}
    assert granted[("", "secrets")] == {"get", "create"}
    binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-persia-operator", "namespace": "persia-system"}]
    args = _deployment(docs)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args
    leader = next(d for d in docs if d["kind"] == "Role")
    assert leader["metadata"]["namespace"] == "persia-system"
    assert leader["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}]


@pytest.mark.parametrize("values, namespaces", [({"watchNamespace": "ml"}, ["ml"]),
                                                ({"watchNamespaces": ["ml", "ads"]}, ["ml", "ads"])])  # fmt: skip
def test_namespaced_install_uses_a_role_in_each_namespace(values, namespaces):
    docs, notes = render(values)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"] == ["demo-persia-operator-edit",
                                                                                  "demo-persia-operator-view"]  # fmt: skip
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    roles = [d for d in docs if d["kind"] == "Role" and not d["metadata"]["name"].endswith("-leader")]
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and not d["metadata"]["name"].endswith("-leader")]
    assert [r["metadata"]["namespace"] for r in roles] == [b["metadata"]["namespace"] for b in bindings] == namespaces
    assert all(b["subjects"][0]["namespace"] == "persia-system" for b in bindings)
    cluster_rules = _rules(render({})[0], "ClusterRole")
    assert all(_rules([r], "Role") == cluster_rules for r in roles)  # the same rules, per namespace
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            args = build_parser().parse_args(d["spec"]["template"]["spec"]["containers"][0]["args"])
            assert args.namespace == namespaces and not args.all_namespaces
    assert f"namespace {', '.join(namespaces)} only" in notes


def test_aggregated_cluster_roles_for_edit_and_view():
    docs, _ = render({})
    edit = next(d for d in docs if d["metadata"]["name"] == "demo-persia-operator-edit")
    view = next(d for d in docs if d["metadata"]["name"] == "demo-persia-operator-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "delete", "patch"} <= _rules([edit], "ClusterRole")[("persia.com", "persiajobs")]
    assert _rules([view], "ClusterRole")[("persia.com", "persiajobs")] == {"get", "list", "watch"}


def test_pre_delete_hook_releases_finalizers_with_the_operator_account():
    docs, notes = render({})
    hook = next(d for d in docs if d["kind"] == "Job")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = hook["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-persia-operator"
    args = build_parser().parse_args(pod["containers"][0]["args"])
    assert args.command == "release-finalizers" and args.all_namespaces
    assert "pre-delete hook" in notes
    assert not [d for d in render({"hooks": {"preDelete": {"enabled": False}}})[0] if d["kind"] == "Job"]


def test_monitors_are_off_by_default_and_scrape_the_metrics_port():
    assert not CRD_KINDS & {d["kind"] for d in render({})[0]}
    docs, _ = render(VALUES["monitors"])
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics" and monitor["metadata"]["labels"]["release"] == "prom"
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["ports"][0] == {"name": "metrics", "port": 8081, "targetPort": "metrics"}
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    pod_monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_values_schema_rejects_bad_values():
    with helm.Chart.load(str(CHART)) as chart:
        for bad in ({"reconcileInterval": "often"}, {"watchNamespace": "Not_A_Namespace"},
                    {"image": {"repository": "x", "pullPolicy": "Sometimes"}}, {"replicaCount": 0},
                    {"watchNamespaces": ["Bad_NS"]}, {"metrics": {"serviceMonitor": {"enabled": "yes"}}}):  # fmt: skip
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


def test_dashboards_config_map_carries_the_dashboard_json():
    import json

    docs, _ = render({"dashboards": {"enabled": True}})
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(config_map["data"]["persia-operator.json"])
    assert board == json.loads((CHART / "dashboards" / "persia-operator.json").read_text())


def test_the_chart_needs_the_kubernetes_whose_api_takes_what_the_operator_renders():
    """The PS and embedding workers get a `preStop: sleep` hook, off by default before 1.30: an
    older API server drops it and refuses the StatefulSet ("must specify a handler type")."""
    from persia_operator.job import PersiaJob
    from persia_operator.render import render
    from persia_operator.spec import validate_job
    from operator_testkit import job_body

    chart = yaml.safe_load((REPO / "charts/persia-operator/Chart.yaml").read_text())
    meta, spec = validate_job(job_body())
    hooks = [c.get("lifecycle", {}).get("preStop", {}) for m in render(PersiaJob(metadata=meta, spec=spec))
             if m["kind"] == "StatefulSet" for c in m["spec"]["template"]["spec"]["containers"]]
    assert any("sleep" in h for h in hooks)
    assert chart["kubeVersion"] == ">=1.30.0-0"


def test_only_the_operators_pods_match_its_selectors():
    """The pre-delete hook's pod carried the operator's selector labels, so the metrics Service
    and PodMonitor took it (no metrics port) for an operator pod during an uninstall."""
    docs, _ = render(VALUES["monitors"])
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    for d in docs:
        if d["kind"] in ("Job", "Deployment"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            matches = all(labels.get(k) == v for k, v in selector.items())
            assert matches == (d is deployment), (d["kind"], d["metadata"]["name"], labels)
    for d in docs:
        if d["kind"] in ("Service", "PodMonitor"):
            chosen = d["spec"]["selector"].get("matchLabels", d["spec"]["selector"])
            assert chosen == selector, d["kind"]
