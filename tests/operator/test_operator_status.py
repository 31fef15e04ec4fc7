"""derive_status over a table of job and child states (pure: no cluster, fixed clock)."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from operator_testkit import EVICTED, NOW, PENDING, Sim, failed, job_body, observe, restarted

from persia_operator import constants as C
from persia_operator.conditions import derive_phase, timestamp
from persia_operator.job import JobStatus, PersiaJob
from persia_operator.render import render
from persia_operator.spec import parse_spec
from persia_operator.status import ChildError

def cond(status: JobStatus, type_: str) -> tuple[str, str]:
    c = status.condition(type_)
    assert c is not None, type_
    return c.status, c.reason


def test_first_sight_initialises_everything():
    st = Sim().step()
    assert [c.type for c in st.conditions] == list(C.CONDITION_TYPES)
    assert cond(st, C.COND_CREATED) == ("False", "Creating")
    assert cond(st, C.COND_SPEC_ACCEPTED) == ("True", "Accepted")
    assert cond(st, C.COND_FAILED) == ("False", "Pending")
    assert st.phase == "Pending" and st.start_time == st.attempt_start_time == timestamp(NOW + timedelta(seconds=1))
    assert st.accepted_spec["nnWorker"]["replicas"] == 2
    assert st.nats_url == "nats://demo-nats.ns1.svc:4222"
    assert st.replica_statuses["nnWorker"].ready_ratio == "0/2"
    assert st.observed_generation == 1


def test_created_but_pending_pods_is_starting():
    sim = Sim()
    sim.step()
    st = sim.step(sim.children(PENDING))
    assert cond(st, C.COND_CREATED) == ("True", "ChildrenCreated")
    assert cond(st, C.COND_READY) == ("False", "ReplicasNotReady")
    assert "nnWorker 0/2 (ImagePullBackOff)" in st.condition(C.COND_READY).message
    assert st.phase == "Starting" and st.attempt_ready_time is None


def test_all_ready_is_running():
    sim = Sim().running()
    st = sim.status
    assert cond(st, C.COND_READY) == ("True", "AllReplicasReady")
    assert cond(st, C.COND_NATS_READY) == ("True", "NatsAvailable")
    assert st.replica_statuses["nnWorker"].ready_ratio == "2/2"
    assert st.replica_statuses["embeddingParameterServer"].ready == 2
    assert st.replica_statuses["nats"].ready_ratio == "1/1"
    assert st.attempt_ready_time is not None and st.phase == "Running"


def test_nats_not_ready_keeps_the_job_not_ready():
    sim = Sim()
    sim.step()
    st = sim.step(sim.children(overrides={"demo-nats-0": PENDING}))
    assert cond(st, C.COND_NATS_READY) == ("False", "NatsNotReady")
    assert cond(st, C.COND_READY)[0] == "False"


@pytest.mark.parametrize(
    "pod, status, reason, restarts",
    [
        ("demo-nn-worker-1", failed(137, "OOMKilled"), "PodFailed", 1),
        ("demo-dataloader-0", failed(143), "PodFailed", 1),
        ("demo-embedding-ps-1", EVICTED, "PodEvicted", 0),
        ("demo-embedding-worker-0", restarted(139), "PodFailed", 1),
        ("demo-nn-worker-0", failed(1), "PermanentExitCode", 0),
        ("demo-embedding-ps-0", restarted(2), "PermanentExitCode", 0),
    ],
)
def test_failure_table(pod, status, reason, restarts):
    sim = Sim().running()
    st = sim.step(sim.children(overrides={pod: status}))
    assert st.restart_count == restarts
    if reason == "PodEvicted":  # evictions restart the job without counting (safe default)
        assert st.uncounted_restarts == 1 and st.attempt == 1
        assert cond(st, C.COND_RESTARTING) == ("True", reason)
    elif restarts:
        assert cond(st, C.COND_RESTARTING) == ("True", reason)
        assert st.attempt == 1 and st.phase == "Restarting"
        assert pod in st.condition(C.COND_RESTARTING).message
        assert cond(st, C.COND_CREATED) == ("False", "Creating")  # the new attempt's children
        assert st.attempt_ready_time is None
    else:
        assert cond(st, C.COND_FAILED) == ("True", reason)
        assert st.phase == "Failed" and st.completion_time == timestamp(sim.now)
        assert "exit codes 1-127 are not retried" in st.condition(C.COND_FAILED).message
        assert cond(st, C.COND_READY) == ("False", reason)


def test_restart_recovers_and_counts():
    sim = Sim().running()
    sim.step(sim.children(overrides={"demo-nn-worker-0": failed(137)}))
    old_pods = observe(render(PersiaJob.model_validate({
        "metadata": sim.body["metadata"], "spec": parse_spec(sim.status.accepted_spec),
        "status": {**sim.status.to_wire(), "attempt": 0}})), failed(137))  # fmt: skip
    # Pods of attempt 0 still failing (terminating) do not count against attempt 1.
    st = sim.step(old_pods + sim.children(PENDING))
    assert st.restart_count == 1 and st.attempt == 1 and cond(st, C.COND_RESTARTING)[0] == "True"
    st = sim.step(sim.children())
    assert cond(st, C.COND_RESTARTING) == ("False", "Recovered")
    assert st.phase == "Running" and st.restart_count == 1


def test_backoff_limit_exceeded():
    body = job_body(runPolicy={"backoffLimit": 1})
    sim = Sim(body).running()
    sim.step(sim.children(overrides={"demo-nn-worker-0": failed(137)}))
    sim.step(sim.children())
    st = sim.step(sim.children(overrides={"demo-embedding-ps-0": EVICTED}))
    assert st.terminal() is None and st.uncounted_restarts == 1  # evictions never count
    sim.step(sim.children())
    st = sim.step(sim.children(overrides={"demo-embedding-ps-0": restarted(143)}))
    assert cond(st, C.COND_FAILED) == ("True", "BackoffLimitExceeded")
    assert "1 of 1 restarts used" in st.condition(C.COND_FAILED).message
    assert st.restart_count == 1 and st.phase == "Failed"


def test_zero_backoff_limit_fails_on_first_retryable_failure():
    sim = Sim(job_body(runPolicy={"backoffLimit": 0})).running()
    st = sim.step(sim.children(overrides={"demo-nn-worker-0": failed(137)}))
    assert cond(st, C.COND_FAILED) == ("True", "BackoffLimitExceeded")


def test_job_failed_without_visible_pod_is_retried():
    sim = Sim().running()
    st = sim.step(sim.children(workload_status={
        "demo-nn-worker": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}))  # fmt: skip
    assert cond(st, C.COND_RESTARTING) == ("True", "PodFailed")
    assert "Job demo-nn-worker failed (BackoffLimitExceeded)" in st.condition(C.COND_RESTARTING).message


def test_on_failure_retries_in_place_then_fails():
    sim = Sim(job_body(restartPolicy="OnFailure")).running()
    st = sim.step(sim.children(overrides={"demo-nn-worker-0": restarted(1)}))
    assert st.restart_count == 0 and st.terminal() is None  # kubelet retries in place
    st = sim.step(sim.children(workload_status={
        "demo-nn-worker": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}))  # fmt: skip
    assert cond(st, C.COND_FAILED) == ("True", "BackoffLimitExceeded")


def test_nn_workers_complete_is_success():
    sim = Sim().running()
    done = {"demo-nn-worker": {"succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}}
    st = sim.step(sim.children(workload_status=done))
    assert cond(st, C.COND_SUCCEEDED) == ("True", "NNWorkersCompleted")
    assert cond(st, C.COND_FAILED) == ("False", "NNWorkersCompleted")
    assert st.phase == "Succeeded" and st.completion_time == timestamp(sim.now)
    assert st.replica_statuses["nnWorker"].succeeded == 2


def test_terminal_conditions_are_sticky():
    sim = Sim().running()
    failed_status = sim.step(sim.children(overrides={"demo-nn-worker-0": failed(3)}))
    snapshot = copy.deepcopy(failed_status.conditions)
    done = {"demo-nn-worker": {"conditions": [{"type": "Complete", "status": "True"}]}}
    st = sim.step(sim.children(workload_status=done), seconds=60)
    assert st.conditions == snapshot and st.phase == "Failed"
    st = sim.step([], seconds=60)
    assert st.conditions == snapshot and st.completion_time == failed_status.completion_time


def test_suspend_and_resume():
    body = job_body()
    sim = Sim(body).running()
    sim.body["spec"]["runPolicy"] = {"suspend": True}
    st = sim.step(sim.children())
    assert cond(st, C.COND_SUSPENDED) == ("True", "Suspended")
    assert st.phase == "Suspended" and st.start_time is None
    assert cond(st, C.COND_READY) == ("False", "Suspended")
    sim.body["spec"]["runPolicy"] = {"suspend": False}
    st = sim.step([])
    assert cond(st, C.COND_SUSPENDED) == ("False", "Resumed")
    assert st.attempt == 1 and st.restart_count == 0
    assert st.start_time == timestamp(sim.now)
    assert st.phase == "Pending"


def test_changes_made_while_suspended_are_applied():
    sim = Sim().running()
    sim.body["spec"]["runPolicy"] = {"suspend": True}
    sim.step([])
    sim.body["spec"]["image"] = "new:2"
    st = sim.step([])
    assert st.accepted_spec["image"] == "new:2" and cond(st, C.COND_SPEC_ACCEPTED)[0] == "True"


def test_active_deadline():
    sim = Sim(job_body(runPolicy={"activeDeadlineSeconds": 100})).running()
    assert sim.step(sim.children(), seconds=50).terminal() is None
    st = sim.step(sim.children(), seconds=60)
    assert cond(st, C.COND_FAILED) == ("True", "DeadlineExceeded")


def test_startup_deadline_applies_until_first_ready():
    sim = Sim(job_body(runPolicy={"startupDeadlineSeconds": 30}))
    sim.step()
    assert sim.step(sim.children(PENDING), seconds=20).terminal() is None
    st = sim.step(sim.children(PENDING), seconds=20)
    assert cond(st, C.COND_FAILED) == ("True", "StartupDeadlineExceeded")
    assert "ImagePullBackOff" in st.condition(C.COND_FAILED).message
    ok = Sim(job_body(runPolicy={"startupDeadlineSeconds": 30})).running()
    assert ok.step(ok.children(PENDING), seconds=100).terminal() is None  # it was Ready once


def test_invalid_spec_fails_with_message():
    body = job_body()
    body["spec"]["nnWorker"]["replicas"] = 0
    st = Sim(body).step()
    assert cond(st, C.COND_FAILED) == ("True", "InvalidSpec")
    assert "spec.nnWorker.replicas: replicas must be between 1 and 1024, got 0" in st.condition(C.COND_FAILED).message
    assert cond(st, C.COND_CREATED) == ("False", "InvalidSpec")
    assert st.accepted_spec is None and st.phase == "Failed"


def test_immutable_change_while_running_is_rejected():
    sim = Sim().running()
    sim.body["spec"]["nnWorker"]["image"] = "other:2"
    sim.body["spec"]["logLevel"] = "debug"
    st = sim.step(sim.children())
    assert cond(st, C.COND_SPEC_ACCEPTED) == ("False", "ChangeNotAllowedWhileRunning")
    message = st.condition(C.COND_SPEC_ACCEPTED).message
    assert "spec.nnWorker.image" in message and "spec.logLevel" in message
    assert "image" not in st.accepted_spec["nnWorker"] and st.accepted_spec["logLevel"] == "info"
    assert st.phase == "Running" and st.attempt == 0
    sim.body["spec"]["nnWorker"].pop("image")
    sim.body["spec"]["logLevel"] = "info"
    assert cond(sim.step(sim.children()), C.COND_SPEC_ACCEPTED) == ("True", "Accepted")


def test_invalid_edit_while_running_keeps_the_running_spec():
    sim = Sim().running()
    sim.body["spec"]["nnWorker"]["replicas"] = -3
    st = sim.step(sim.children())
    assert cond(st, C.COND_SPEC_ACCEPTED) == ("False", "InvalidSpec")
    assert st.terminal() is None and st.accepted_spec["nnWorker"]["replicas"] == 2


def test_replica_change_starts_a_new_attempt_with_new_sizes():
    sim = Sim().running()
    sim.body["spec"]["embeddingParameterServer"]["replicas"] = 4
    sim.body["spec"]["runPolicy"] = {"backoffLimit": 7}
    st = sim.step(sim.children())
    assert cond(st, C.COND_RESTARTING) == ("True", "ReplicasChanged")
    assert "embeddingParameterServer 2 -> 4" in st.condition(C.COND_RESTARTING).message
    assert st.attempt == 1 and st.restart_count == 0
    assert st.accepted_spec["embeddingParameterServer"]["replicas"] == 4
    assert st.accepted_spec["runPolicy"]["backoffLimit"] == 7
    assert cond(st, C.COND_SPEC_ACCEPTED) == ("True", "Accepted")


def test_online_nn_resize_needs_no_restart():
    sim = Sim(job_body(trainingMode="online")).running()
    sim.body["spec"]["nnWorker"]["replicas"] = 5
    st = sim.step(sim.children())
    assert st.attempt == 0 and cond(st, C.COND_RESTARTING)[0] == "False"
    assert st.accepted_spec["nnWorker"]["replicas"] == 5
    assert st.replica_statuses["nnWorker"].ready_ratio == "2/5"


def test_online_job_never_succeeds_by_itself():
    sim = Sim(job_body(trainingMode="online")).running()
    st = sim.step(sim.children(), seconds=3600)
    assert st.terminal() is None and st.phase == "Running"


@pytest.mark.parametrize("code, terminal", [(422, True), (400, True), (403, False), (500, False), (None, False)])
def test_child_create_errors(code, terminal):
    sim = Sim()
    errors = [ChildError("StatefulSet", "demo-embedding-ps", code, f"{code} Invalid: spec.template bad")]
    st = sim.step(errors=errors)
    assert cond(st, C.COND_CREATED) == ("False", "ChildCreateFailed")
    assert "StatefulSet/demo-embedding-ps" in st.condition(C.COND_CREATED).message
    assert (st.terminal() == C.COND_FAILED) is terminal
    if terminal:
        assert cond(st, C.COND_FAILED) == ("True", "ChildCreateFailed")


@pytest.mark.parametrize("code", [422, 400, 500])
def test_a_refused_resize_leaves_the_running_job_as_it_was(code):
    """A resize (the serving Deployment's patch) that admission refuses with 422 failed the job
    (ChildCreateFailed) and cleanup deleted its running workloads."""
    sim = Sim(job_body(trainingMode="online")).running()
    errors = [ChildError("Deployment", "demo-model-server", code, f"{code} Invalid: replicas over quota",
                         action="patch")]
    st = sim.step(sim.children(), errors=errors)
    assert st.terminal() is None and st.phase == "Running"
    assert cond(st, C.COND_CREATED)[0] == "True"
    assert "Deployment/demo-model-server not changed" in st.condition(C.COND_CREATED).message


def test_transition_time_moves_only_on_flip():
    sim = Sim()
    first = sim.step()
    second = sim.step(seconds=30)
    assert first.condition(C.COND_CREATED).last_transition_time == second.condition(C.COND_CREATED).last_transition_time
    third = sim.step(sim.children(), seconds=30)
    assert third.condition(C.COND_CREATED).last_transition_time == timestamp(sim.now)


def test_children_of_another_job_with_the_same_name_are_ignored():
    sim = Sim()
    sim.step()
    st = sim.step([{**s, "owner_uid": "someone-else"} for s in sim.children() if s["kind"] != "Pod"])
    assert cond(st, C.COND_CREATED) == ("False", "Creating")


@pytest.mark.parametrize(
    "true_conditions, attempt_ready, phase",
    [
        ([], False, "Pending"),
        ([C.COND_CREATED], False, "Starting"),
        ([C.COND_CREATED, C.COND_READY], True, "Running"),
        ([C.COND_CREATED, C.COND_RESTARTING], False, "Restarting"),
        ([C.COND_SUSPENDED, C.COND_RESTARTING], False, "Suspended"),
        ([C.COND_SUCCEEDED, C.COND_SUSPENDED], True, "Succeeded"),
        ([C.COND_FAILED, C.COND_SUCCEEDED], True, "Failed"),
    ],
)
def test_phase_priority(true_conditions, attempt_ready, phase):
    from persia_operator.conditions import set_condition

    conditions = []
    for type_ in C.CONDITION_TYPES:
        conditions = set_condition(conditions, type_, type_ in true_conditions, "R", "", "t", 1)
    status = JobStatus(conditions=conditions, attempt_ready_time="t" if attempt_ready else None)
    assert derive_phase(status)[0] == phase


def test_set_condition_never_unsets_a_terminal_condition():
    from persia_operator.conditions import set_condition

    conditions = set_condition([], C.COND_FAILED, True, "DeadlineExceeded", "late", "t1", 1)
    conditions = set_condition(conditions, C.COND_FAILED, False, "Running", "", "t2", 2)
    assert (conditions[0].status, conditions[0].reason, conditions[0].last_transition_time) == ("True", "DeadlineExceeded", "t1")
    conditions = set_condition(conditions, C.COND_READY, True, "AllReplicasReady", "", "t3", 2)
    assert [c.type for c in conditions] == [C.COND_READY, C.COND_FAILED]  # listed in a fixed order


def test_finished_data_loaders_do_not_make_the_job_unready():
    sim = Sim().running()
    st = sim.step(sim.children(overrides={"demo-dataloader-0": {"phase": "Succeeded", "containerStatuses": [
        {"name": "c", "restartCount": 0, "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}}))  # fmt: skip
    assert cond(st, C.COND_READY) == ("True", "AllReplicasReady")
    assert st.replica_statuses["dataloader"].succeeded == 1 and st.terminal() is None


def test_unreadable_accepted_spec_is_replaced():
    sim = Sim().running()
    children = sim.children()
    sim.status.accepted_spec = {"nnWorker": {"replicas": "garbage"}}
    st = sim.step(children)
    assert st.accepted_spec["nnWorker"]["replicas"] == 2 and st.terminal() is None
