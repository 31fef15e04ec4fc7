"""A PodDisruptionBudget the API server refuses for good (403, 404, 400/422), and a resize it
refuses for good (the PodGroup's minMember patch, a serving Deployment's replicas patch: 403,
400/422), are tried again with backoff, or at once when they change, and shown once (a Warning
Event, the Created condition's note), not tried, logged and reported every pass; a transient
refusal is tried every pass. The backoff is kept on the job (status.refusedWrites), so a
restarted operator honours it.

The pure rules (refusals.py), then the real operator against KMock, whose reaction plays the API
server refusing the PDBs or the PodGroup patch. What KMock cannot check: real RBAC (the 403 is
scripted)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import kmock
import pytest
from operator_testkit import NOW, PJ, OperatorThread, job_body, wait_for

from persia_operator import constants as C
from persia_operator.job import JobStatus
from persia_operator.plan import Create, Patch
from persia_operator.refusals import (MAX_RETRY, backoff, from_status, hold, held_errors, next_refusals,
                                      refusal_events, refused_for_good, to_status)  # fmt: skip
from persia_operator.status import ChildError

NS = "ns1"
PDB = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "demo-embedding-ps"},
       "spec": {"maxUnavailable": 0}}  # fmt: skip
FORBIDDEN = ChildError("PodDisruptionBudget", "demo-embedding-ps", 403, "403 Forbidden: cannot create poddisruptionbudgets")


@pytest.mark.parametrize("error, for_good", [
    (FORBIDDEN, True),
    (ChildError("PodDisruptionBudget", "x", 404, "404 NotFound: the server could not find the requested resource"), True),
    (ChildError("PodDisruptionBudget", "x", 422, "422 Invalid: spec"), True),
    (ChildError("PodDisruptionBudget", "x", 503, "503 ServiceUnavailable"), False),
    (ChildError("PodDisruptionBudget", "x", None, "None ServerDisconnectedError"), False),
    (ChildError("PodDisruptionBudget", "x", 429, "429 TooManyRequests"), False),
    (ChildError("StatefulSet", "x", 403, "403 Forbidden"), False),  # not auxiliary: the job needs it
    # resizes: the PodGroup's minMember, a serving (or online) Deployment's replicas
    (ChildError("PodGroup", "x", 403, "403 Forbidden", action="patch"), True),
    (ChildError("Deployment", "x", 422, "422 Invalid: replicas over quota", action="patch"), True),
    (ChildError("PodGroup", "x", 404, "404 NotFound", action="patch"), False),  # gone: seen missing next pass
    (ChildError("Deployment", "x", 503, "503 ServiceUnavailable", action="patch"), False),
    (ChildError("PodGroup", "x", 409, "409 Conflict", action="patch"), False),
    (ChildError("ConfigMap", "x", 403, "403 Forbidden", action="patch"), False),  # not a resize
])  # fmt: skip
def test_what_is_refused_for_good(error, for_good):
    assert refused_for_good(error) is for_good


def test_a_refused_pdb_is_tried_again_with_backoff_or_when_it_changes():
    create = Create(PDB)
    refused = next_refusals({}, [create], [FORBIDDEN], NOW)
    assert refused[create.key].retry_at == NOW + timedelta(minutes=1)
    # Held back until then: not created, still reported.
    assert hold([create], refused, NOW + timedelta(seconds=59)) == ([], [FORBIDDEN])
    assert next_refusals(refused, [create], [], NOW + timedelta(seconds=59)) == refused
    # Due again: tried, and refused again it backs off further.
    later = NOW + timedelta(minutes=1)
    assert hold([create], refused, later) == ([create], [])
    again = next_refusals(refused, [create], [FORBIDDEN], later)
    assert again[create.key].tries == 2 and again[create.key].retry_at == later + timedelta(minutes=2)
    assert backoff(20) == MAX_RETRY
    # A changed manifest is tried at once.
    changed = Create({**PDB, "spec": {"maxUnavailable": 1}})
    assert hold([changed], again, later) == ([changed], [])
    # Created at last, or no longer wanted: forgotten.
    assert next_refusals(again, [create], [], later + timedelta(minutes=2)) == {}
    assert next_refusals(again, [], [], later) == {}


GANG_PATCH = Patch("PodGroup", "demo-gang", {"spec": {"minMember": 6}}, api_version="scheduling.volcano.sh/v1beta1")
GANG_FORBIDDEN = ChildError("PodGroup", "demo-gang", 403, "403 Forbidden: cannot patch podgroups", action="patch")


def test_a_refused_pod_group_resize_is_tried_again_with_backoff_or_at_another_size():
    refused = next_refusals({}, [GANG_PATCH], [GANG_FORBIDDEN], NOW)
    assert refused[("PodGroup", "demo-gang")].retry_at == NOW + timedelta(minutes=1)
    # Held back until then: not sent, still reported.
    assert hold([GANG_PATCH], refused, NOW + timedelta(seconds=59)) == ([], [GANG_FORBIDDEN])
    assert next_refusals(refused, [GANG_PATCH], [], NOW + timedelta(seconds=59)) == refused
    # Due again: sent, and refused again it backs off further.
    later = NOW + timedelta(minutes=1)
    assert hold([GANG_PATCH], refused, later) == ([GANG_PATCH], [])
    again = next_refusals(refused, [GANG_PATCH], [GANG_FORBIDDEN], later)
    assert again[("PodGroup", "demo-gang")].tries == 2
    assert again[("PodGroup", "demo-gang")].retry_at == later + timedelta(minutes=2)
    # The spec changed (another size, or the other gang scheduler's PodGroup): sent at once.
    other_size = Patch("PodGroup", "demo-gang", {"spec": {"minMember": 5}}, api_version=GANG_PATCH.api_version)
    other_api = Patch("PodGroup", "demo-gang", GANG_PATCH.patch, api_version="scheduling.x-k8s.io/v1alpha1")
    assert hold([other_size, other_api], again, later) == ([other_size, other_api], [])
    refused_other = next_refusals(again, [other_size], [GANG_FORBIDDEN], later)
    assert refused_other[("PodGroup", "demo-gang")].tries == 1  # backing off from the start
    # A create of the same name is another write: the patch's refusal does not hold it.
    create = Create({"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
                     "metadata": {"name": "demo-gang"}, "spec": {"minMember": 6}})  # fmt: skip
    assert hold([create], again, later) == ([create], [])
    # Patched at last, or no longer wanted (resized back, the job finished): forgotten.
    assert next_refusals(again, [GANG_PATCH], [], later + timedelta(minutes=2)) == {}
    assert next_refusals(again, [], [], later) == {}


def test_a_refused_serving_resize_is_reported_once_and_held():
    resize = Patch("Deployment", "demo-model-server", {"spec": {"replicas": 3, "template": {}}})
    quota = ChildError("Deployment", "demo-model-server", 422, "422 Invalid: replicas over quota", action="patch")
    first = next_refusals({}, [resize], [quota], NOW)
    [event] = refusal_events({}, first)
    assert event.type == "Warning" and event.reason == "ChildRefused"
    assert event.message.startswith("Deployment/demo-model-server not changed (422 Invalid: replicas over quota)")
    assert "it runs as it was; tried again in 60s" in event.message
    assert hold([resize], first, NOW + timedelta(seconds=30)) == ([], [quota])
    assert held_errors(first, NOW + timedelta(seconds=30)) == [quota]  # still named on the Created condition
    second = next_refusals(first, [resize], [quota], NOW + timedelta(minutes=1))
    assert refusal_events(first, second) == []  # refused again: no second event
    # A transient refusal of the resize is sent every pass, as before.
    busy = ChildError("Deployment", "demo-model-server", 503, "503 ServiceUnavailable", action="patch")
    assert next_refusals({}, [resize], [busy], NOW) == {}


def test_refusals_are_kept_on_the_job_and_read_back():
    """status.refusedWrites: what a restarted operator (nothing in memory) honours."""
    pdb = Create(PDB)
    refused = next_refusals({}, [pdb, GANG_PATCH], [FORBIDDEN, GANG_FORBIDDEN], NOW)
    assert to_status({}) is None  # none: the field is removed
    wire = JobStatus(refused_writes=to_status(refused)).to_wire()
    assert [(w["kind"], w["action"], w["tries"], w["retryAt"]) for w in wire["refusedWrites"]] == [
        ("PodDisruptionBudget", "create", 1, "2026-01-01T12:01:00Z"),
        ("PodGroup", "patch", 1, "2026-01-01T12:01:00Z")]  # fmt: skip
    back = from_status(JobStatus.model_validate(wire).refused_writes)
    assert back == refused  # NOW is a whole second
    # Read back, they hold the same writes and post no second event.
    assert hold([pdb, GANG_PATCH], back, NOW + timedelta(seconds=59)) == ([], [FORBIDDEN, GANG_FORBIDDEN])
    assert refusal_events(back, next_refusals(back, [pdb, GANG_PATCH], [], NOW)) == []
    # An entry that cannot be read (a hand edit) is dropped: that write is tried again.
    wire["refusedWrites"][1]["retryAt"] = "tomorrow"
    assert list(from_status(JobStatus.model_validate(wire).refused_writes)) == [("PodDisruptionBudget",
                                                                               "demo-embedding-ps")]  # fmt: skip


def test_a_transient_refusal_is_tried_every_pass():
    create = Create(PDB)
    busy = ChildError("PodDisruptionBudget", "demo-embedding-ps", 503, "503 ServiceUnavailable: etcd")
    assert next_refusals({}, [create], [busy], NOW) == {}


def test_one_event_per_refusal_not_per_retry():
    create = Create(PDB)
    first = next_refusals({}, [create], [FORBIDDEN], NOW)
    [event] = refusal_events({}, first)
    assert event.type == "Warning" and event.reason == "ChildRefused"
    assert "PodDisruptionBudget/demo-embedding-ps not created (403 Forbidden" in event.message
    assert "the job runs without it" in event.message
    second = next_refusals(first, [create], [FORBIDDEN], NOW + timedelta(minutes=1))
    assert refusal_events(first, second) == []
    other = ChildError("PodDisruptionBudget", "demo-embedding-ps", 404, "404 NotFound: policy/v1")
    assert len(refusal_events(second, next_refusals(second, [create], [other], NOW + timedelta(minutes=3)))) == 1


def pdb_posts(cluster) -> int:
    return sum(1 for r in list(cluster.k) if r.method == "POST" and r.resource is not None
               and r.resource.plural == "poddisruptionbudgets")  # fmt: skip


def status_writes(cluster) -> int:
    return sum(1 for r in list(cluster.k) if r.method == "PATCH" and r.subresource == "status"
               and r.resource is not None and r.resource.plural == C.PLURAL)  # fmt: skip


async def test_a_forbidden_pdb_is_not_tried_every_pass(cluster, operator, caplog):
    caplog.set_level(logging.INFO, logger="persia_operator")
    message = 'poddisruptionbudgets.policy is forbidden: User "persia" cannot create resource'
    pdbs = kmock.resource("policy/v1/poddisruptionbudgets")
    cluster.k["post", pdbs] << 403 << {"kind": "Status", "code": 403, "reason": "Forbidden", "message": message}
    # KMock stores a POSTed object whatever a reaction answers: its GET plays the PDB not existing.
    cluster.k["get", pdbs] << 404 << {"kind": "Status", "code": 404, "reason": "NotFound", "message": "not found"}
    await cluster.create(job_body())
    await wait_for(lambda: (cluster.condition(NS, "demo", C.COND_CREATED) or {}).get("status") == "True",
                   what="created without its PDBs")  # fmt: skip
    passes, writes = operator.passes, status_writes(cluster)
    await wait_for(lambda: operator.passes >= passes + 5, what="five more passes")
    assert pdb_posts(cluster) == 2  # the PS's and the NATS's, once each
    assert status_writes(cluster) == writes  # the note was dropped and written back every pass
    note = cluster.condition(NS, "demo", C.COND_CREATED)["message"]
    assert f"PodDisruptionBudget/demo-embedding-ps not created (403 Forbidden: {message})" in note
    events = [e for e in cluster.events(NS) if e.get("reason") == "ChildRefused"]
    assert sorted(e["message"].split(" ")[0] for e in events) == [
        "PodDisruptionBudget/demo-embedding-ps", "PodDisruptionBudget/demo-nats"]
    assert all(e["type"] == "Warning" for e in events)
    logged = [r for r in caplog.records if "PodDisruptionBudget/demo-embedding-ps failed" in r.getMessage()]
    assert len(logged) == 1


# --- a PodGroup resize refused for good, through the real operator ------------------------------

GROUP = "scheduling.volcano.sh/v1beta1/podgroups"
PATCH_REFUSAL = 'podgroups.scheduling.volcano.sh "demo-gang" is forbidden: User "persia" cannot patch resource'


class Clock:
    """The operator's clock, moved by the test: a backoff window passes without waiting for it."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def pod_group_patches(cluster) -> int:
    return sum(1 for r in list(cluster.k) if r.method == "PATCH" and r.resource is not None
               and r.resource.plural == "podgroups")  # fmt: skip


