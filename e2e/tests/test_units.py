"""The harness's pure parts: selectors, Tables and JSONPath, env resolution and the
loopback rewriting, and the controller plans."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest

from e2e import controllers
from e2e.apiserver import parse_path
from e2e.podenv import ConfigError, Rewriter, argv, dns_names, expand, resolve_env
from e2e.strategic import strategic_merge
from e2e.selectors import parse_field_selector, parse_label_selector, selector_from_match
from e2e.tables import human_duration, jsonpath, table


def test_label_selectors():
    labels = {"app": "x", "tier": "db"}
    assert parse_label_selector("app=x,tier in (db,web)")(labels)
    assert not parse_label_selector("app!=x")(labels)
    assert parse_label_selector("!missing,app")(labels)
    assert not parse_label_selector("tier notin (db)")(labels)
    assert parse_label_selector("")(labels)
    with pytest.raises(ValueError, match="labelSelector"):
        parse_label_selector("a in b")


def test_field_selectors_and_match_expressions():
    obj = {"metadata": {"name": "p"}, "involvedObject": {"kind": "PersiaJob"}}
    assert parse_field_selector("metadata.name=p,involvedObject.kind=PersiaJob")(obj)
    assert not parse_field_selector("metadata.name!=p")(obj)
    match = selector_from_match({"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "DoesNotExist"}]})
    assert match({"a": "1"}) and not match({"a": "1", "b": "2"})


def test_api_paths():
    assert parse_path("/api/v1/namespaces") == ("", "v1", "namespaces", None, None, None)
    assert parse_path("/api/v1/namespaces/ns1") == ("", "v1", "namespaces", None, "ns1", None)
    assert parse_path("/api/v1/namespaces/ns1/pods/p/log") == ("", "v1", "pods", "ns1", "p", "log")
    assert parse_path("/apis/persia.com/v1/persiajobs") == ("persia.com", "v1", "persiajobs", None, None, None)
    assert parse_path("/apis/persia.com") is None


def test_printer_columns_table():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    obj = {"metadata": {"name": "j", "creationTimestamp": (now - timedelta(seconds=75)).strftime("%Y-%m-%dT%H:%M:%SZ")},
           "status": {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"},
                                                        {"type": "Failed", "status": "True"}]}}  # fmt: skip
    cols = [{"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            {"name": "Failed", "type": "string", "priority": 1, "jsonPath": '.status.conditions[?(@.type=="Failed")].status'},
            {"name": "Ready", "type": "string", "jsonPath": ".status.replicaStatuses.nnWorker.readyRatio"}]  # fmt: skip
    t = table("PersiaJob", [obj], cols, "7", now=now)
    assert [c["name"] for c in t["columnDefinitions"]] == ["Name", "Phase", "Age", "Failed", "Ready"]
    assert t["columnDefinitions"][3]["priority"] == 1
    assert t["rows"][0]["cells"] == ["j", "Failed", "75s", "True", None]
    assert jsonpath({"a": [{"b": 1}, {"b": 2}]}, ".a[1].b") == [2]
    assert [human_duration(s) for s in (5, 130, 3600 * 5, 86400 * 3)] == ["5s", "2m10s", "5h", "3d"]


def test_env_resolution_in_kubernetes_order():
    pod = {"metadata": {"name": "p-0", "namespace": "ns", "labels": {"apps.kubernetes.io/pod-index": "0"},
                        "annotations": {"a": "b"}}, "spec": {}}  # fmt: skip
    secret = {"data": {"pw": base64.b64encode(b"s3cret").decode()}}
    container = {
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "INDEX", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "URL", "value": "x-$(INDEX)-$(LATER)-$$(INDEX)"},
            {"name": "LATER", "value": "l"},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "pw"}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
        "resources": {"limits": {"cpu": "1500m"}},
        "command": ["run"], "args": ["--i", "$(INDEX)", "$(NAME)"],
    }  # fmt: skip
    env = resolve_env(pod, container, {"cm": {"data": {"K": "v"}}}, {"sec": secret}, {"BASE": "1"})
    assert env == {"BASE": "1", "CM_K": "v", "INDEX": "0", "NAME": "p-0", "URL": "x-0-$(LATER)-$(INDEX)", "LATER": "l",
                   "PW": "s3cret", "CPU": "2"}  # fmt: skip
    assert argv(container, ["entry"], env) == ["run", "--i", "0", "p-0"]
    assert argv({"args": ["-c", "x"]}, ["nats-server"], env) == ["nats-server", "-c", "x"]
    with pytest.raises(ConfigError, match='configmap "gone" not found'):
        resolve_env(pod, {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k"}}}]}, {}, {})
    assert expand("$(A)$$(A)$(B)", {"A": "1"}) == "1$(A)$(B)"


def test_rewriter_maps_services_ports_and_paths():
    rw = Rewriter(dns={name: {4222: 31000} for name in dns_names("nats", "ns", "ns")}, own={8888: 32000, 9090: 32001},
                  paths={"/opt/persia/examples": "/repo/examples", "/etc/persia": "/pod/vol"})  # fmt: skip
    assert rw.text("nats://nats.ns.svc:4222") == "nats://127.0.0.1:31000"
    assert rw.text("nats://nats:4222,nats://other:4222") == "nats://127.0.0.1:31000,nats://other:4222"
    assert rw.value("8888") == "32000" and rw.value("--port=9090") == "--port=32001" and rw.value("80") == "80"
    assert rw.text("http://0.0.0.0:9090/healthz") == "http://0.0.0.0:32001/healthz"
    assert rw.text("/opt/persia/examples/a/train.py") == "/repo/examples/a/train.py"
    assert rw.text("/opt/persia/examples2") == "/opt/persia/examples2"
    assert rw.text('pid_file: "/etc/persia/x.pid"') == 'pid_file: "/pod/vol/x.pid"'
    # A host directory put in is not rewritten again by a shorter mount (`/tmp` emptyDir).
    nested = Rewriter(paths={"/checkpoints": "/tmp/e2e/pvc/claim", "/tmp": "/tmp/e2e/pod/tmp"})
    assert nested.text("/checkpoints/job") == "/tmp/e2e/pvc/claim/job"
    assert nested.text("/tmp/x") == "/tmp/e2e/pod/tmp/x"
    assert "nats" not in dns_names("nats", "other", "ns")  # short names only in the pod's own namespace


def _workload(kind: str, spec: dict, status: dict | None = None) -> dict:
    template = {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    return {"apiVersion": "apps/v1" if kind != "Job" else "batch/v1", "kind": kind,
            "metadata": {"name": "w", "namespace": "ns", "uid": "u1", "generation": 1},
            "spec": {**spec, "template": template}, "status": status or {}}  # fmt: skip


def _pod(name: str, phase: str, ready: bool = False, restarts: int = 0, index: int | None = None) -> dict:
    meta = {"name": name, "labels": {}, "annotations": {}}
    if index is not None:
        meta["annotations"]["batch.kubernetes.io/job-completion-index"] = str(index)
    return {"metadata": meta, "status": {"phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"restartCount": restarts}]}}  # fmt: skip


def test_statefulset_plan():
    sts = _workload("StatefulSet", {"replicas": 2, "serviceName": "svc"})
    plan = controllers.plan_statefulset(sts, [_pod("w-0", "Running", True), _pod("w-2", "Running")])
    assert [p["metadata"]["name"] for p in plan.create] == ["w-1"]
    created = plan.create[0]
    assert created["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "1"
    assert created["spec"]["hostname"] == "w-1" and created["spec"]["subdomain"] == "svc"
    assert created["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert plan.delete == ["w-2"]
    assert plan.status["readyReplicas"] == 1 and plan.status["replicas"] == 2


def test_indexed_job_plan():
    job = _workload("Job", {"completionMode": "Indexed", "completions": 2, "backoffLimit": 0})
    plan = controllers.plan_job(job, [_pod("w-0-a", "Succeeded", index=0)])
    assert len(plan.create) == 1
    pod = plan.create[0]
    assert pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == "1"
    assert pod["spec"]["containers"][0]["env"][0]["name"] == "JOB_COMPLETION_INDEX"
    assert plan.status["succeeded"] == 1 and plan.status["completedIndexes"] == "0"
    done = controllers.plan_job(job, [_pod("w-0-a", "Succeeded", index=0), _pod("w-1-b", "Succeeded", index=1)])
    assert [c["type"] for c in done.status["conditions"]] == ["SuccessCriteriaMet", "Complete"]
    failed = controllers.plan_job(job, [_pod("w-0-a", "Failed", index=0), _pod("w-1-b", "Running", index=1)])
    assert failed.delete == ["w-1-b"] and failed.status["conditions"][-1]["reason"] == "BackoffLimitExceeded"


def test_deployment_plan_replaces_pods_of_an_old_template():
    dep = _workload("Deployment", {"replicas": 1, "strategy": {"type": "Recreate"}})
    plan = controllers.plan_deployment(dep, [])
    assert len(plan.create) == 1
    current = plan.create[0]
    current["status"] = {"phase": "Running"}
    old = _pod("w-old", "Running")
    old["metadata"]["labels"]["pod-template-hash"] = "old"
    plan = controllers.plan_deployment(dep, [old])
    assert plan.delete == ["w-old"] and plan.create == []  # Recreate: the old pod goes first


def test_strategic_merge_keeps_what_kubectl_apply_leaves_out():
    live = {"metadata": {"finalizers": ["a"]}, "spec": {"template": {"spec": {"containers": [
        {"name": "op", "image": "i", "command": ["run"], "args": ["--interval", "2"],
         "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
        {"name": "side", "image": "s"}]}}}}  # fmt: skip
    patch = {"metadata": {"finalizers": ["b"], "$deleteFromPrimitiveList/finalizers": ["a"]},
             "spec": {"template": {"spec": {
                 "$setElementOrder/containers": [{"name": "op"}, {"name": "side"}],
                 "containers": [{"name": "op", "args": ["--interval", "3"],
                                 "env": [{"name": "A", "$patch": "delete"}, {"name": "C", "value": "3"}]}]}}}}  # fmt: skip
    out = strategic_merge(live, patch)
    op, side = out["spec"]["template"]["spec"]["containers"]
    assert op["image"] == "i" and op["command"] == ["run"] and op["args"] == ["--interval", "3"]
    assert op["env"] == [{"name": "B", "value": "2"}, {"name": "C", "value": "3"}]
    assert side == {"name": "side", "image": "s"}
    assert out["metadata"]["finalizers"] == ["b"]


def test_discovery_and_lists_as_kubectl_reads_them():
    from e2e.apiserver import ApiServer

    api = ApiServer()
    core = api._discovery("/api/v1")
    assert core["groupVersion"] == "v1"  # not "/v1", which kubectl's RESTMapper drops
    api.create(api.types[("", "v1", "namespaces")], None, {"metadata": {"name": "default"}})
    crd = {"metadata": {"name": "persiajobs.persia.com"}, "spec": {
        "group": "persia.com", "scope": "Namespaced",
        "names": {"plural": "persiajobs", "singular": "persiajob", "kind": "PersiaJob", "shortNames": ["pj"],
                  "categories": ["persia"]},
        "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}}}]}}  # fmt: skip
    api.create(api.types[("apiextensions.k8s.io", "v1", "customresourcedefinitions")], None, crd)
    main, status = api._discovery("/apis/persia.com/v1")["resources"]
    assert (main["name"], main["singularName"], main["shortNames"], main["categories"]) == (
        "persiajobs", "persiajob", ["pj"], ["persia"])
    assert status["name"] == "persiajobs/status" and "shortNames" not in status and "categories" not in status
    t = api.type_of("persia.com", "v1", "persiajobs")
    a = api.create(t, "default", {"metadata": {"generateName": "job-"}, "spec": {"x": 1}})
    assert a["metadata"]["name"].startswith("job-") and a["metadata"]["uid"] and a["metadata"]["generation"] == 1
    b = api.patch(t, "default", a["metadata"]["name"], {"spec": {"x": 2}}, "application/merge-patch+json")
    assert b["metadata"]["generation"] == 2 and int(b["metadata"]["resourceVersion"]) > int(a["metadata"]["resourceVersion"])
    c = api.patch(t, "default", a["metadata"]["name"], {"status": {"phase": "Running"}}, "application/merge-patch+json")
    assert "status" not in c  # the main resource does not write the status subresource
