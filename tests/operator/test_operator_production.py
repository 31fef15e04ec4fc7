"""Issue 11/14 behaviour as pure tables: stateful-pod replacement, failure rules,
checkpoint status, name validation, external NATS readiness, pod hygiene and the
security rendering (no cluster; derive_status/render/decide only)."""

from __future__ import annotations

import copy
from datetime import timedelta

import kubernetes_validate
import pytest
from operator_testkit import RUNNING, Sim, failed, job_body

from persia_operator import constants as C
from persia_operator.children import Children, PodState, Termination
from persia_operator.conditions import timestamp
from persia_operator.events import transition_events
from persia_operator.failures import Failure, decide, find_failures, rule_for
from persia_operator.job import PersiaJob
from persia_operator.natsinfo import CheckpointReport, NatsObservation, parse_report, redact
from persia_operator.render import render
from persia_operator.spec import FailureRule, SpecError, parse_spec, validate_job


def cond(st, type_):
    c = st.condition(type_)
    return c.status, c.reason


def with_uids(summaries: list[dict], suffix: str = "") -> list[dict]:
    out = copy.deepcopy(summaries)
    for s in out:
        if s["kind"] == "Pod":
            s["uid"] = f"uid-{s['name']}{suffix}"
    return out


def replace_pod(summaries: list[dict], name: str) -> list[dict]:
    out = copy.deepcopy(summaries)
    for s in out:
        if s["kind"] == "Pod" and s["name"] == name:
            s["uid"] += "-new"
            s["created"] = "2026-01-01T12:00:30Z"
    return out


# --- 1. silent PS shard loss ---------------------------------------------------------


def test_started_stateful_pods_are_tracked_by_uid():
    sim = Sim()
    sim.step()
    st = sim.step(with_uids(sim.children()))
    assert st.stateful_pods == {
        "embedding-ps:demo-embedding-ps-0": "uid-demo-embedding-ps-0",
        "embedding-ps:demo-embedding-ps-1": "uid-demo-embedding-ps-1",
        "embedding-worker:demo-embedding-worker-0": "uid-demo-embedding-worker-0",
    }


@pytest.mark.parametrize("change, reason", [
    ("replaced", "PSReplaced"),  # drained/deleted/preempted: the StatefulSet made a new pod, same name
    ("gone", "PSReplaced"),  # deleted, the new one not there yet
    ("deleting", "PSReplaced"),  # deletion under way
])  # fmt: skip
def test_replaced_ps_pod_restarts_the_job_without_counting(change, reason):
    sim = Sim()
    sim.step()
    pods = with_uids(sim.children())
    sim.step(pods)
    assert sim.status.phase == "Running"
    if change == "replaced":
        seen = replace_pod(pods, "demo-embedding-ps-1")
    elif change == "gone":
        seen = [s for s in pods if s["name"] != "demo-embedding-ps-1"]
    else:
        seen = copy.deepcopy(pods)
        next(s for s in seen if s["name"] == "demo-embedding-ps-1")["deleting"] = True
    st = sim.step(seen)
    # Before the fix: Running/AllReplicasReady with restartCount 0 on an empty shard.
    assert cond(st, C.COND_RESTARTING) == ("True", reason)
    assert "demo-embedding-ps-1" in st.condition(C.COND_RESTARTING).message
    assert st.attempt == 1 and st.restart_count == 0 and st.uncounted_restarts == 1
    assert st.stateful_pods == {}  # the new attempt tracks its own pods


def test_replaced_embedding_worker_and_opt_out():
    sim = Sim()
    sim.step()
    pods = with_uids(sim.children())
    sim.step(pods)
    st = sim.step(replace_pod(pods, "demo-embedding-worker-0"))
    assert cond(st, C.COND_RESTARTING) == ("True", "EmbeddingWorkerReplaced")
    # Declared stateless: a replaced embedding worker is not a failure.
    sim = Sim(job_body(failurePolicy={"statefulRoles": ["embeddingParameterServer"]}))
    sim.step()
    pods = with_uids(sim.children())
    sim.step(pods)
    st = sim.step(replace_pod(pods, "demo-embedding-worker-0"))
    assert st.attempt == 0 and st.phase == "Running"


