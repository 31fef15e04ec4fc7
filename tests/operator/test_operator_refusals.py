"""A PodDisruptionBudget the API server refuses for good (403, 404, 400/422) is tried again with
backoff, or at once when it changes, and shown once (a Warning Event, the Created condition's
note), not tried, logged and reported every pass; a transient refusal is tried every pass.

The pure rules (refusals.py), then the real operator against KMock, whose reaction plays the API
server refusing the PDBs. What KMock cannot check: real RBAC (the 403 is scripted)."""

from __future__ import annotations

import logging
from datetime import timedelta

import kmock
import pytest
from operator_testkit import NOW, job_body, wait_for

from persia_operator import constants as C
from persia_operator.plan import Create
from persia_operator.refusals import (MAX_RETRY, backoff, hold, next_refusals, refusal_events,
                                      refused_for_good)  # fmt: skip
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
