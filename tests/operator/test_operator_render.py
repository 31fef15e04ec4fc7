"""render(job): the children of a PersiaJob, validated against Kubernetes 1.30."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from operator_testkit import UID, example_body, job_body, with_uid

from persia_operator import constants as C
from persia_operator.job import PersiaJob
from persia_operator.render import render
from persia_operator.spec import validate_job


def make(body, attempt: int = 0) -> PersiaJob:
    meta, spec = validate_job(body)
    job = PersiaJob(metadata=meta, spec=spec)
    job.status.attempt = attempt
    return job


def by_key(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def container(manifest):
    return manifest["spec"]["template"]["spec"]["containers"][0]


def env_map(manifest):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(manifest)["env"]}


VARIANTS = {
    "persia-example": example_body(),
    "managed-nats-inline-configs": job_body(),
    "nats-cluster-online": job_body(trainingMode="online", nats={"replicas": 3, "maxPayload": 1048576}),
    "external-nats-no-dataloader": {
        **job_body(nats={"externalURL": "nats://shared.infra:4222"}),
        "spec": {
            k: v
            for k, v in job_body(nats={"externalURL": "nats://shared.infra:4222"})["spec"].items()
            if k != "dataloader"
        }
        | {"persiaEnv": {"PERSIA_NN_WORKER_ENTRY": "/w/train.py"}},
    },
    "overlays-and-policies": job_body(
        image="registry.local/persia:1.0",
        imagePullPolicy="IfNotPresent",
        restartPolicy="OnFailure",
        enableMetrics=False,
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "criteo"}}],
        runPolicy={"schedulerName": "volcano", "priorityClassName": "high", "backoffLimit": 5},
        nnWorker={
            "replicas": 4,
            "nprocPerNode": 8,
            "resources": {"limits": {"nvidia.com/gpu": "8", "memory": "64Gi"}},
            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
            "template": {
                "metadata": {"labels": {"team": "ads", C.LABEL_ROLE: "hijack"}, "annotations": {"a": "b"}},
                "spec": {
                    "nodeSelector": {"gpu": "a100"},
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{"name": "nn-worker", "securityContext": {"runAsNonRoot": True}}],
                    "restartPolicy": "Always",
                },
            },
        },
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_child_validates_against_kubernetes_1_30(variant):
    children = render(make(with_uid(VARIANTS[variant])))
    assert children
    for child in children:
        kubernetes_validate.validate(child, "1.30", strict=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_children_are_labelled_named_and_owned(variant):
    body = with_uid(VARIANTS[variant])
    job = make(body)
    children = render(job)
    assert render(make(body)) == children  # deterministic
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert len(set(names)) == len(names)
    for child in children:
        meta = child["metadata"]
        assert meta["name"].startswith(f"{job.name}-") and "generateName" not in meta
        assert meta["namespace"] == job.namespace
        assert meta["labels"][C.LABEL_JOB] == job.name and C.LABEL_ROLE in meta["labels"]
        assert meta["ownerReferences"] == [
            {"apiVersion": "persia.com/v1", "kind": "PersiaJob", "name": job.name, "uid": UID,
             "controller": True, "blockOwnerDeletion": True}
        ]  # fmt: skip
        if child["kind"] in ("StatefulSet", "Job", "Deployment"):
            pod_labels = child["spec"]["template"]["metadata"]["labels"]
            assert pod_labels[C.LABEL_JOB] == job.name
            assert pod_labels[C.LABEL_ROLE] == meta["labels"][C.LABEL_ROLE]


def test_no_owner_reference_without_uid():
    assert all("ownerReferences" not in c["metadata"] for c in render(make(job_body())))


def test_persia_example_children():
    children = by_key(render(make(example_body())))
    assert set(children) == {
        ("Service", "adult-income-embedding-ps"), ("StatefulSet", "adult-income-embedding-ps"),
        ("Service", "adult-income-embedding-worker"), ("StatefulSet", "adult-income-embedding-worker"),
        ("Service", "adult-income-nn-worker"), ("Job", "adult-income-nn-worker"),
        ("Service", "adult-income-dataloader"), ("Job", "adult-income-dataloader"),
        ("PodDisruptionBudget", "adult-income-embedding-ps"),
    }  # fmt: skip  (no NATS: PERSIA's manifest brings its own)
    nn = children[("Job", "adult-income-nn-worker")]
    assert nn["spec"]["completionMode"] == "Indexed"
    assert nn["spec"]["completions"] == nn["spec"]["parallelism"] == 1
    assert nn["spec"]["backoffLimit"] == 0
    assert container(nn)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container(nn)["image"] == C.DEFAULT_CUDA_IMAGE
    assert env_map(nn)["PERSIA_NATS_URL"] == "nats://persia-nats-service:4222"
    assert env_map(nn)["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    ps = children[("StatefulSet", "adult-income-embedding-ps")]
    assert ps["spec"]["podManagementPolicy"] == "Parallel"
    assert ps["spec"]["serviceName"] == "adult-income-embedding-ps"
    assert container(ps)["image"] == C.DEFAULT_CPU_IMAGE
    assert container(ps)["resources"] == {"limits": {"memory": "24Gi", "cpu": "4"}}
    assert children[("Service", "adult-income-embedding-ps")]["spec"]["clusterIP"] == "None"


def test_launcher_commands_per_role():
    children = by_key(render(make(job_body())))
    common = ["--embedding-config", "$(PERSIA_EMBEDDING_CONFIG)", "--global-config", "$(PERSIA_GLOBAL_CONFIG)",
              "--replica-index", "$(REPLICA_INDEX)", "--replica-size", "$(REPLICA_SIZE)"]  # fmt: skip
    expected = {
        ("StatefulSet", "demo-embedding-ps"): ["embedding-parameter-server", *common, "--port", "8888"],
        ("StatefulSet", "demo-embedding-worker"): ["embedding-worker", *common, "--port", "8887"],
        ("Job", "demo-nn-worker"): ["nn-worker", "$(PERSIA_NN_WORKER_ENTRY)", "--nproc-per-node", "$(NPROC_PER_NODE)",
                                    "--nnodes", "$(REPLICA_SIZE)", "--node-rank", "$(REPLICA_INDEX)"],  # fmt: skip
        ("Job", "demo-dataloader"): ["data-loader", "$(PERSIA_DATALOADER_ENTRY)", "--replica-index", "$(REPLICA_INDEX)",
                                     "--replica-size", "$(REPLICA_SIZE)"],  # fmt: skip
    }
    for key, args in expected.items():
        assert container(children[key])["command"] == ["persia-launcher"]
        assert container(children[key])["args"] == args


def test_env_contract_order_and_values():
    body = job_body(env=[{"name": "LOG_LEVEL", "value": "debug"}, {"name": "SHARED", "value": "1"}],
                    logLevel="warn")  # fmt: skip
    body["spec"]["nnWorker"]["env"] = [{"name": "SHARED", "value": "nn"}]
    children = by_key(render(make(body)))
    nn = children[("Job", "demo-nn-worker")]
    names = [e["name"] for e in container(nn)["env"]]
    assert names == ["PERSIA_NATS_URL", "PERSIA_JOB_NAME", "PERSIA_JOB_NAMESPACE", "PERSIA_GLOBAL_CONFIG", "PERSIA_EMBEDDING_CONFIG",
                     "REPLICA_INDEX", "REPLICA_SIZE", "NPROC_PER_NODE", "PERSIA_NN_WORKER_ENTRY",
                     "PERSIA_TRAINING_CPUS", "PERSIA_METRICS_PORT", "PERSIA_BIND_ADDRESS",
                     "PERSIA_GRACE_PERIOD_SECONDS", "PERSIA_JOB_SECRET", "PERSIA_NATS_USER", "PERSIA_NATS_PASSWORD",
                     "HOME", "LOG_LEVEL", "SHARED"]  # fmt: skip
    env = env_map(nn)
    assert env["LOG_LEVEL"] == "debug"  # spec.env overrides the contract; the last definition wins
    assert env["SHARED"] == "nn"  # role env overrides spec.env
    assert env["PERSIA_JOB_NAME"] == "demo"
    assert env["PERSIA_JOB_NAMESPACE"] == "ns1"
    assert env["PERSIA_NATS_URL"] == "nats://demo-nats.ns1.svc:4222"
    assert env["REPLICA_SIZE"] == "2" and env["NPROC_PER_NODE"] == "1"
    assert env["PERSIA_METRICS_PORT"] == "9090"
    assert env["REPLICA_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    ps = env_map(children[("StatefulSet", "demo-embedding-ps")])
    assert ps["REPLICA_INDEX"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert "NPROC_PER_NODE" not in ps and "PERSIA_NN_WORKER_ENTRY" not in ps
    assert env["PERSIA_TRAINING_CPUS"] == "auto" and "PERSIA_TRAINING_CPUS" not in ps  # NN workers only
    body["spec"]["nnWorker"]["env"].append({"name": "PERSIA_TRAINING_CPUS", "value": ""})  # a user turns it off
    assert env_map(by_key(render(make(body)))[("Job", "demo-nn-worker")])["PERSIA_TRAINING_CPUS"] == ""
    assert env_map(children[("Job", "demo-dataloader")])["PERSIA_DATALOADER_ENTRY"] == "/workspace/data_loader.py"


def test_inline_configs_become_a_mounted_config_map():
    job = make(job_body())
    children = by_key(render(job))
    cm = children[("ConfigMap", "demo-config")]
    assert yaml.safe_load(cm["data"]["global_config.yml"]) == job.spec.configs.global_config
    assert yaml.safe_load(cm["data"]["embedding_config.yml"]) == job.spec.configs.embedding_config
    for key in [("StatefulSet", "demo-embedding-ps"), ("Job", "demo-nn-worker")]:
        manifest = children[key]
        env = env_map(manifest)
        assert env["PERSIA_GLOBAL_CONFIG"] == "/etc/persia/global_config.yml"
        assert env["PERSIA_EMBEDDING_CONFIG"] == "/etc/persia/embedding_config.yml"
        assert {"name": "persia-config", "mountPath": "/etc/persia", "readOnly": True} in container(manifest)["volumeMounts"]
        assert {"name": "persia-config", "configMap": {"name": "demo-config"}} in manifest["spec"]["template"]["spec"]["volumes"]


def test_managed_nats_objects():
    children = by_key(render(make(job_body(nats={"replicas": 3, "maxPayload": 8 * 1024 * 1024}))))
    conf = children[("ConfigMap", "demo-nats-config")]["data"]["nats.conf"]
    assert "max_payload: 8388608" in conf
    assert conf.count("$NATS_ROUTE_") == 3 + 2  # three routes, the route user and password
    sts = children[("StatefulSet", "demo-nats")]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "demo-nats-headless"
    nats = container(sts)
    assert nats["image"] == "nats:2.10-alpine"
    assert nats["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "monitor"}
    assert {"name": "monitor", "containerPort": 8222} in nats["ports"]
    client = children[("Service", "demo-nats")]["spec"]
    assert "clusterIP" not in client and {p["port"] for p in client["ports"]} == {4222, 8222}
    headless = children[("Service", "demo-nats-headless")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True


def test_nats_cluster_routes_need_the_generated_route_credentials():
    """Anything that reached port 6222 could join a managed NATS cluster as a route and read
    or publish every subject. Routes now authenticate with route credentials from the
    generated Secret, which reach the servers through env only: the ConfigMap and the
    StatefulSet hold references (test_operator_nats_conf runs the servers for real)."""
    import re

    from persia_operator.render import render_auth_secret

    job = make(job_body(nats={"replicas": 3}))
    children = render(job)
    keyed = by_key(children)
    conf = keyed[("ConfigMap", "demo-nats-config")]["data"]["nats.conf"]
    cluster = conf[conf.index("cluster {"):]
    assert "  authorization {\n    user: $NATS_ROUTE_USER\n    password: $NATS_ROUTE_PASSWORD\n  }\n" in cluster
    assert "  routes: [\n    $NATS_ROUTE_0\n    $NATS_ROUTE_1\n    $NATS_ROUTE_2\n  ]\n" in cluster
    env = container(keyed[("StatefulSet", "demo-nats")])["env"]
    names = [e["name"] for e in env]
    for name, key in (("NATS_ROUTE_USER", "nats-route-user"), ("NATS_ROUTE_PASSWORD", "nats-route-password")):
        assert env[names.index(name)]["valueFrom"] == {"secretKeyRef": {"name": "demo-auth", "key": key, "optional": True}}
    for i in range(3):
        at = names.index(f"NATS_ROUTE_{i}")
        assert at > names.index("NATS_ROUTE_PASSWORD")  # the kubelet expands $(VAR) of earlier vars only
        assert env[at]["value"] == (
            f"nats-route://$(NATS_ROUTE_USER):$(NATS_ROUTE_PASSWORD)@demo-nats-{i}.demo-nats-headless.ns1.svc:6222"
        )
    # Nothing secret in any ConfigMap: every credential is a `$VAR`, no URL carries user-info.
    for cm in (c for c in children if c["kind"] == "ConfigMap"):
        for text in cm["data"].values():
            assert not re.search(r"://[^\s/@]*@", text)
            assert all(line.split(":", 1)[1].strip().startswith("$")
                       for line in text.splitlines() if re.match(r"\s*(user|password):", line))  # fmt: skip
    secret = render_auth_secret(job, "client-pw-AAAA", "job-secret-BBBB", "route-pw-CCCC")
    assert secret["stringData"] == {"job-secret": "job-secret-BBBB", "nats-user": "persia", "nats-password":
                                    "client-pw-AAAA", "nats-route-user": "persia-route", "nats-route-password": "route-pw-CCCC"}  # fmt: skip
    rendered = yaml.safe_dump(children)
    assert not {"client-pw-AAAA", "job-secret-BBBB", "route-pw-CCCC"} & set(re.findall(r"[\w-]+", rendered))
    # The route credentials are the servers' own: no PERSIA pod references them.
    for child in children:
        if child["kind"] in ("Job", "StatefulSet", "Deployment") and child["metadata"]["labels"][C.LABEL_ROLE] != "nats":
            assert "nats-route" not in yaml.safe_dump(child["spec"]["template"])


def test_single_nats_server_has_no_cluster_and_no_route_credentials():
    keyed = by_key(render(make(job_body())))
    assert "cluster {" not in keyed[("ConfigMap", "demo-nats-config")]["data"]["nats.conf"]
    names = [e["name"] for e in container(keyed[("StatefulSet", "demo-nats")])["env"]]
    assert names == ["SERVER_NAME", "NATS_USER", "NATS_PASSWORD"]


def test_nats_template_overlay():
    body = job_body(nats={"template": {"spec": {"nodeSelector": {"pool": "infra"}}}, "resources": {"limits": {"memory": "8Gi"}}})
    sts = by_key(render(make(body)))[("StatefulSet", "demo-nats")]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "infra"}
    assert container(sts)["resources"] == {"limits": {"memory": "8Gi"}}
    assert sts["spec"]["template"]["metadata"]["labels"][C.LABEL_ROLE] == "nats"


def test_external_nats_renders_no_nats():
    children = render(make(job_body(nats={"externalURL": "nats://shared:4222"})))
    assert not [c for c in children if c["metadata"]["labels"][C.LABEL_ROLE] == "nats"]
    assert all(env_map(c)["PERSIA_NATS_URL"] == "nats://shared:4222" for c in children if c["kind"] in ("StatefulSet", "Job"))


def test_online_mode_uses_deployments_and_a_rendezvous():
    children = by_key(render(make(job_body(trainingMode="online"))))
    nn = children[("Deployment", "demo-nn-worker")]
    assert nn["spec"]["replicas"] == 2 and nn["spec"]["strategy"] == {"type": "Recreate"}
    assert nn["spec"]["template"]["spec"]["restartPolicy"] == "Always"
    env = env_map(nn)
    assert "REPLICA_INDEX" not in env and env["PERSIA_RENDEZVOUS"] == "nats" and env["REPLICA_SIZE"] == "2"
    assert "$(REPLICA_INDEX)" not in container(nn)["args"]
    assert "$(REPLICA_INDEX)" not in container(children[("Deployment", "demo-dataloader")])["args"]
    assert ("StatefulSet", "demo-embedding-ps") in children  # servers are still StatefulSets


def test_template_overlay_and_policies():
    children = by_key(render(make(VARIANTS["overlays-and-policies"])))
    nn = children[("Job", "demo-nn-worker")]
    pod = nn["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"gpu": "a100"}
    assert pod["spec"]["tolerations"][0]["key"] == "gpu"
    assert pod["spec"]["schedulerName"] == "volcano" and pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["restartPolicy"] == "OnFailure"  # spec.restartPolicy wins over the overlay
    assert nn["spec"]["backoffLimit"] == 5  # OnFailure: in-place retries up to backoffLimit
    assert pod["metadata"]["labels"]["team"] == "ads"
    assert pod["metadata"]["labels"][C.LABEL_ROLE] == "nn-worker"  # the overlay cannot take our labels
    assert "prometheus.io/scrape" not in pod["metadata"].get("annotations", {})
    main = container(nn)
    # merged into the container by name, over the restricted default
    assert main["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                       "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": False}  # fmt: skip
    assert main["args"][0] == "nn-worker" and main["image"] == "registry.local/persia:1.0"
    assert main["imagePullPolicy"] == "IfNotPresent"
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in main["volumeMounts"]
    ps = children[("StatefulSet", "demo-embedding-ps")]
    assert ps["spec"]["template"]["spec"]["restartPolicy"] == "Always"
    assert "nodeSelector" not in ps["spec"]["template"]["spec"]  # the overlay is per role


def test_metrics_annotations_and_ports():
    children = by_key(render(make(job_body())))
    for key in [("StatefulSet", "demo-embedding-ps"), ("Job", "demo-nn-worker")]:
        meta = children[key]["spec"]["template"]["metadata"]
        assert meta["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9090",
                                       "prometheus.io/path": "/metrics"}  # fmt: skip
        assert {"name": "metrics", "containerPort": 9090} in container(children[key])["ports"]


def test_attempt_label_on_workloads_and_pods():
    children = render(make(job_body(), attempt=3))
    for child in children:
        if child["kind"] in ("Job", "StatefulSet") and child["metadata"]["labels"][C.LABEL_ROLE] != "nats":
            assert child["metadata"]["labels"][C.LABEL_ATTEMPT] == "3"
            assert child["spec"]["template"]["metadata"]["labels"][C.LABEL_ATTEMPT] == "3"


def test_longest_name_fits_every_child():
    children = render(make(job_body(name="j" * C.MAX_JOB_NAME)))
    for child in children:
        limit = C.MAX_WORKLOAD_NAME if child["kind"] in ("StatefulSet", "Deployment") else 63
        assert len(child["metadata"]["name"]) <= limit, child["metadata"]["name"]


def test_image_precedence():
    body = job_body(image="top:1")
    body["spec"]["embeddingWorker"]["image"] = "ew:2"
    children = by_key(render(make(body)))
    assert container(children[("StatefulSet", "demo-embedding-worker")])["image"] == "ew:2"
    assert container(children[("Job", "demo-nn-worker")])["image"] == "top:1"


def test_render_does_not_mutate_the_job():
    job = make(job_body())
    before = copy.deepcopy(job.model_dump())
    render(job)
    assert job.model_dump() == before


def test_the_runtime_and_the_operator_agree_on_the_jobs_subjects(monkeypatch):
    """The pods' env, read by the runtime (``persia.bus.subject_job``), gives the token the
    operator's NATS probe asks on (``naming.subject_job``): two jobs of one name in two namespaces
    on one external NATS no longer share ``persia.<job>...``."""
    from persia.bus import subject
    from persia_operator import naming
    from persia_operator.reconciler import nats_target
    from persia_operator.spec import parse_spec

    tokens = set()
    for namespace in ("team-a", "team-b"):
        body = job_body()
        body["metadata"]["namespace"] = namespace
        env = env_map(by_key(render(make(body)))[("Job", "demo-nn-worker")])
        monkeypatch.setenv("PERSIA_JOB_NAME", env["PERSIA_JOB_NAME"])
        monkeypatch.setenv("PERSIA_JOB_NAMESPACE", env["PERSIA_JOB_NAMESPACE"])
        token = naming.subject_job("demo", namespace)
        assert subject("checkpoint", "latest") == f"persia.{token}.checkpoint.latest"
        target = nats_target("demo", namespace, parse_spec(body["spec"]), {"demo-auth": {"nats-user": "u"}})
        assert target is not None and target.job == token
        tokens.add(token)
    assert len(tokens) == 2