def refused_writes(cluster) -> list[dict]:
    return cluster.status(NS, "demo").get("refusedWrites") or []


async def resize_refused(cluster) -> None:
    """A Volcano gang job, created; its PodGroup's patches refused (403), then the job resized."""
    await cluster.create(job_body(scheduling={"gang": "volcano"}))
    await wait_for(lambda: (cluster.condition(NS, "demo", C.COND_CREATED) or {}).get("status") == "True",
                   what="created")  # fmt: skip
    created = cluster.get(GROUP, NS, "demo-gang")
    assert created["spec"]["minMember"] == 7
    group = kmock.resource(GROUP)
    cluster.k["patch", group] << 403 << {"kind": "Status", "code": 403, "reason": "Forbidden", "message": PATCH_REFUSAL}
    # KMock applies a PATCH whatever a reaction answers: its GET plays the PodGroup not changed.
    cluster.k["get", group] << created
    await cluster.patch(PJ, NS, "demo", {"spec": {"nnWorker": {"replicas": 1}}})
    await wait_for(lambda: pod_group_patches(cluster) >= 1, what="the refused patch")


async def passes_later(reconciler, n: int = 5) -> None:
    passes = reconciler.passes
    await wait_for(lambda: reconciler.passes >= passes + n, what=f"{n} more passes")


