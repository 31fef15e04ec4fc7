"""The PersiaJob spec model: PERSIA's manifests parse unchanged, and bad input is
reported with the field and the value."""

from __future__ import annotations


import pytest
from operator_testkit import example_body, job_body, with_changes

from persia_operator import constants as C
from persia_operator.spec import SpecError, parse_spec, validate_job


def test_persia_example_parses_with_persia_fields():
    meta, spec = validate_job(example_body())
    assert meta.name == "adult-income" and meta.namespace == "default"
    assert spec.persia_env.PERSIA_GLOBAL_CONFIG.endswith("/config/global_config.yml")
    assert spec.nn_worker.nproc_per_node == 1
    assert spec.nn_worker.resources["limits"]["nvidia.com/gpu"] == "1"
    assert [v.name for v in spec.nn_worker.env] == ["CUBLAS_WORKSPACE_CONFIG", "ENABLE_CUDA"]
    assert spec.restart_policy == "Never" and spec.enable_metrics is True
    # PERSIA pointed its pods at a NATS of its own through spec.env: that NATS is used.
    assert spec.nats_managed() is False
    assert spec.nats_url(meta.name, meta.namespace) == "nats://persia-nats-service:4222"


def test_managed_nats_is_the_default():
    spec = parse_spec(job_body()["spec"])
    assert spec.nats_managed()
    assert spec.nats_url("demo", "ns1") == "nats://demo-nats.ns1.svc:4222"
    assert spec.nats.max_payload == 64 * 1024 * 1024
    external = parse_spec(job_body(nats={"externalURL": "nats://shared:4222"})["spec"])
    assert not external.nats_managed() and external.nats_url("demo", "ns1") == "nats://shared:4222"


def test_wire_form_round_trips():
    spec = parse_spec(example_body()["spec"])
    assert parse_spec(spec.to_wire()) == spec
    assert spec.to_wire()["runPolicy"]["cleanPodPolicy"] == "Running"


def _spec(**changes):
    return with_changes(job_body()["spec"], **changes)


@pytest.mark.parametrize(
    "spec, expected",
    [
        (_spec(nnWorker__replicas=0), "spec.nnWorker.replicas: replicas must be between 1 and 1024, got 0"),
        (_spec(embeddingWorker__replicas=5000), "spec.embeddingWorker.replicas: replicas must be between 1 and 1024, got 5000"),
        (_spec(nnWorker__replicas="many"), "spec.nnWorker.replicas: Input should be a valid integer"),
        (_spec(nats={"maxPayload": 67108865}), "spec.nats.maxPayload: nats.maxPayload must be between 1 and 67108864 bytes"),
        (_spec(nats={"managed": True, "externalURL": "nats://x:4222"}), "nats.externalURL and nats.managed: true are mutually exclusive"),
        (_spec(nats={"externalURL": "http://x"}), "spec.nats.externalURL: nats.externalURL must look like nats://host:port, got 'http://x'"),
        (_spec(restartPolicy="Always"), "restartPolicy: Always is not supported"),
        (_spec(restartPolicy="Sometimes"), "spec.restartPolicy: Input should be 'Never' or 'OnFailure' (got 'Sometimes')"),
        (_spec(persiaEnv__PERSIA_GLOBAL_CONFIG="/c/g.yml"), "set exactly one of persiaEnv.PERSIA_GLOBAL_CONFIG and configs.globalConfig (both are set)"),
        (_spec(configs__embeddingConfig=None), "set exactly one of persiaEnv.PERSIA_EMBEDDING_CONFIG and configs.embeddingConfig (neither is set)"),
        (_spec(persiaEnv__PERSIA_NN_WORKER_ENTRY=None), "persiaEnv.PERSIA_NN_WORKER_ENTRY is required"),
        (_spec(persiaEnv__PERSIA_DATALOADER_ENTRY=None), "persiaEnv.PERSIA_DATALOADER_ENTRY is required when spec.dataloader is set"),
        (_spec(nnWorker__volumeMounts=[{"name": "data", "mountPath": "/data"}]), "nnWorker.volumeMounts: volume 'data' is not in spec.volumes"),
        (_spec(env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]), "duplicate environment variable name 'A'"),
        (_spec(nnWorker__gpus=2), "spec.nnWorker.gpus: unknown field (value 2)"),
        (_spec(embeddingParameterServer=None), "spec.embeddingParameterServer: field required"),
        (_spec(runPolicy__cleanPodPolicy="Sometimes"), "spec.runPolicy.cleanPodPolicy: Input should be 'None', 'Running' or 'All'"),
        (_spec(runPolicy__backoffLimit=-1), "spec.runPolicy.backoffLimit: Input should be greater than or equal to 0 (got -1)"),
        # Refused by the API server only when the workload was created (ChildCreateFailed, after the
        # NATS, Services and ConfigMaps were made), naming the StatefulSet's container, not the field.
        (_spec(embeddingWorker__resources={"limits": {"cpu": "lots"}}),
         "spec.embeddingWorker.resources: limits.cpu must be a non-negative quantity such as 500m, 2 or 4Gi, got 'lots'"),
        (_spec(nnWorker__resources={"requests": {"memory": "-1Gi"}}),
         "spec.nnWorker.resources: requests.memory must be a non-negative quantity such as 500m, 2 or 4Gi, got '-1Gi'"),
        (_spec(embeddingParameterServer__resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}),
         "spec.embeddingParameterServer.resources: requests.cpu '2' is more than limits.cpu '1500m'"),
        (_spec(nats={"resources": {"limits": {"memory": "2 GB"}}}),
         "spec.nats.resources: limits.memory must be a non-negative quantity such as 500m, 2 or 4Gi, got '2 GB'"),
        (_spec(nnWorker__shmSize="big"), "spec.nnWorker.shmSize: must be a non-negative quantity such as 8Gi, got 'big'"),
        # A volume given as a string crashed the operator's own checks (AttributeError: no status,
        # a ReconcileFailed event every pass); a container list as a string reached the API server.
        (_spec(nnWorker__template={"spec": {"volumes": ["data"]}}),
         "spec.nnWorker.template.spec: volumes[0] must be an object with a name, got 'data'"),
        (_spec(nnWorker__template={"spec": {"containers": "nn-worker"}}),
         "spec.nnWorker.template.spec: containers must be a list, got 'nn-worker'"),
        (_spec(nats={"template": {"spec": {"containers": [{"name": "nats", "env": [{"value": "1"}]}]}}}),
         "spec.nats.template.spec: containers[nats].env[0] must be an object with a name, got {'value': '1'}"),
        (_spec(env=[{"name": "A=B", "value": "1"}]),
         "spec.env.0.name: an environment variable name must be printable ASCII without '=', got 'A=B'"),
    ],
)
def test_invalid_spec_names_field_and_value(spec, expected):
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert any(expected in p for p in err.value.problems), err.value.problems


