"""plan_actions: the API calls that follow from a derived status (pure)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from operator_testkit import Sim, failed, job_body

from persia_operator import constants as C
from persia_operator.children import Children
from persia_operator.plan import Create, Delete, DeleteJob, Patch, plan_actions
from persia_operator.spec import JobMeta


def plan(sim: Sim, summaries, seconds: float = 0):
    meta = JobMeta.model_validate(sim.body["metadata"])
    return plan_actions(meta, sim.status, Children.from_summaries(summaries, owner_uid="uid-1"),
                        sim.now + timedelta(seconds=seconds))  # fmt: skip


def keys(actions, kind):
    return sorted(
        (a.manifest["kind"], a.manifest["metadata"]["name"]) if isinstance(a, Create) else (a.kind, a.name)
        for a in actions
        if isinstance(a, kind)
    )


def test_fresh_job_creates_every_child():
    sim = Sim()
    sim.step()
    actions = plan(sim, [])
    assert all(isinstance(a, Create) for a in actions)
    expected = [(m["kind"], m["metadata"]["name"]) for m in sim.manifests()] + [("Secret", "demo-auth")]
    assert keys(actions, Create) == sorted(expected)
    secret = next(a.manifest for a in actions if a.key == ("Secret", "demo-auth"))
    # Random credentials, a fresh one per key; the managed NATS and the pods read them.
    data = secret["stringData"]
    assert data["nats-user"] == "persia" and len(data["nats-password"]) >= 32
    assert data["job-secret"] != data["nats-password"]
    # Route credentials of the NATS cluster, apart from the clients' (no PERSIA pod has them).
    assert data["nats-route-user"] == "persia-route" and len(data["nats-route-password"]) >= 32
    assert len({data["nats-password"], data["nats-route-password"], data["job-secret"]}) == 3


def test_generated_tokens_start_with_a_letter(monkeypatch):
    """nats-server reads `$NATS_PASSWORD` from env as a config value: a password starting
    with '-' (1 in 64 of token_urlsafe) made it exit with a parse error (see
    test_operator_nats_conf for the real server)."""
    import secrets

    from persia_operator.plan import new_token

    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "-" + "x" * 42)
    token = new_token()
    assert token[0].isalpha() and token.endswith("-" + "x" * 42)


def test_complete_job_needs_nothing():
    sim = Sim().running()
    assert plan(sim, sim.children()) == []


def test_deleted_children_are_recreated():
    sim = Sim().running()
    actions = plan(sim, sim.children(skip=("Service/demo-nn-worker", "StatefulSet/demo-embedding-ps")))
    assert keys(actions, Create) == [("Service", "demo-nn-worker"), ("StatefulSet", "demo-embedding-ps")]


def test_restart_replaces_workloads_of_the_old_attempt():
    sim = Sim().running()
    old = sim.children(overrides={"demo-nn-worker-0": failed(137)})
    sim.step(old)
    assert sim.status.attempt == 1
    actions = plan(sim, old)
    # Training workloads of attempt 0 go; NATS, Services and ConfigMaps stay.
    assert keys(actions, Delete) == [("Job", "demo-dataloader"), ("Job", "demo-nn-worker"),
                                     ("StatefulSet", "demo-embedding-ps"), ("StatefulSet", "demo-embedding-worker")]  # fmt: skip
    assert keys(actions, Create) == []  # same names: created once the old ones are gone
    gone = [s for s in old if s["kind"] in ("Service", "ConfigMap", "Secret", "PodDisruptionBudget")
            or s.get("role") == "nats"]  # fmt: skip
    created = keys(plan(sim, gone), Create)
    assert created == [("Job", "demo-dataloader"), ("Job", "demo-nn-worker"),
                       ("StatefulSet", "demo-embedding-ps"), ("StatefulSet", "demo-embedding-worker")]  # fmt: skip
    new = [a for a in plan(sim, gone) if isinstance(a, Create)]
    assert {a.manifest["metadata"]["labels"][C.LABEL_ATTEMPT] for a in new} == {"1"}


@pytest.mark.parametrize(
    "policy, deleted",
    [
        ("Running", [("Job", "demo-dataloader"), ("StatefulSet", "demo-embedding-ps"),
                     ("StatefulSet", "demo-embedding-worker"), ("StatefulSet", "demo-nats")]),
        ("All", [("Job", "demo-dataloader"), ("Job", "demo-nn-worker"), ("StatefulSet", "demo-embedding-ps"),
                 ("StatefulSet", "demo-embedding-worker"), ("StatefulSet", "demo-nats")]),
        ("None", []),
    ],
)  # fmt: skip
def test_clean_pod_policy_after_success(policy, deleted):
    sim = Sim(job_body(runPolicy={"cleanPodPolicy": policy})).running()
    done = {"demo-nn-worker": {"conditions": [{"type": "Complete", "status": "True"}]}}
    sim.step(sim.children(workload_status=done))
    assert sim.status.phase == "Succeeded"
    actions = plan(sim, sim.children(workload_status=done))
    assert keys(actions, Delete) == deleted
    assert keys(actions, Create) == []


def test_cleanup_after_failure_keeps_the_failed_job():
    sim = Sim().running()
    failed_job = {"demo-nn-worker": {"conditions": [{"type": "Failed", "status": "True"}]}}
    sim.step(sim.children(overrides={"demo-nn-worker-0": failed(1)}, workload_status=failed_job))
    actions = plan(sim, sim.children(workload_status=failed_job))
    assert ("Job", "demo-nn-worker") not in keys(actions, Delete)
    assert ("StatefulSet", "demo-embedding-ps") in keys(actions, Delete)


def test_ttl_after_finished_deletes_the_job():
    sim = Sim(job_body(runPolicy={"ttlSecondsAfterFinished": 60})).running()
    sim.step(sim.children(overrides={"demo-embedding-ps-0": failed(2)}))
    assert not [a for a in plan(sim, [], seconds=59) if isinstance(a, DeleteJob)]
    assert [a for a in plan(sim, [], seconds=60) if isinstance(a, DeleteJob)]


def test_no_ttl_no_delete():
    sim = Sim().running()
    sim.step(sim.children(overrides={"demo-embedding-ps-0": failed(2)}))
    assert not [a for a in plan(sim, [], seconds=10**6) if isinstance(a, DeleteJob)]


def test_suspended_job_removes_workloads_only():
    sim = Sim().running()
    sim.body["spec"]["runPolicy"] = {"suspend": True}
    sim.step(sim.children())
    actions = plan(sim, sim.children())
    assert {k for k, _ in keys(actions, Delete)} == {"StatefulSet", "Job"}
    assert len(keys(actions, Delete)) == 5 and keys(actions, Create) == []


def test_online_resize_patches_the_deployment():
    sim = Sim(job_body(trainingMode="online")).running()
    before = sim.children()
    sim.body["spec"]["dataloader"]["replicas"] = 3
    sim.step(before)
    patches = [a for a in plan(sim, before) if isinstance(a, Patch)]
    assert [(p.kind, p.name, p.patch["spec"]["replicas"]) for p in patches] == [("Deployment", "demo-dataloader", 3)]
    env = patches[0].patch["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "REPLICA_SIZE", "value": "3"} in env


def test_never_accepted_spec_plans_nothing():
    body = job_body()
    body["spec"]["nats"] = {"maxPayload": 0}
    sim = Sim(body)
    sim.step()
    assert plan(sim, []) == []


def _with_config_hash(summaries, digest):
    """The summaries as the index lists them, the job's config ConfigMap with content ``digest``."""
    return [{**s, "data_hash": digest} if s["kind"] == "ConfigMap" and s["name"] == "demo-config" else s
            for s in summaries]


