"""A reconcile pass saves its decision (the job's status) before it acts on it: the real
Reconciler against a recording stand-in for the API server that can refuse the status write.

What the stand-in cannot check: the API server's own behaviour (admission, the status
subresource's rules); tests/operator/test_operator_kmock*.py run the operator against KMock."""

from __future__ import annotations

import logging
from typing import Any

from datetime import timedelta

from operator_testkit import NOW, Sim, failed, job_body

from persia_operator import constants as C
from persia_operator.kube import ApiError
from persia_operator.reconciler import Reconciler

LOG = logging.getLogger("test")


class RecordingApi:
    """Records creates, deletes and patches in order; the first ``refuse_status`` status writes
    fail as a throttled API server answers."""

    def __init__(self, refuse_status: int = 0, refuse_creates: bool = False):
        self.calls: list[tuple[str, ...]] = []
        self.refuse_status, self.refuse_creates = refuse_status, refuse_creates

    async def get(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> dict | None:
        return None

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["kind"] != "Event" and self.refuse_creates:
            raise ApiError(422, "Invalid", f"{manifest['kind']} refused")
        self.calls.append(("create", manifest["kind"], manifest.get("reason") or manifest["metadata"].get("name")))
        return manifest

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        self.calls.append(("delete", kind, name) + ((uid,) if uid else ()))

    async def merge_patch(self, kind, namespace, name, patch, subresource=None) -> dict[str, Any]:
        if subresource == "status":
            if self.refuse_status:
                self.refuse_status -= 1
                raise ApiError(429, "TooManyRequests", "the server is throttling")
            self.calls.append(("status", patch["status"].get("phase", ""),
                               *sorted(c["reason"] for c in patch["status"].get("conditions", []))))
        else:
            self.calls.append(("patch", kind, name))
        return patch

    async def close(self) -> None:
        pass


class NoNats:
    def observe(self, key, target):
        return None

    def forget(self, key) -> None:
        pass

    async def close(self) -> None:
        pass


def failing_job() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A running job whose every pod exited 1 (a program error: the job fails, and its
    unfinished workloads are deleted), as the body and child summaries a pass reads."""
    sim = Sim().running()
    return {**sim.body, "status": sim.status.to_wire()}, sim.children(pods=failed(1))


async def test_a_status_write_that_fails_leaves_every_child_as_it_was():
    body, children = failing_job()
    api = RecordingApi(refuse_status=1)
    reconciler = Reconciler(api, clock=lambda: NOW, nats=NoNats())  # type: ignore[arg-type]
    try:
        await reconciler._pass(body, children, LOG)
    except ApiError as err:
        assert err.code == 429
    else:
        raise AssertionError("the refused status write was not reported")
    # acted on first, the workloads were deleted here, and the next pass (reading the old,
    # Running status) created them all again: a failed job back to life
    assert api.calls == []
    status = await reconciler._pass(body, children, LOG)  # the write goes through now
    assert status.phase == "Failed"
    kinds = [call[0] for call in api.calls]
    assert kinds[0] == "status" and api.calls[0][1] == "Failed", api.calls
    assert "delete" in kinds and "create" not in [k for k, *rest in api.calls if rest[0] != "Event"]


async def test_child_errors_are_written_after_the_decision_they_follow():
    """A pass whose creates fail writes its decision, then the status that names the failure."""
    sim = Sim()
    body = {**sim.body, "status": sim.status.to_wire()}
    api = RecordingApi(refuse_creates=True)
    status = await Reconciler(api, clock=lambda: NOW, nats=NoNats())._pass(body, [], LOG)  # type: ignore[arg-type]
    writes = [call for call in api.calls if call[0] == "status"]
    assert len(writes) == 2, api.calls
    assert "ChildCreateFailed" not in writes[0] and "ChildCreateFailed" in writes[1], writes
    assert status.condition(C.COND_CREATED).reason == "ChildCreateFailed"


async def test_a_deleted_job_is_forgotten_with_its_nats_probe():
    """A deleted job leaves kopf's index, so no pass of it reads the 404 that forgets it: the
    periodic loop keeps only the jobs it lists. Its NATS probe (real, against a port that
    refuses) had gone on connecting with the job's credentials every 10 s."""
    import asyncio

    from persia_operator.natswatch import NatsTarget, NatsWatcher

    from tests.ports import refusing_port

    with refusing_port() as port:
        reconciler = Reconciler(RecordingApi(), clock=lambda: NOW, nats=NatsWatcher(interval=0.05))  # type: ignore[arg-type]
        gone, kept, busy = ("ns1", "deleted"), ("ns1", "kept"), ("ns1", "in-a-pass")
        for key in (gone, kept, busy):
            reconciler.nats.observe(key, NatsTarget(job=key[1], url=f"nats://127.0.0.1:{port}", password="pw"))
            reconciler.phases.set(key, "Running")
            reconciler._locks[key] = asyncio.Lock()
        probe = reconciler.nats._tasks[gone]
        async with reconciler._locks[busy]:  # a pass of it runs now: it is left to that pass
            reconciler.keep_only({kept})
        assert reconciler.nats.keys() == {kept, busy} and reconciler.phases.keys() == {kept, busy}
        assert set(reconciler._locks) == {kept, busy}
        await asyncio.gather(probe, return_exceptions=True)
        assert probe.cancelled()
        await reconciler.close()


async def test_workloads_the_index_still_lists_but_the_api_server_has_not_are_ghosts():
    """kopf forgets an object only on its DELETED event: one deleted while a watch was down stays
    in the index. A restart waited for its old workloads to go before creating the new ones, so
    such ghosts held the job for ever. Read by name, they are seen gone and the new ones created."""
    sim = Sim().running()
    old_attempt = sim.children()  # attempt 0's workloads and pods, as the index lists them
    restarted = sim.step(sim.children(pods=failed(137)))  # killed by a signal: a whole-job restart
    assert restarted.attempt == 1
    body = {**sim.body, "status": restarted.to_wire()}
    api = RecordingApi()  # the API server has none of attempt 0's workloads any more
    await Reconciler(api, clock=lambda: NOW, nats=NoNats())._pass(body, old_attempt, LOG)  # type: ignore[arg-type]
    created = {name for call, kind, name in (c[:3] for c in api.calls if c[0] == "create")
               if kind in ("StatefulSet", "Job")}
    workloads = {s["name"] for s in old_attempt if s["kind"] in ("StatefulSet", "Job") and s["role"] in C.TRAINING_ROLES}
    assert workloads and workloads <= created, (workloads, api.calls)


async def test_the_ttl_deletes_this_job_only_not_one_applied_again_under_its_name():
    """The TTL's delete named the job only: one deleted and applied again while a pass of the old
    one ran (the docs' way to run a job again) was deleted in its place. The uid is a precondition."""
    sim = Sim(job_body(runPolicy={"ttlSecondsAfterFinished": 0})).running()
    body = {**sim.body, "status": sim.status.to_wire()}
    done = sim.children(pods=failed(1))  # failed for good: finished, and its TTL of 0 is up
    api = RecordingApi()
    clock = lambda: NOW + timedelta(hours=1)  # noqa: E731
    await Reconciler(api, clock=clock, nats=NoNats())._pass(body, done, LOG)  # type: ignore[arg-type]
    [job_delete] = [c for c in api.calls if c[:2] == ("delete", C.KIND)]
    assert job_delete == ("delete", C.KIND, "demo", sim.body["metadata"]["uid"]), api.calls