def test_volume_mount_of_declared_volume_is_fine():
    spec = _spec(volumes=[{"name": "data", "emptyDir": {}}], nnWorker__volumeMounts=[{"name": "data", "mountPath": "/d"}])
    assert parse_spec(spec).nn_worker.volume_mounts[0]["mountPath"] == "/d"


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("a" * (C.MAX_JOB_NAME + 1), f"at most {C.MAX_JOB_NAME} are allowed"),
        ("Adult_Income", "must be a DNS-1035 label"),
        ("9lives", "must be a DNS-1035 label"),
        ("ctr-nats", "must not end in '-nats': its children would take names of the children of job 'ctr'"),
        ("ctr-serving", "must not end in '-serving'"),
    ],
)
def test_job_name_rules(name, fragment):
    body = job_body(name=name)
    with pytest.raises(SpecError) as err:
        validate_job(body)
    assert any(fragment in p and repr(name) in p for p in err.value.problems)


def test_longest_allowed_name_is_accepted():
    meta, _ = validate_job(job_body(name="a" * C.MAX_JOB_NAME))
    assert len(meta.name) == C.MAX_JOB_NAME


def test_wrong_kind_and_version_are_reported():
    body = job_body()
    body["apiVersion"], body["kind"] = "persia.com/v1alpha1", "PyTorchJob"
    with pytest.raises(SpecError) as err:
        validate_job(body)
    assert "apiVersion must be persia.com/v1, got 'persia.com/v1alpha1'" in str(err.value)
    assert "kind must be PersiaJob, got 'PyTorchJob'" in str(err.value)


@pytest.mark.parametrize("value", ["500m", "2", 2, 1.5, "1.5Gi", "4G", "1e3", "128974848", "129M", "123Mi", ".5", "0"])
def test_quantities_the_api_server_takes_are_accepted(value):
    spec = parse_spec(_spec(embeddingWorker__resources={"requests": {"memory": value}}, nnWorker__shmSize=str(value)))
    assert spec.embedding_worker.resources["requests"]["memory"] == value