async def test_a_refused_pod_group_resize_is_sent_once_per_backoff_window(cluster):
    clock = Clock()
    runner = OperatorThread(str(cluster.k.url).rstrip("/"))
    runner.reconciler.clock = clock
    await runner.start()
    try:
        await resize_refused(cluster)
        await passes_later(runner.reconciler)
        assert pod_group_patches(cluster) == 1  # not re-sent every pass
        [written] = refused_writes(cluster)
        assert (written["kind"], written["name"], written["action"], written["code"], written["tries"]) == (
            "PodGroup", "demo-gang", "patch", 403, 1)  # fmt: skip
        note = cluster.condition(NS, "demo", C.COND_CREATED)["message"]
        assert f"PodGroup/demo-gang not changed (403 Forbidden: {PATCH_REFUSAL}): it runs as it was" in note
        # The window passes: sent once more, refused again, backing off for 2 min.
        clock.advance(61)
        await wait_for(lambda: pod_group_patches(cluster) == 2, what="the patch sent again")
        await passes_later(runner.reconciler)
        assert pod_group_patches(cluster) == 2
        assert refused_writes(cluster)[0]["tries"] == 2
        clock.advance(61)  # inside the 2 min window
        await passes_later(runner.reconciler)
        assert pod_group_patches(cluster) == 2
        events = [e for e in cluster.events(NS) if e.get("reason") == "ChildRefused"]
        assert [e["message"].split(" ")[0] for e in events] == ["PodGroup/demo-gang"]  # one, not one per try
    finally:
        await runner.stop()


async def test_a_restarted_operator_honours_the_backoff_kept_on_the_job(cluster):
    clock = Clock()
    url = str(cluster.k.url).rstrip("/")
    first = OperatorThread(url)
    first.reconciler.clock = clock
    await first.start()
    try:
        await resize_refused(cluster)
        await passes_later(first.reconciler, 3)
        sent = pod_group_patches(cluster)
    finally:
        await first.stop()
    # A fresh operator (nothing in memory) reads the backoff from the job's status.
    second = OperatorThread(url)
    second.reconciler.clock = clock
    await second.start()
    try:
        await passes_later(second.reconciler)
        assert pod_group_patches(cluster) == sent  # before: sent again at once by every new operator
        assert len([e for e in cluster.events(NS) if e.get("reason") == "ChildRefused"]) == 1
        clock.advance(61)
        await wait_for(lambda: pod_group_patches(cluster) == 2, what="the patch sent when due")
        await wait_for(lambda: refused_writes(cluster) and refused_writes(cluster)[0]["tries"] == 2,
                       what="the second refusal counted")  # fmt: skip
    finally:
        await second.stop()