def test_configs_edited_while_suspended_reach_the_resumed_pods():
    """"Suspend, edit, resume" is the documented way to change a live job's configs, but the
    ConfigMap was only ever created: the resumed pods read the configs first submitted."""
    sim = Sim().running()
    resumed = [s for s in sim.children() if s["kind"] not in ("StatefulSet", "Job", "Deployment", "Pod")
               or s["role"] not in C.TRAINING_ROLES]  # suspended: the training workloads are gone
    stale = _with_config_hash(resumed, "0123456789abcdef")  # the content before the edit
    actions = plan(sim, stale)
    [patch] = [a for a in actions if isinstance(a, Patch)]
    assert (patch.kind, patch.name) == ("ConfigMap", "demo-config")
    assert "forward_buffer_size: 1000" in patch.patch["data"]["global_config.yml"]
    # no training workload is created before the new content shows: none reads the old
    assert not [a for a in actions if isinstance(a, Create) and a.manifest["kind"] in ("StatefulSet", "Job")]
    # once the index shows the new content, the workloads are created, and nothing is patched
    actions = plan(sim, resumed)
    assert not [a for a in actions if isinstance(a, Patch)]
    assert keys(actions, Create) and all(k in ("StatefulSet", "Job") for k, _ in keys(actions, Create))


