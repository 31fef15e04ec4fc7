"""parse_status: a stored status that does not validate keeps what does (attempt,
restartCount, the good conditions) and is logged with the job's name."""

from __future__ import annotations

import logging

from persia_operator.job import JobStatus, parse_status, salvage_status

COND = {"type": "Ready", "status": "True", "reason": "AllReady", "lastTransitionTime": "2026-01-01T12:00:00Z"}
STATUS = {
    "attempt": 3,
    "restartCount": 2,
    "statefulPods": {"embeddingParameterServer:0": "uid-ps"},
    "conditions": [COND, {**COND, "type": "Created", "reason": "ChildrenCreated"}],
    "checkpoint": {"step": 100, "path": "/ckpt/100"},
}


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_valid_status_parses_silently(caplog):
    status = parse_status(STATUS, job="ns1/demo")
    assert (status.attempt, status.restart_count, len(status.conditions)) == (3, 2, 2)
    assert warnings(caplog) == []
    assert parse_status(None) == JobStatus() and warnings(caplog) == []  # a new job has none


def test_one_bad_condition_does_not_reset_the_attempt(caplog):
    raw = {**STATUS, "conditions": [{**COND, "status": "Maybe"}, STATUS["conditions"][1]],
           "checkpoint": {"step": "latest", "path": "/ckpt/100"}}  # fmt: skip
    status = parse_status(raw, job="ns1/demo")
    # Resetting all of it would make attempt 0 (the running children look stale) and
    # restartCount 0 (fresh retries): only the unreadable parts go.
    assert (status.attempt, status.restart_count) == (3, 2)
    assert status.stateful_pods == {"embeddingParameterServer:0": "uid-ps"}
    assert [c.type for c in status.conditions] == ["Created"]
    assert status.checkpoint is not None and (status.checkpoint.step, status.checkpoint.path) == (None, "/ckpt/100")
    [message] = warnings(caplog)
    assert "ns1/demo" in message and "conditions.0.status" in message and "Maybe" in message
    assert "checkpoint.step" in message


def test_a_bad_top_level_field_falls_back_to_its_default():
    status, notes = salvage_status({**STATUS, "restartCount": "two", "conditions": "none"})
    assert (status.attempt, status.restart_count, status.conditions) == (3, 0, [])
    assert any(n.startswith("restartCount:") for n in notes) and any(n.startswith("conditions:") for n in notes)


def test_a_status_that_is_not_an_object_is_reset_and_logged(caplog):
    assert parse_status(["junk"], job="ns1/demo") == JobStatus()
    [message] = warnings(caplog)
    assert "ns1/demo" in message and "list" in message


def test_the_job_is_named_from_its_own_metadata(caplog):
    from persia_operator.status import ObservedJob

    ObservedJob.from_body({"metadata": {"name": "other", "namespace": "ns2"}, "status": {"attempt": "x"}})
    [message] = warnings(caplog)
    assert "ns2/other" in message and "attempt" in message
