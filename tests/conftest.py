"""Shared fixtures: a real nats-server per test session, in-process PERSIA servers on loopback."""

from __future__ import annotations

import itertools
import os

import pytest

from persia.nats_server import NatsServer
from tests.guards import environment_kept

_job_counter = itertools.count()


@pytest.fixture(scope="session")
def nats_server():
    """The session's nats-server: authenticated, like every NATS PERSIA starts (docs/security.md)."""
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def nats_url(nats_server):
    return nats_server.url


@pytest.fixture
def persia_env(nats_server, monkeypatch):
    """Point this test's PERSIA processes at the session's NATS under a job name of its own, with
    its credentials and a job secret of its own (so signed controls are exercised everywhere)."""
    from persia.bus import close_shared_bus
    from persia.data_loader import stream as loader_stream
    from persia.nn_worker import accounting, datasets
    from persia.security import new_secret

    job = f"t{os.getpid()}x{next(_job_counter)}"
    monkeypatch.setenv("PERSIA_NATS_URL", nats_server.url)
    for key, value in nats_server.client_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PERSIA_JOB_SECRET", new_secret())
    monkeypatch.setenv("PERSIA_JOB_NAME", job)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "REPLICA_INDEX", "REPLICA_SIZE"):
        monkeypatch.delenv(var, raising=False)
    close_shared_bus()
    loader_stream.reset()  # each test plays a fresh data-loader process
    accounting.reset()
    datasets.reset_streams()  # ... and a fresh NN-worker process
    yield job
    close_shared_bus()


@pytest.fixture(autouse=True)
def ieee_denormals_after_each_test():
    """The NN worker flushes denormals only inside its contexts (persia.nn_worker.denormals); a
    test that leaves this thread flushing would break later tests far from the cause (hypothesis
    refuses to draw floats then), so the test that leaked fails here, naming the cause."""
    yield
    smallest = float("5e-324")  # the smallest float64 denormal, made at run time (not folded)
    if smallest * 1.0 == 0.0:  # FTZ flushes the denormal product, DAZ its denormal input
        pytest.fail("this test left its thread flushing denormals to zero (MXCSR FTZ/DAZ): "
                    "a FlushDenormals span started and never stopped", pytrace=False)


@pytest.fixture(autouse=True)
def environment_unchanged_after_each_test():
    """A variable a test leaves in ``os.environ`` reaches every later test and every process they
    start (a leaked ``LOCAL_RANK=1`` moved the online job's metrics ports by one, so two roles
    asked for the same port, far from the cause): ``tests.guards.environment_kept``."""
    with environment_kept():
        yield


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (a real ENOSPC), unmounted after the test; skipped where mounting is not
    permitted (CI without root)."""
    import shutil
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs for a real ENOSPC")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