def test_pods_of_an_old_attempt_and_a_pending_pod_are_not_replacements():
    sim = Sim()
    sim.step()
    pending = with_uids(sim.children({"phase": "Pending"}))
    sim.step(pending)
    assert sim.status.stateful_pods == {}  # never started: nothing to lose
    st = sim.step(replace_pod(pending, "demo-embedding-ps-0"))
    assert st.attempt == 0


def test_container_restart_of_a_ps_is_a_failure_even_without_last_state():
    sim = Sim().running()
    pods = sim.children(overrides={"demo-embedding-ps-0": {**RUNNING, "containerStatuses": [
        {"name": "c", "restartCount": 1, "state": {"running": {}}}]}})  # fmt: skip
    st = sim.step(pods)
    assert cond(st, C.COND_RESTARTING) == ("True", "PodFailed") and st.restart_count == 1


# --- 3. failure rules ------------------------------------------------------------------


def F(role=C.ROLE_NN_WORKER, code=None, conditions=(), at=None, reason="PodFailed"):
    return Failure(role, "pod p", reason, f"pod p code {code}", code, frozenset(conditions), at)


@pytest.mark.parametrize("failure, action", [
    (F(conditions={"DisruptionTarget"}), "RestartJobAndIgnoreMaxRestarts"),  # preemption, eviction API
    (F(conditions={"Evicted"}), "RestartJobAndIgnoreMaxRestarts"),  # kubelet pressure eviction
    (F(role=C.ROLE_PS, conditions={"Replaced"}), "RestartJobAndIgnoreMaxRestarts"),
    (F(code=137, conditions={"OOMKilled"}), "RestartJob"),
    (F(code=143), "RestartJob"),
    (F(code=1), "FailJob"),
    (F(code=127), "FailJob"),
    (F(conditions={"NoExitCode"}), "RestartJob"),
])  # fmt: skip
def test_default_rules(failure, action):
    assert rule_for([], failure).action == action


USER_RULES = [
    FailureRule(name="flaky-reader", action="Ignore", roles=["dataloader"],
                on_exit_codes={"operator": "In", "values": [3]}),
    FailureRule(name="nccl-timeout", action="RestartJob", roles=["nnWorker"],
                on_exit_codes={"operator": "In", "values": [42]}),
    FailureRule(name="oom-is-fatal", action="FailJob", on_pod_conditions=["OOMKilled"]),
]  # fmt: skip


@pytest.mark.parametrize("failures, restarts, expected", [
    ([F(code=42)], 0, (False, "PodFailed", True)),  # user rule beats the default FailJob
    ([F(role=C.ROLE_PS, code=42)], 0, (True, "PermanentExitCode", True)),  # rule is for nnWorker only
    ([F(role=C.ROLE_DATALOADER, code=3)], 0, None),  # ignored
    ([F(code=137, conditions={"OOMKilled"})], 0, (True, "PodFailurePolicy", True)),
    ([F(code=42)], 3, (True, "BackoffLimitExceeded", True)),
    ([F(conditions={"DisruptionTarget"}, reason="PodPreempted")], 3, (False, "PodPreempted", False)),
    # The earliest failure decides: a preempted PS, then NN workers failing because of it.
    ([F(code=1, at="2026-01-01T12:00:05Z"), F(role=C.ROLE_PS, conditions={"DisruptionTarget"},
                                              at="2026-01-01T12:00:01Z", reason="PodEvicted")],
     0, (False, "PodEvicted", False)),
    ([F(code=1, at="2026-01-01T12:00:01Z"), F(role=C.ROLE_PS, conditions={"DisruptionTarget"},
                                              at="2026-01-01T12:00:05Z")], 0, (True, "PermanentExitCode", True)),
])  # fmt: skip
def test_decision_table(failures, restarts, expected):
    decision = decide(failures, USER_RULES, restarts, 3)
    if expected is None:
        assert decision is None
    else:
        assert (decision.fail, decision.reason, decision.counted) == expected


