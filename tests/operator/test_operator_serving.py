"""spec.serving rendered (persia_operator.serving): inference PS StatefulSet, inference embedding
worker and model server Deployments with probes, Services, the inference global config; scaling
patches replicas; training restarts leave serving alone. Pure rendering and planning: what these
cannot check is a kubelet running the probes (make e2e's stand-in cluster does not render serving
yet)."""

from __future__ import annotations

from datetime import datetime, timezone

import kubernetes_validate
import pytest
import yaml
from operator_testkit import job_body, with_uid

from persia.config import load_global_config_from_dict
from persia.serving.cli import add_serve_parser, config_from_args
from persia_operator import constants as C
from persia_operator.children import Children, summarize
from persia_operator.job import Condition, PersiaJob
from persia_operator.plan import Create, plan_actions
from persia_operator.render import render
from persia_operator.spec import SpecError, validate_job

SERVING = {
    "model": "/checkpoints/demo",
    "embeddingParameterServer": {"replicas": 2, "resources": {"limits": {"memory": "8Gi"}}},
    "embeddingWorker": {"replicas": 2},
    "modelServer": {"replicas": 3, "env": [{"name": "PERSIA_SERVE_MODEL_POLL_SECONDS", "value": "2"}]},
}


def make(body, attempt: int = 0) -> PersiaJob:
    meta, spec = validate_job(body)
    job = PersiaJob(metadata=meta, spec=spec)
    job.status.attempt = attempt
    return job


def serving_body(**serving):
    return with_uid(job_body(
        trainingMode="online", serving={**SERVING, **serving},
        checkpoint={"persistentVolumeClaim": "ckpts"},
        configs={"globalConfig": {"embedding_parameter_server_config": {
            "enable_incremental_update": True, "incremental_dir": "/checkpoints/inc"}},
            "embeddingConfig": {"slots_config": {"age": {"dim": 8}}}}))


def by_key(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def container(manifest):
    return manifest["spec"]["template"]["spec"]["containers"][0]


def test_serving_children_validate_against_kubernetes_1_30():
    children = by_key(render(make(serving_body())))
    serving = {k for k in children if "infer" in k[1] or "model-server" in k[1] or "serving" in k[1]}
    assert serving == {
        ("ConfigMap", "demo-serving-config"),
        ("Service", "demo-infer-ps"), ("StatefulSet", "demo-infer-ps"),
        ("Service", "demo-infer-ew"), ("Deployment", "demo-infer-ew"),
        ("Service", "demo-model-server"), ("Deployment", "demo-model-server"),
    }  # fmt: skip
    for key in serving:
        kubernetes_validate.validate(children[key], "1.30", strict=True)
        assert C.LABEL_ATTEMPT not in children[key]["metadata"]["labels"]  # survives training restarts


def test_replicas_probes_and_the_prediction_service():
    children = by_key(render(make(serving_body())))
    ms = children[("Deployment", "demo-model-server")]
    assert ms["spec"]["replicas"] == 3
    c = container(ms)
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    svc = children[("Service", "demo-model-server")]["spec"]
    assert {p["name"]: p["port"] for p in svc["ports"]} == {"http": 8080, "grpc": 8081}
    assert "clusterIP" not in svc  # a normal, load-balanced Service
    ps = children[("StatefulSet", "demo-infer-ps")]
    assert ps["spec"]["replicas"] == 2 and ps["spec"]["serviceName"] == "demo-infer-ps"
    assert container(ps)["readinessProbe"]["tcpSocket"] == {"port": "rpc"}
    assert container(ps)["resources"] == {"limits": {"memory": "8Gi"}}
    assert children[("Service", "demo-infer-ps")]["spec"]["clusterIP"] == "None"
    assert children[("Deployment", "demo-infer-ew")]["spec"]["replicas"] == 2
    # checkpoints readable by the PS and the model server
    assert {"name": "persia-checkpoints", "mountPath": "/checkpoints", "readOnly": True} in c["volumeMounts"]


def test_the_model_server_command_line_is_what_persia_launcher_serve_accepts():
    ms = by_key(render(make(serving_body())))[("Deployment", "demo-model-server")]
    args = container(ms)["args"]
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="role"))
    cfg = config_from_args(parser.parse_args(args), env={"PERSIA_BIND_ADDRESS": "10.1.2.3"})
    assert cfg.model == "/checkpoints/demo"
    assert cfg.embedding_workers == ["demo-infer-ew.ns1.svc:8887"]
    assert (cfg.http_port, cfg.grpc_port) == (8080, 8081)
    env = {e["name"]: e for e in container(ms)["env"]}
    assert env["PERSIA_BIND_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PERSIA_SERVE_MODEL_POLL_SECONDS"]["value"] == "2"
    assert "PERSIA_NATS_URL" not in env  # serving needs no NATS