def test_a_running_attempt_never_gets_its_configs_changed_under_it():
    sim = Sim().running()
    actions = plan(sim, _with_config_hash(sim.children(), "0123456789abcdef"))
    assert not [a for a in actions if isinstance(a, Patch)]  # a restarted pod would read other configs


@pytest.mark.parametrize("gang, api_version", [
    ("volcano", "scheduling.volcano.sh/v1beta1"), ("coscheduling", "scheduling.x-k8s.io/v1alpha1")])  # fmt: skip
@pytest.mark.parametrize("mode", ["batch", "online"])
def test_a_resize_sets_the_pod_group_to_the_new_size(gang, api_version, mode):
    """The PodGroup was only ever created: scaled down, its minMember stayed above the job's pods
    (the gang never scheduled again); scaled up, the new pods could start partly placed."""
    sim = Sim(job_body(scheduling={"gang": gang}, trainingMode=mode)).running()
    old = sim.children()  # the PodGroup as created: minMember 7
    sim.body["spec"]["nnWorker"]["replicas"] = 1
    sim.step(old)
    actions = plan(sim, old)
    patches = [a for a in actions if isinstance(a, Patch)]
    assert [(p.kind, p.name, p.patch) for p in patches][:1] == [("PodGroup", "demo-gang", {"spec": {"minMember": 6}})]
    assert patches[0].api_version == api_version  # the path of the gang scheduler's PodGroup
    # before the workloads of the new size: an online job's Deployment is scaled in the same pass
    assert [p.kind for p in patches] == (["PodGroup", "Deployment"] if mode == "online" else ["PodGroup"])
    resized = [{**s, "min_member": 6} if s["kind"] == "PodGroup" else s for s in old]
    assert not [a for a in plan(sim, resized) if isinstance(a, Patch) and a.kind == "PodGroup"]


def test_a_deleted_auth_secret_restarts_nats_and_the_job():
    """`<job>-auth` deleted by hand (a cleanup script, `kubectl delete secret`) was re-created with
    new random credentials while the running NATS and pods kept the old ones: the next container
    restart read the new password (refused by the NATS) and the new job secret (its signed
    controls refused by its peers), and a whole-job restart did not help, since the NATS was kept.
    Now the NATS goes with the old credentials and the job restarts (not counted) on the new."""
    from test_operator_production import with_uids

    sim = Sim()
    sim.step()
    kids = with_uids(sim.children())
    sim.step(kids)
    assert sim.status.phase == "Running"
    without = [s for s in kids if (s["kind"], s["name"]) != ("Secret", "demo-auth")]
    st = sim.step(without)
    restarting = st.condition(C.COND_RESTARTING)
    assert (restarting.status, restarting.reason) == ("True", "SecretReplaced")
    assert "Secret demo-auth" in restarting.message
    assert st.attempt == 1 and st.restart_count == 0 and st.uncounted_restarts == 1
    actions = plan(sim, without)
    assert ("Secret", "demo-auth") in keys(actions, Create)
    assert ("StatefulSet", "demo-nats") in keys(actions, Delete)
    # One restart: the next pass sees the old NATS going and the old attempt's workloads, even
    # while the Secret is not there yet (its create failed), and restarts nothing more.
    going = [{**s, "deleting": True} if s["kind"] in ("StatefulSet", "Pod") and s["name"].startswith("demo-nats")
             else s for s in without]  # fmt: skip
    st = sim.step(going)
    assert st.attempt == 1 and st.uncounted_restarts == 1
    # A job whose pods never started holds no credentials: the Secret is just created.
    fresh = Sim()
    fresh.step()
    st = fresh.step([s for s in fresh.children(pods=None) if s["kind"] != "Secret"])
    assert st.attempt == 0 and not st.is_true(C.COND_RESTARTING)
    assert ("StatefulSet", "demo-nats") not in keys(plan(fresh, fresh.children(pods=None)), Delete)