def test_rules_in_the_spec_drive_the_status():
    body = job_body(failurePolicy={"rules": [{"name": "nccl-timeout", "action": "RestartJob",
                                              "roles": ["nnWorker"], "onExitCodes": {"operator": "In", "values": [42]}}]})  # fmt: skip
    sim = Sim(body).running()
    st = sim.step(sim.children(overrides={"demo-nn-worker-0": failed(42)}))
    assert cond(st, C.COND_RESTARTING) == ("True", "PodFailed") and st.restart_count == 1
    assert "failurePolicy rule nccl-timeout" in st.condition(C.COND_RESTARTING).message


def test_preemption_of_a_pod_is_read_from_its_disruption_condition():
    pod = PodState(name="p", role=C.ROLE_NN_WORKER, attempt="0", phase="Failed", disrupted=True,
                   disruption_reason="PreemptionByScheduler", terminations=(Termination("c", 143, "Error"),))  # fmt: skip
    spec = parse_spec(job_body()["spec"])
    found = find_failures(spec, "demo", Children(pods=(pod,)), 0)
    assert found[0].reason == "PodPreempted" and "DisruptionTarget" in found[0].conditions


def test_bad_rules_name_the_field():
    with pytest.raises(SpecError, match="failurePolicy.rules.0.action"):
        parse_spec(job_body(failurePolicy={"rules": [{"action": "Explode"}]})["spec"])
    with pytest.raises(SpecError, match="exit codes must be between 0 and 255"):
        parse_spec(job_body(failurePolicy={"rules": [{"action": "Ignore",
                                                      "onExitCodes": {"operator": "In", "values": [300]}}]})["spec"])  # fmt: skip


# --- 2. checkpoints and resume ---------------------------------------------------------

CKPT = {"persistentVolumeClaim": "persia-ckpt", "intervalSteps": 500, "intervalSeconds": 600, "keep": 2}