def test_the_inference_config_is_a_valid_runtime_config_that_keeps_incremental_settings():
    cm = by_key(render(make(serving_body(embeddingCheckpoint="/checkpoints/demo/ckpt-000000000100"))))[
        ("ConfigMap", "demo-serving-config")]
    raw = yaml.safe_load(cm["data"]["global_config.yml"])
    gc = load_global_config_from_dict(raw)  # the runtime's own parser, unknown keys are errors
    assert gc.common_config.job_type == "Infer"
    assert gc.common_config.infer_config.servers == [
        "demo-infer-ps-0.demo-infer-ps.ns1.svc:8888", "demo-infer-ps-1.demo-infer-ps.ns1.svc:8888"]
    assert gc.common_config.infer_config.embedding_checkpoint == "/checkpoints/demo/ckpt-000000000100"
    assert gc.embedding_parameter_server_config.enable_incremental_update is True
    assert gc.embedding_parameter_server_config.incremental_dir == "/checkpoints/inc"


def test_plan_creates_serving_and_scales_it_in_place():
    body = serving_body()
    meta, spec = validate_job(body)
    job = make(body)
    job.status.accepted_spec = spec.to_wire()
    actions = plan_actions(meta, job.status, Children.from_summaries([]), datetime.now(timezone.utc),
                           token=lambda: "t")
    created = {(a.manifest["kind"], a.manifest["metadata"]["name"]) for a in actions if isinstance(a, Create)}
    assert ("Deployment", "demo-model-server") in created and ("StatefulSet", "demo-infer-ps") in created
    # everything exists, but the model servers were scaled: one patch of their replicas, nothing else
    existing = [summarize(c["kind"], c) for c in render(job)]
    for summary in existing:
        if summary["name"] == "demo-model-server":
            summary["replicas"] = 1
    existing.append({"kind": "Secret", "name": "demo-auth", "role": "auth", "owner_uid": None, "deleting": False})
    children = Children.from_summaries(existing)
    actions = [a for a in plan_actions(meta, job.status, children, datetime.now(timezone.utc), token=lambda: "t")
               if not isinstance(a, Create) or a.manifest["kind"] != "Secret"]
    assert [(type(a).__name__, a.kind, a.name) for a in actions] == [("Patch", "Deployment", "demo-model-server")]
    assert actions[0].patch["spec"]["replicas"] == 3


def test_serving_spec_is_checked():
    with pytest.raises(SpecError, match="modelServer"):
        validate_job(job_body(serving={k: v for k, v in SERVING.items() if k != "modelServer"}))
    with pytest.raises(SpecError, match="replicas"):
        validate_job(job_body(serving={**SERVING, "modelServer": {"replicas": 0}}))
    assert not any("model-server" in c["metadata"]["name"] for c in render(make(job_body())))


def test_a_finished_job_keeps_serving():
    body = serving_body()
    meta, spec = validate_job(body)
    job = make(body)
    job.status.accepted_spec = spec.to_wire()
    job.status.conditions = [Condition(type=C.COND_SUCCEEDED, status="True", reason="Completed",
                                       last_transition_time="2026-01-01T00:00:00Z")]
    assert job.status.terminal()
    children = Children.from_summaries([summarize(c["kind"], c) for c in render(job)])
    deleted = {a.name for a in plan_actions(meta, job.status, children, datetime.now(timezone.utc))
               if type(a).__name__ == "Delete"}
    assert deleted and not deleted & {"demo-infer-ps", "demo-infer-ew", "demo-model-server"}, deleted


def test_no_two_jobs_name_a_child_alike_but_by_the_names_refused():
    """Every child name is ``<job><suffix>``; where one suffix ends another of the same kind
    (``-config``, ``-nats-config``), job ``x-nats`` would name its ConfigMap as job ``x``'s NATS
    one. The endings that make such names are refused (``C.CLASHING_NAME_ENDINGS``, and the CRD's
    CEL rule): derived here from every child a job with serving and a managed NATS renders."""
    children = render(make(serving_body()))
    suffixes = {(c["kind"], c["metadata"]["name"].removeprefix("demo")) for c in children}
    assert all(s.startswith("-") for _, s in suffixes), suffixes
    clashing = {long[: -len(short)] for kind, long in suffixes for other, short in suffixes
                if kind == other and long != short and long.endswith(short)}
    assert clashing == set(C.CLASHING_NAME_ENDINGS)
