"""Events for condition transitions."""

from __future__ import annotations

from operator_testkit import Sim, failed

from persia_operator.events import transition_events
from persia_operator.job import JobStatus


def test_events_follow_transitions():
    sim = Sim()
    first = sim.step()
    events = transition_events(JobStatus(), first)
    assert [(e.type, e.reason) for e in events] == [("Normal", "Creating"), ("Normal", "Accepted")]
    assert transition_events(first, sim.step()) == []  # nothing changed, nothing said
    created = sim.step(sim.children())
    reasons = {(e.type, e.reason) for e in transition_events(first, created)}
    assert {("Normal", "ChildrenCreated"), ("Normal", "NatsAvailable"), ("Normal", "AllReplicasReady")} <= reasons


def test_restart_and_failure_are_warnings():
    sim = Sim().running()
    before = sim.status
    restarted = sim.step(sim.children(overrides={"demo-nn-worker-0": failed(137)}))
    events = transition_events(before, restarted)
    assert ("Warning", "PodFailed") in {(e.type, e.reason) for e in events}
    assert any("demo-nn-worker-0" in e.message and "code 137" in e.message for e in events)
    sim.step(sim.children())
    before = sim.status
    failed_status = sim.step(sim.children(overrides={"demo-nn-worker-1": failed(1)}))
    events = transition_events(before, failed_status)
    assert ("Warning", "PermanentExitCode") in {(e.type, e.reason) for e in events}


def test_second_restart_while_restarting_is_an_event():
    sim = Sim().running()
    first = sim.step(sim.children(overrides={"demo-nn-worker-0": failed(137)}))
    second = sim.step(sim.children(overrides={"demo-nn-worker-1": failed(137)}))
    assert second.restart_count == 2
    assert [e.reason for e in transition_events(first, second) if e.type == "Warning"] == ["PodFailed"]
