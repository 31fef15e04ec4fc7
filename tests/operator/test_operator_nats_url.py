"""A PERSIA_NATS_URL the user sets (a value or a valueFrom, in spec.env or in the roles'
env) means the pods use that NATS: no managed NATS is rendered and none of its credentials
are injected (before, only a `value` in spec.env counted, and pods reached the user's NATS
with the managed NATS's user and password). Roles that would reach different NATS servers
are an error naming the fields."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from operator_testkit import Sim, job_body

from persia_operator import constants as C
from persia_operator.job import PersiaJob
from persia_operator.natsinfo import NatsObservation
from persia_operator.reconciler import Reconciler, nats_target
from persia_operator.render import render, render_auth_secret, total_pods
from persia_operator.spec import SpecError, parse_spec, validate_job

ROLES = ("embeddingParameterServer", "embeddingWorker", "nnWorker", "dataloader")
FROM_SECRET = {"name": "PERSIA_NATS_URL", "valueFrom": {"secretKeyRef": {"name": "team-nats", "key": "url"}}}
AS_VALUE = {"name": "PERSIA_NATS_URL", "value": "nats://team-nats.infra:4222"}


def in_roles(body: dict[str, Any], var: dict[str, Any], roles=ROLES) -> dict[str, Any]:
    for role in roles:
        body["spec"][role]["env"] = [dict(var)]
    return body


def make(body: dict[str, Any]) -> PersiaJob:
    meta, spec = validate_job(body)
    return PersiaJob(metadata=meta, spec=spec)


def pod_templates(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["spec"]["template"]["spec"] for c in children if c["kind"] in ("StatefulSet", "Job", "Deployment")]


USER_NATS = {
    "spec.env valueFrom": (job_body(env=[FROM_SECRET]), FROM_SECRET),
    "spec.env valueFrom, nats.auth": (job_body(env=[FROM_SECRET], nats={"auth": {"secretName": "team-creds"}}), FROM_SECRET),
    "every role's env value": (in_roles(job_body(), AS_VALUE), AS_VALUE),
    "every role's env valueFrom": (in_roles(job_body(), FROM_SECRET), FROM_SECRET),
    "spec.env and the same in a role": (in_roles(job_body(env=[AS_VALUE]), AS_VALUE, ["nnWorker"]), AS_VALUE),
    "online, every role's env valueFrom": (in_roles(job_body(trainingMode="online"), FROM_SECRET), FROM_SECRET),
}


@pytest.mark.parametrize("body, var", USER_NATS.values(), ids=USER_NATS.keys())
def test_user_nats_url_means_no_managed_nats_and_no_managed_credentials(body, var):
    job = make(body)
    assert not job.spec.nats_managed()
    children = render(job)
    assert not [c for c in children if c["metadata"]["labels"][C.LABEL_ROLE] == C.ROLE_NATS]
    for pod in pod_templates(children):
        for c in [*pod["containers"], *pod["initContainers"]]:
            urls = [e for e in c["env"] if e["name"] == "PERSIA_NATS_URL"]
            assert urls == [var], c["name"]  # the user's definition, once, in wait-for-nats too
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        refs = [e["valueFrom"]["secretKeyRef"] for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
        assert not [r for r in refs if r["name"] == "demo-auth" and r["key"].startswith("nats-")]
        if job.spec.nats.auth is None:
            assert "PERSIA_NATS_USER" not in env and "PERSIA_NATS_PASSWORD" not in env
        else:  # the user's own credentials for their NATS
            assert env["PERSIA_NATS_USER"]["valueFrom"]["secretKeyRef"] == {"name": "team-creds", "key": "user"}
    assert render_auth_secret(job, "pw-A", "secret-B", "route-C")["stringData"] == {"job-secret": "secret-B"}
    assert total_pods(job.spec) == sum(r.replicas for r in job.spec.roles().values())  # a gang without NATS


def test_nats_url_from_a_secret_is_read_there_by_the_operator():
    """The operator checks the same NATS as the pods (NatsReady, checkpoint probe): it reads
    the URL from the Secret the secretKeyRef names; the status never shows it unredacted."""
    spec = parse_spec(job_body(env=[FROM_SECRET])["spec"])
    assert spec.nats_url("demo", "ns1") == "" and spec.nats_url_secret() == ("team-nats", "url")
    assert nats_target("demo", "ns1", spec, {}) is None  # not read yet
    target = nats_target("demo", "ns1", spec, {"team-nats": {"url": "nats://u:pw@team-nats.infra:4222"}})
    assert target is not None and target.url == "nats://u:pw@team-nats.infra:4222"
    assert target.user is None and target.password is None  # no managed credentials
    value = parse_spec(in_roles(job_body(), AS_VALUE)["spec"])
    assert value.nats_url("demo", "ns1") == "nats://team-nats.infra:4222" and value.nats_url_secret() is None


def test_status_of_a_job_on_a_nats_url_from_a_secret():
    """No managed NATS to count: the job is Ready once the operator reached the pods' NATS;
    the status names the Secret, never the URL (it may carry credentials)."""
    sim = Sim(job_body(env=[FROM_SECRET]))
    sim.step()
    st = sim.step(sim.children())
    assert st.nats_url is None and "nats" not in st.replica_statuses
    nats_ready = st.condition(C.COND_NATS_READY)
    assert (nats_ready.status, nats_ready.reason) == ("False", "NatsNotChecked")
    assert nats_ready.message == "no connection to the PERSIA_NATS_URL in Secret team-nats tried yet"
    st = sim.step(sim.children(), nats=NatsObservation(connected=True))
    assert st.condition(C.COND_NATS_READY).reason == "ExternalNats"
    assert st.condition(C.COND_READY).status == "True" and st.phase == "Running"


class _Api:
    """Just enough of KubeApi for `_observe_by_get`: Secrets by name, the rest absent."""

    def __init__(self) -> None:
        self.gets: list[tuple[str, str]] = []

    async def get(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> dict[str, Any] | None:
        self.gets.append((kind, name))
        if (kind, name) == ("Secret", "team-nats"):
            return {"metadata": {"name": name}, "data": {"url": base64.b64encode(b"nats://team-nats.infra:4222").decode()}}
        return None


async def test_reconciler_gets_the_url_secret_by_name():
    api = _Api()
    spec = parse_spec(job_body(env=[FROM_SECRET])["spec"])
    _, secrets = await Reconciler(api)._observe_by_get("ns1", "demo", spec)  # type: ignore[arg-type]
    assert ("Secret", "team-nats") in api.gets and ("PodDisruptionBudget", "demo-nats") not in api.gets
    assert nats_target("demo", "ns1", spec, secrets).url == "nats://team-nats.infra:4222"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "body, expected",
    [
        (in_roles(job_body(), AS_VALUE, ["nnWorker"]),
         "PERSIA_NATS_URL is set in nnWorker.env but not for embeddingParameterServer, embeddingWorker, dataloader: "
         "every role must use the same NATS (set PERSIA_NATS_URL once in spec.env)"),
        (in_roles(job_body(env=[AS_VALUE]), {"name": "PERSIA_NATS_URL", "value": "nats://u:hunter2@other:4222"}, ["embeddingWorker"]),
         "PERSIA_NATS_URL differs between roles (env: 'nats://team-nats.infra:4222', embeddingWorker.env: "
         "'nats://***@other:4222'): every role must use the same NATS"),
        (in_roles(job_body(), AS_VALUE, ["embeddingParameterServer", "embeddingWorker", "nnWorker"]),
         "but not for dataloader"),
        (job_body(env=[AS_VALUE], nats={"managed": True}),
         "nats.managed: true and PERSIA_NATS_URL in env are mutually exclusive"),
        (in_roles(job_body(nats={"managed": True}), FROM_SECRET),
         "nats.managed: true and PERSIA_NATS_URL in embeddingParameterServer.env, embeddingWorker.env, nnWorker.env, "
         "dataloader.env are mutually exclusive"),
        (job_body(env=[{"name": "PERSIA_NATS_URL", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "url"}}}]),
         "env: PERSIA_NATS_URL valueFrom must be a secretKeyRef (the operator reads it to check that NATS), "
         "got valueFrom {'configMapKeyRef': {'name': 'cm', 'key': 'url'}}"),
        (job_body(env=[{"name": "PERSIA_NATS_URL", "value": ""}]), "env: PERSIA_NATS_URL is empty"),
        (in_roles(job_body(nats={"auth": {"secretName": "team-creds"}}), AS_VALUE),
         "nats.auth and nats.tls are for an external NATS (nats.externalURL, or PERSIA_NATS_URL in spec.env)"),
        (job_body(env=[AS_VALUE], nats={"externalURL": "nats://u:hunter2@other:4222"}),
         "nats.externalURL 'nats://***@other:4222' and PERSIA_NATS_URL (env: 'nats://team-nats.infra:4222') differ: "
         "the pods would use PERSIA_NATS_URL while the operator checks nats.externalURL; set one of them"),
        (job_body(env=[FROM_SECRET], nats={"externalURL": "nats://team-nats.infra:4222"}),
         "and PERSIA_NATS_URL (env: valueFrom {'secretKeyRef': {'name': 'team-nats', 'key': 'url'}}) differ"),
    ],
    ids=["one role only", "roles differ", "one role missing", "managed true and spec.env", "managed true and roles",
         "configMapKeyRef", "empty", "auth with roles' env only", "externalURL and env differ",
         "externalURL and a URL from a Secret"],
)
def test_roles_on_different_nats_servers_are_an_error(body, expected):
    with pytest.raises(SpecError) as err:
        validate_job(body)
    assert any(expected in p for p in err.value.problems), err.value.problems
    assert "hunter2" not in str(err.value)  # URL user-info is not echoed into status or events


def test_external_url_and_the_same_url_in_env_agree():
    """PERSIA's manifests set PERSIA_NATS_URL in spec.env; naming the same server in
    nats.externalURL too is not a conflict."""
    validate_job(job_body(env=[AS_VALUE], nats={"externalURL": AS_VALUE["value"]}))