def env_of(manifest):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in manifest["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_checkpoint_env_and_volume_on_the_roles_that_write_them():
    meta, spec = validate_job(job_body(checkpoint=CKPT))
    children = {(m["kind"], m["metadata"]["name"]): m for m in render(PersiaJob(metadata=meta, spec=spec))}
    for key in [("StatefulSet", "demo-embedding-ps"), ("StatefulSet", "demo-embedding-worker"), ("Job", "demo-nn-worker")]:
        env = env_of(children[key])
        assert env["PERSIA_CHECKPOINT_DIR"] == "/checkpoints/demo"
        assert (env["PERSIA_CHECKPOINT_INTERVAL_STEPS"], env["PERSIA_CHECKPOINT_INTERVAL_SECONDS"]) == ("500", "600.0")
        assert (env["PERSIA_CHECKPOINT_KEEP"], env["PERSIA_RESUME"]) == ("2", "auto")
        pod = children[key]["spec"]["template"]["spec"]
        assert {"name": "persia-checkpoints", "persistentVolumeClaim": {"claimName": "persia-ckpt"}} in pod["volumes"]
        assert {"name": "persia-checkpoints", "mountPath": "/checkpoints"} in pod["containers"][0]["volumeMounts"]
    assert "PERSIA_CHECKPOINT_DIR" not in env_of(children[("Job", "demo-dataloader")])


def test_every_attempt_of_a_job_carries_its_run_id_and_a_new_job_of_the_name_another():
    """The runtime resumes a restart from the checkpoints of its run whatever ``resume`` says;
    the run is the PersiaJob's uid, the same in every attempt, another for a recreated job."""
    def run_ids(uid, attempt, resume):
        body = job_body(checkpoint={**CKPT, "resume": resume})
        body["metadata"]["uid"] = uid
        meta, spec = validate_job(body)
        job = PersiaJob(metadata=meta, spec=spec)
        job.status.attempt = attempt
        return {env_of(m)["PERSIA_RUN_ID"] for m in render(job) if m["kind"] in ("StatefulSet", "Job")
                and "PERSIA_RUN_ID" in env_of(m)}

    assert run_ids("uid-1", 0, "never") == run_ids("uid-1", 3, "never") == {"uid-1"}
    assert run_ids("uid-2", 0, "never") == {"uid-2"}


@pytest.mark.parametrize("ckpt, error", [
    ({"intervalSteps": 5}, "exactly one of persistentVolumeClaim and volume"),
    ({"persistentVolumeClaim": "a", "volume": "b"}, "exactly one of persistentVolumeClaim and volume"),
    ({"volume": "nope"}, "checkpoint.volume: volume 'nope' is not in spec.volumes"),
    ({"persistentVolumeClaim": "a", "dir": "/elsewhere"}, "must lie under checkpoint.mountPath"),
    ({"persistentVolumeClaim": "a", "intervalSteps": 0}, "intervalSteps"),
])  # fmt: skip
def test_checkpoint_spec_errors(ckpt, error):
    with pytest.raises(SpecError, match=error):
        parse_spec(job_body(checkpoint=ckpt)["spec"])


def observation(step, resumed_from=None, at=None, connected=True):
    report = CheckpointReport(step=step, time=1767268800.0, path=f"/checkpoints/demo/ckpt-{step:012d}",
                              resumed_from=resumed_from)  # fmt: skip
    return NatsObservation(connected, checkpoint=report, at=at)


def test_status_shows_last_checkpoint_and_what_the_restart_resumed_from():
    sim = Sim(job_body(checkpoint=CKPT)).running()
    st = sim.step(sim.children(), nats=observation(1000, at=sim.now))
    assert (st.checkpoint.step, st.checkpoint.time) == (1000, "2026-01-01T12:00:00Z")
    assert st.checkpoint.resumed_from is None
    st = sim.step(sim.children(overrides={"demo-nn-worker-0": failed(137)}))
    assert st.attempt == 1
    # A reply from before the restart: still the last checkpoint, not what attempt 1 resumed from.
    st = sim.step(sim.children(), nats=observation(1000, at=sim.now - timedelta(seconds=30)))
    assert st.checkpoint.step == 1000 and st.checkpoint.resumed_from is None
    st = sim.step(sim.children(), nats=observation(1000, "/checkpoints/demo/ckpt-000000001000", at=sim.now))
    assert st.checkpoint.resumed_from == "/checkpoints/demo/ckpt-000000001000" and st.checkpoint.resumed_attempt == 1
    st = sim.step(sim.children(), nats=observation(1500, "/checkpoints/demo/ckpt-000000001000", at=sim.now))
    assert st.checkpoint.step == 1500 and st.checkpoint.observed_time == timestamp(sim.now)


@pytest.mark.parametrize("data, error", [
    (b"not json", "not JSON"),
    (b'{"step": -1, "time": 1, "path": "x"}', "step"),
    (b'{"time": 1, "path": "x"}', "step"),
    (b"x" * 70000, "too large"),
])  # fmt: skip
def test_checkpoint_reports_are_validated(data, error):
    with pytest.raises(ValueError, match=error):
        parse_report(data)


# --- 6. validation in the operator, external NATS readiness ---------------------------


def test_a_44_character_name_fails_in_the_operator_and_renders_nothing():
    name = "a" * 44
    sim = Sim(job_body(name=name))
    st = sim.step()
    assert cond(st, C.COND_FAILED) == ("True", "InvalidSpec")
    assert f"is 44 characters; at most {C.MAX_JOB_NAME}" in st.condition(C.COND_FAILED).message
    assert st.accepted_spec is None or st.phase == "Failed"


def test_every_child_name_fits_for_the_longest_name():
    name = "a" * C.MAX_JOB_NAME
    meta, spec = validate_job(job_body(name=name, checkpoint=CKPT, scheduling={"gang": "volcano"}))
    for m in render(PersiaJob(metadata=meta, spec=spec)):
        limit = C.MAX_WORKLOAD_NAME if m["kind"] == "StatefulSet" else 63
        assert len(m["metadata"]["name"]) <= limit, m["metadata"]["name"]


EXTERNAL = {"externalURL": "nats://user:hunter2@nats.shared:4222"}


@pytest.mark.parametrize("nats, reason", [
    (None, "NatsNotChecked"),
    (NatsObservation(False, "ConnectionRefusedError: refused"), "NatsUnreachable"),
    (NatsObservation(True), "ExternalNats"),
])  # fmt: skip
def test_external_nats_is_ready_only_once_connected(nats, reason):
    sim = Sim(job_body(nats=EXTERNAL))
    sim.step()
    st = sim.step(sim.children(), nats=nats)
    assert cond(st, C.COND_NATS_READY) == ("True" if reason == "ExternalNats" else "False", reason)
    assert (st.phase == "Running") == (reason == "ExternalNats")
    # The URL's credentials never reach natsURL or a condition (events are made from those);
    # acceptedSpec repeats the spec as written: use nats.auth to keep them out of the spec.
    shown = st.to_wire()
    shown.pop("acceptedSpec")
    assert "hunter2" not in str(shown)
    assert st.nats_url == "nats://***@nats.shared:4222"


def test_a_restarted_operator_keeps_the_last_word_on_an_external_nats():
    """A restarted operator (or a new leader) has probed nothing yet: its first pass reported a
    healthy job's NatsReady and Ready False (`NatsNotChecked`, "external NATS not reachable"),
    with Events, until its first probe a few seconds later. Until then, the last verdict stands."""
    sim = Sim(job_body(nats=EXTERNAL))
    sim.step()
    sim.step(sim.children(), nats=NatsObservation(True))
    before = sim.status.model_copy(deep=True)
    assert sim.status.phase == "Running" and sim.status.is_true(C.COND_READY)
    st = sim.step(sim.children(), nats=None)  # the first pass of a restarted operator
    assert cond(st, C.COND_NATS_READY) == ("True", "ExternalNats")
    assert st.condition(C.COND_NATS_READY) == before.condition(C.COND_NATS_READY)
    assert cond(st, C.COND_READY) == ("True", "AllReplicasReady")
    assert transition_events(before, st) == []
    st = sim.step(sim.children(), nats=NatsObservation(False, "ConnectionRefusedError: refused"))
    assert cond(st, C.COND_NATS_READY) == ("False", "NatsUnreachable") and not st.is_true(C.COND_READY)
    st = sim.step(sim.children(), nats=None)  # restarted again: unreachable stays unreachable
    assert cond(st, C.COND_NATS_READY) == ("False", "NatsUnreachable")


def test_redact():
    assert redact("nats://u:p@h:4222,tls://t@h2") == "nats://***@h:4222,tls://***@h2"
    assert redact("auth failed for sekrit-token", ("sekrit-token",)) == "auth failed for ***"


# --- 5. pod hygiene; 14. security rendering --------------------------------------------


def rendered(body):
    meta, spec = validate_job(body)
    return {(m["kind"], m["metadata"]["name"]): m for m in render(PersiaJob(metadata=meta, spec=spec))}


def test_pod_hygiene_defaults():
    children = rendered(job_body(nnWorker={"replicas": 2, "nprocPerNode": 4, "shmSize": "8Gi",
                                           "resources": {"limits": {"nvidia.com/gpu": "4"}}}))  # fmt: skip
    ps = children[("StatefulSet", "demo-embedding-ps")]["spec"]["template"]["spec"]
    nn = children[("Job", "demo-nn-worker")]["spec"]["template"]["spec"]
    nats = children[("StatefulSet", "demo-nats")]["spec"]["template"]["spec"]
    for pod in (ps, nn, nats):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert ps["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert nn["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False  # runs user code
    assert {"name": "tmp", "mountPath": "/tmp"} in ps["containers"][0]["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in nn["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in nn["containers"][0]["volumeMounts"]
    assert ps["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert ps["terminationGracePeriodSeconds"] == nn["terminationGracePeriodSeconds"] == 35
    assert ps["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": 2}}
    assert nats["containers"][0]["resources"]["requests"]["memory"] == "512Mi"
    assert nn["initContainers"][0]["name"] == "wait-for-nats"  # waits instead of exiting non-zero
    pdb = children[("PodDisruptionBudget", "demo-embedding-ps")]["spec"]
    assert pdb["maxUnavailable"] == 0 and pdb["selector"]["matchLabels"][C.LABEL_ROLE] == C.ROLE_PS
    assert ("PodDisruptionBudget", "demo-nats") in children
    for m in children.values():
        kubernetes_validate.validate(m, "1.30", strict=True)


def test_security_context_none_leaves_pods_alone():
    ps = rendered(job_body(securityContext="none"))[("StatefulSet", "demo-embedding-ps")]["spec"]["template"]["spec"]
    assert "securityContext" not in ps and "securityContext" not in ps["containers"][0]


def test_nproc_per_node_is_checked_against_gpus():
    with pytest.raises(SpecError, match="nprocPerNode 8 is more than the 4 GPUs"):
        parse_spec(job_body(nnWorker={"replicas": 1, "nprocPerNode": 8,
                                      "resources": {"limits": {"nvidia.com/gpu": 4}}})["spec"])  # fmt: skip


def test_external_nats_auth_and_tls_by_reference_only():
    body = job_body(nats={"externalURL": "tls://nats.shared:4222", "auth": {"secretName": "nats-creds", "type": "creds"},
                          "tls": {"secretName": "nats-tls"}}, grpcTLS={"secretName": "persia-grpc"})  # fmt: skip
    children = rendered(body)
    assert not [k for k in children if k[0] == "StatefulSet" and "nats" in k[1]]  # no managed NATS
    ew = children[("StatefulSet", "demo-embedding-worker")]
    env = env_of(ew)
    assert env["PERSIA_NATS_CREDS"] == "/var/run/persia/nats-creds/creds"
    assert env["PERSIA_NATS_TLS_CA"] == "/var/run/persia/nats-tls/ca.crt"
    assert env["PERSIA_GRPC_TLS_KEY"] == "/var/run/persia/grpc-tls/tls.key"
    # The certificate names *.demo-embedding-worker.ns1.svc: advertise the pod's DNS name.
    assert env["PERSIA_ADVERTISE_HOST"] == "$(POD_NAME).demo-embedding-worker.ns1.svc"
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "PERSIA_ADVERTISE_HOST" not in env_of(children[("Job", "demo-nn-worker")])
    assert env["PERSIA_BIND_ADDRESS"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["PERSIA_JOB_SECRET"] == {"secretKeyRef": {"name": "demo-auth", "key": "job-secret"}}
    volumes = {v["name"]: v for v in ew["spec"]["template"]["spec"]["volumes"]}
    assert volumes["grpc-tls"]["secret"]["secretName"] == "persia-grpc"
    # readable by the images' user without an fsGroup (securityContext: none): files are root's
    assert {volumes[n]["secret"]["defaultMode"] for n in ("nats-creds", "nats-tls", "grpc-tls")} == {0o444}
    mounts = {m["name"]: m for m in ew["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert all(mounts[n]["readOnly"] for n in ("nats-creds", "nats-tls", "grpc-tls"))
    token = rendered(job_body(nats={"externalURL": "nats://n:4222", "auth": {"secretName": "t", "type": "token"}}))
    assert env_of(token[("Job", "demo-nn-worker")])["PERSIA_NATS_TOKEN"] == {"secretKeyRef": {"name": "t", "key": "token"}}


def test_nats_auth_is_for_external_nats_only():
    with pytest.raises(SpecError, match="nats.auth and nats.tls are for an external NATS"):
        parse_spec(job_body(nats={"auth": {"secretName": "x"}})["spec"])


def test_managed_nats_reads_credentials_from_the_generated_secret():
    nats = rendered(job_body())[("StatefulSet", "demo-nats")]["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in nats["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {"NATS_USER": {"name": "demo-auth", "key": "nats-user"},
                    "NATS_PASSWORD": {"name": "demo-auth", "key": "nats-password"}}  # fmt: skip
    conf = rendered(job_body())[("ConfigMap", "demo-nats-config")]["data"]["nats.conf"]
    assert "password: $NATS_PASSWORD" in conf


# --- 4. gang scheduling and queueing ------------------------------------------------------


@pytest.mark.parametrize("gang, api_version, scheduler", [
    ("volcano", "scheduling.volcano.sh/v1beta1", "volcano"),
    ("coscheduling", "scheduling.x-k8s.io/v1alpha1", "scheduler-plugins-scheduler"),
])  # fmt: skip
def test_pod_group_counts_every_pod_and_every_pod_joins_it(gang, api_version, scheduler):
    children = rendered(job_body(scheduling={"gang": gang, "queue": "gpu", "scheduleTimeoutSeconds": 600}))
    group = children[("PodGroup", "demo-gang")]
    assert group["apiVersion"] == api_version
    # 2 PS + 1 embedding worker + 2 NN workers + 1 data loader + 1 NATS
    assert group["spec"]["minMember"] == 7
    assert ("queue" in group["spec"]) == (gang == "volcano")
    members = 0
    for (kind, _), m in children.items():
        if kind in ("StatefulSet", "Job"):
            pod = m["spec"]["template"]
            assert pod["spec"]["schedulerName"] == scheduler
            if gang == "volcano":
                assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "demo-gang"
            else:
                assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "demo-gang"
            members += m["spec"].get("replicas", m["spec"].get("completions"))
    assert members == group["spec"]["minMember"]


def test_a_kueue_queue_label_is_refused_naming_it():
    """Kueue's plain-pod groups skip pods an integration of Kueue's own owns (a Job always):
    the group's total was never reached and the servers' pods stayed gated for ever."""
    body = job_body()
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    with pytest.raises(SpecError) as err:
        validate_job(body)
    assert any(p.startswith("metadata.labels.kueue.x-k8s.io/queue-name='team-a': Kueue is not supported yet")
               for p in err.value.problems), err.value.problems


def test_the_operator_refuses_a_kueue_queue_label_too():
    """docs/operator.md promised Failed/InvalidSpec for the label, but only `persia-operator
    render` checked it: the operator created the children, which Kueue never admitted as one."""
    body = job_body()
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    sim = Sim(body)
    st = sim.step()
    assert cond(st, C.COND_FAILED) == ("True", "InvalidSpec")
    assert "metadata.labels.kueue.x-k8s.io/queue-name='team-a'" in st.condition(C.COND_FAILED).message
    assert st.accepted_spec is None and st.phase == "Failed"
    # A running job labelled later goes on: the label changes nothing for pods that exist,
    # and failing a training run for a label edit would be worse than ignoring it.
    running = Sim().running()
    running.body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    st = running.step(running.children())
    assert st.phase == "Running"


def test_jobs_managed_by_another_controller_are_left_alone():
    from persia_operator.reconciler import managed_here

    assert managed_here(job_body()) and managed_here(job_body(managedBy=C.MANAGED_BY_VALUE))
    assert not managed_here(job_body(managedBy="kueue.x-k8s.io/multikueue"))


def test_an_empty_managed_by_is_refused_not_ignored():
    """`managedBy: ""` (a templating slip) read as "another controller's": the job was ignored for
    ever, without a status or an event saying why. It is this operator's job, refused naming it."""
    from persia_operator.reconciler import managed_here

    body = job_body(managedBy="")
    assert managed_here(body)
    st = Sim(body).step()
    assert cond(st, C.COND_FAILED) == ("True", "InvalidSpec")
    assert "spec.managedBy: String should have at least 1 character (got '')" in st.condition(C.COND_FAILED).message


def test_a_job_runs_without_its_pdbs():
    from persia_operator.status import ChildError

    sim = Sim()
    sim.step()
    pods = [s for s in sim.children() if s["kind"] != "PodDisruptionBudget"]
    error = ChildError("PodDisruptionBudget", "demo-embedding-ps", 404, "404 NotFound: the server could not find it")
    st = sim.step(pods, errors=[error])
    assert st.phase == "Running" and cond(st, C.COND_CREATED) == ("True", "ChildrenCreated")
    assert "PodDisruptionBudget/demo-embedding-ps not created" in st.condition(C.COND_CREATED).message
