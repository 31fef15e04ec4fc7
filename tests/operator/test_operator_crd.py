"""The generated CRD: up to date, valid, structural, and its schema and CEL rules agree
with the operator's own validation.

No API server here: the CRD is checked with kubernetes-validate (the CRD object itself),
jsonschema (our manifests against openAPIV3Schema) and cel-python (the CEL rules). None
of them checks CEL cost limits or the API server's structural-schema checks exactly,
which only a real cluster does.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from operator_testkit import REPO, example_body, job_body, with_changes

from persia_operator import constants as C
from persia_operator.crdgen import crd, crd_yaml
from persia_operator.spec import SpecError, validate_job

CRD_FILES = [REPO / "crds" / "persiajobs.persia.com.yaml", REPO / "charts" / "persia-operator" / "crds" / "persiajobs.persia.com.yaml"]


@pytest.mark.parametrize("path", CRD_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_committed_crd_is_up_to_date(path):
    assert path.exists(), f"{path.relative_to(REPO)} is missing: run `make crds`"
    assert path.read_text() == crd_yaml(), (
        f"{path.relative_to(REPO)} is stale: regenerate it with "
        f"`python -m persia_operator.crdgen -o {path.relative_to(REPO)}` (make crds)"
    )


def test_crd_object_validates_against_kubernetes_1_30():
    kubernetes_validate.validate(crd(), "1.30", strict=True)


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


def test_schema_is_structural():
    for path, node in walk(schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        assert not ({"$ref", "anyOf", "oneOf", "allOf", "title"} & set(node)), f"{path}: {set(node)}"
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), f"{path}: map keys must be required"


def test_names_columns_and_subresources():
    spec = crd()["spec"]
    assert spec["group"] == "persia.com" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "PersiaJob" and spec["names"]["plural"] == "persiajobs"
    assert spec["names"]["shortNames"] == ["pj"] and "persia" in spec["names"]["categories"]
    version = spec["versions"][0]
    assert version["name"] == "v1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Ready", "Restarts", "Age", "Succeeded", "Reason"]
    assert columns["Ready"]["jsonPath"] == ".status.replicaStatuses.nnWorker.readyRatio"
    assert columns["Succeeded"]["priority"] == 1 and columns["Reason"]["priority"] == 1
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    # Every field the operator writes has a schema, so the API server keeps it.
    assert {"phase", "conditions", "replicaStatuses", "restartCount", "startTime", "completionTime",
            "acceptedSpec", "attempt", "natsURL", "reason"} <= set(status)  # fmt: skip
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def _jsonschema(node: Any) -> Any:
    """openAPIV3Schema as plain JSON schema (x-kubernetes-* dropped, unknown fields kept
    only where Kubernetes keeps them)."""
    if isinstance(node, list):
        return [_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def test_manifests_validate_against_the_schema():
    validator = jsonschema.Draft202012Validator(_jsonschema(schema()))
    for body in (example_body(), job_body(), job_body(trainingMode="online", nats={"externalURL": "nats://x:4222"})):
        errors = [e.message for e in validator.iter_errors(body)]
        assert not errors, errors
    bad = job_body()
    bad["spec"]["nnWorker"]["replicas"] = "two"
    bad["spec"]["trainingMode"] = "streaming"
    bad["spec"]["nnWorker"]["gpus"] = 1
    messages = " ".join(e.message for e in validator.iter_errors(bad))
    assert "'two' is not of type 'integer'" in messages
    assert "'streaming' is not one of ['batch', 'online']" in messages
    assert "'gpus' was unexpected" in messages


# --- CEL -------------------------------------------------------------------------------

celpy = pytest.importorskip("celpy", reason="cel-python is needed to evaluate the CEL rules")


def cel_failures(node: dict[str, Any], value: Any) -> list[str]:
    env = celpy.Environment()
    failures = []
    for rule in node.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            failures.append(rule["message"])
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key in value:
                failures += cel_failures(sub, value[key])
    if isinstance(value, list) and "items" in node:
        for item in value:
            failures += cel_failures(node["items"], item)
    return failures


def test_cel_rules_pass_valid_manifests():
    for body in (example_body(), job_body(), job_body(name="j" * C.MAX_JOB_NAME)):
        assert cel_failures(schema(), body) == []


def test_nats_auth_for_a_url_from_a_secret_passes_cel_and_the_operator():
    url = {"name": "PERSIA_NATS_URL", "valueFrom": {"secretKeyRef": {"name": "team-nats", "key": "url"}}}
    body = job_body(env=[url], nats={"auth": {"secretName": "team-creds"}})
    assert cel_failures(schema(), body) == []
    assert not validate_job(body)[1].nats_managed()


def _broken(**changes: Any) -> dict[str, Any]:
    return with_changes(job_body(), **changes)


CEL_CASES = [
        (_broken(metadata__name="j" * (C.MAX_JOB_NAME + 1)), f"at most {C.MAX_JOB_NAME} characters", f"at most {C.MAX_JOB_NAME} are allowed"),
        (_broken(metadata__name="Adult_Income"), "DNS-1035 label", "DNS-1035 label"),
        (_broken(metadata__name="ctr-nats"), "must not end in -nats or -serving", "must not end in '-nats'"),
        (_broken(spec__nnWorker__replicas=0), "replicas must be between 1 and 1024", "spec.nnWorker.replicas: replicas must be between 1 and 1024, got 0"),
        (_broken(spec__embeddingParameterServer__replicas=2000), "replicas must be between 1 and 1024", "got 2000"),
        (_broken(spec__nats={"maxPayload": 67108865}), "nats.maxPayload must be between 1 and 67108864", "got 67108865"),
        (_broken(spec__nats={"replicas": 12}), "nats.replicas must be between 1 and", "got 12"),
        (_broken(spec__nats={"managed": True, "externalURL": "nats://x:4222"}), "mutually exclusive", "mutually exclusive"),
        (_broken(spec__persiaEnv__PERSIA_GLOBAL_CONFIG="/g.yml"), "set exactly one of persiaEnv.PERSIA_GLOBAL_CONFIG", "(both are set)"),
        (_broken(spec__configs__embeddingConfig=None), "set exactly one of persiaEnv.PERSIA_EMBEDDING_CONFIG", "(neither is set)"),
        (_broken(spec__persiaEnv__PERSIA_NN_WORKER_ENTRY=None), "PERSIA_NN_WORKER_ENTRY is required", "PERSIA_NN_WORKER_ENTRY is required"),
        (_broken(spec__persiaEnv__PERSIA_DATALOADER_ENTRY=None), "PERSIA_DATALOADER_ENTRY is required", "PERSIA_DATALOADER_ENTRY is required"),
        (_broken(spec__checkpoint={"intervalSteps": 5}), "checkpoint: set exactly one of persistentVolumeClaim and volume", "exactly one of persistentVolumeClaim and volume"),
        (_broken(spec__nats={"auth": {"secretName": "x"}}), "nats.auth and nats.tls are for an external NATS (nats.externalURL, ", "nats.auth and nats.tls are for an external NATS"),
        (_broken(spec__nats={"managed": True, "tls": {"secretName": "x"}}), "nats.auth and nats.tls are for an external NATS; a managed", "nats.auth and nats.tls are for an external NATS"),
        # PERSIA_NATS_URL only in the roles' env: the rule asks for it in spec.env, in CEL and in the operator
        (_broken(spec__nats={"auth": {"secretName": "x"}}, **{f"spec__{r}__env": [{"name": "PERSIA_NATS_URL", "value": "nats://n:4222"}]
                 for r in ("embeddingParameterServer", "embeddingWorker", "nnWorker", "dataloader")}),
         "nats.auth and nats.tls are for an external NATS (nats.externalURL, or PERSIA_NATS_URL in spec.env)",
         "nats.auth and nats.tls are for an external NATS (nats.externalURL, or PERSIA_NATS_URL in spec.env)"),
]  # fmt: skip


def _rules(node: Any):
    if isinstance(node, dict):
        yield from node.get("x-kubernetes-validations", [])
        for value in node.values():
            yield from _rules(value)
    elif isinstance(node, list):
        for value in node:
            yield from _rules(value)


def test_every_cel_rule_has_an_operator_case():
    """Item 6 of issue 11: no CEL rule without the same check in the operator."""
    messages = {rule["message"] for rule in _rules(crd())}
    covered = {m for m in messages if any(m.startswith(case[1]) or case[1] in m for case in CEL_CASES)}
    assert covered == messages, messages - covered


@pytest.mark.parametrize("body, cel_message, operator_message", CEL_CASES)
def test_cel_rule_and_operator_validation_agree(body, cel_message, operator_message):
    """Each CEL rule rejects its sample, and so does the operator (for clusters and
    tools without CEL: the operator reports Failed/InvalidSpec, `render` an error)."""
    failures = cel_failures(schema(), body)
    assert any(cel_message in f for f in failures), failures
    with pytest.raises(SpecError) as err:
        validate_job(body)
    assert any(operator_message in p for p in err.value.problems), err.value.problems


def test_crd_yaml_parses_back():
    assert yaml.safe_load(crd_yaml()) == crd()