def test_nats_edited_while_suspended_reaches_the_resumed_nats():
    """"Suspend, edit, resume" applies every change, and suspending deletes the NATS, but its
    ConfigMap was only ever created: `nats.replicas` 1 -> 3 resumed three servers without a
    `cluster` block (no routes: roles on different servers never met), a raised `maxPayload`
    stayed at the old limit. Between suspend and resume the ConfigMap is rewritten, and the
    NATS StatefulSet created once the new content shows (as for the job's configs)."""
    sim = Sim().running()
    old = {s["name"]: s for s in sim.children() if s["kind"] == "ConfigMap"}["demo-nats-config"]["data_hash"]
    sim.body["spec"]["runPolicy"] = {"suspend": True}
    suspended = [s for s in sim.children() if s["kind"] not in ("StatefulSet", "Job", "Pod")]
    sim.step(suspended)
    sim.body["spec"]["runPolicy"] = {"suspend": False}
    sim.body["spec"]["nats"] = {"replicas": 3, "maxPayload": 8 * 1024 * 1024}
    stale = [{**s, "data_hash": old} if s["name"] == "demo-nats-config" else s
             for s in suspended if s["kind"] != "PodDisruptionBudget"]  # fmt: skip
    st = sim.step(stale)
    assert st.accepted_spec["nats"]["replicas"] == 3 and not st.is_true(C.COND_SUSPENDED)
    actions = plan(sim, stale)
    patches = [a for a in actions if isinstance(a, Patch) and a.name == "demo-nats-config"]
    assert len(patches) == 1
    conf = patches[0].patch["data"]["nats.conf"]
    assert "max_payload: 8388608" in conf and "$NATS_ROUTE_2" in conf
    assert ("StatefulSet", "demo-nats") not in keys(actions, Create)  # not before the new content shows
    fresh = [s for s in sim.children(pods=None) if s["kind"] not in ("StatefulSet", "Job")]
    actions = plan(sim, fresh)
    assert ("StatefulSet", "demo-nats") in keys(actions, Create)
    assert not [a for a in actions if isinstance(a, Patch)]
    # A NATS that runs never gets its configuration changed under it (a restarted server would
    # run another one than its peers).
    running = Sim().running()
    kids = [{**s, "data_hash": "0123"} if s["name"] == "demo-nats-config" else s for s in running.children()]
    assert not [a for a in plan(running, kids) if isinstance(a, Patch)]


def test_ttl_and_cleanup_set_after_the_job_finished_are_applied():
    """runPolicy.ttlSecondsAfterFinished and cleanPodPolicy are documented as read on every pass,
    and setting them on a finished job is how one cleans it up; but a finished job's status is
    sticky, acceptedSpec included, so both were ignored: the job and its pods stayed for ever."""
    sim = Sim().running()
    sim.step(sim.children(overrides={"demo-embedding-ps-0": failed(2)}))
    assert sim.status.phase == "Failed"
    done = sim.status.model_copy(deep=True)
    sim.body["spec"]["runPolicy"] = {"ttlSecondsAfterFinished": 0, "cleanPodPolicy": "All", "backoffLimit": 9}
    st = sim.step(sim.children(), seconds=5)
    assert st.accepted_spec["runPolicy"]["ttlSecondsAfterFinished"] == 0
    assert st.accepted_spec["runPolicy"]["cleanPodPolicy"] == "All"
    assert st.accepted_spec["runPolicy"]["backoffLimit"] == 3  # the rest stays as it ran
    assert st.conditions == done.conditions and st.phase == "Failed"
    actions = plan(sim, sim.children())
    assert any(isinstance(a, DeleteJob) for a in actions)
    sim.body["spec"]["runPolicy"] = {"cleanPodPolicy": "All"}
    st = sim.step(sim.children())
    assert "ttlSecondsAfterFinished" not in st.accepted_spec["runPolicy"]  # removed again: kept
    sim.body["spec"]["nnWorker"]["replicas"] = 0  # an invalid edit changes nothing
    assert sim.step(sim.children()).accepted_spec == st.accepted_spec
