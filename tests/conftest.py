"""Shared fixtures: a real nats-server per test session, in-process PERSIA servers on loopback."""

from __future__ import annotations

import itertools
import os

import pytest

from persia.nats_server import NatsServer

_job_counter = itertools.count()


@pytest.fixture(scope="session")
def nats_url():
    with NatsServer() as server:
        yield server.url


@pytest.fixture
def persia_env(nats_url, monkeypatch):
    """Point this test's PERSIA processes at the session's NATS under a job name of its own."""
    from persia.bus import close_shared_bus

    job = f"t{os.getpid()}x{next(_job_counter)}"
    monkeypatch.setenv("PERSIA_NATS_URL", nats_url)
    monkeypatch.setenv("PERSIA_JOB_NAME", job)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "REPLICA_INDEX", "REPLICA_SIZE"):
        monkeypatch.delenv(var, raising=False)
    close_shared_bus()
    yield job
    close_shared_bus()
