"""``metrics_config`` through ``persia-launcher`` for the roles that take no ``--global-config``:
with ``enable_metrics: true`` in ``PERSIA_GLOBAL_CONFIG`` and no ``PERSIA_METRICS_PORT``, an NN
worker and a data loader serve ``/metrics`` on 9090 (+ ``PERSIA_METRICS_PORT_OFFSET``, which moves
it to a free port here), labelled with their role, replica and ``persia_job``. Real processes; the
data loader's scrape target is up while it still waits for its workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from persia.metrics import DEFAULT_PORT, JOB_NAME_ENV
from tests.ports import free_ports
from tests.serving.test_metrics_catalog import sample

pytestmark = pytest.mark.integration

NN_WORKER = """
import os, threading
from persia.nn_worker.progress import TrainingProgress

rank = int(os.environ["RANK"])
TrainingProgress(rank).report(rank, trained=0, staleness=3)  # what TrainCtx does, less the training
threading.Event().wait(120)  # until the test stops the launcher
"""

DATA_LOADER = """
from persia.ctx import DataCtx

DataCtx(discovery_deadline_s=120)  # waits for embedding workers that never come
"""


def role_env(tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    """A role's environment outside the operator: the global config enables metrics and names the
    job, no PERSIA_METRICS_PORT, and the offset moves 9090 to ``port``."""
    config = tmp_path / "global_config.yml"
    config.write_text(yaml.safe_dump({"common_config": {"metrics_config": {"enable_metrics": True,
                                                                          "job_name": "from_config"}}}))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PERSIA_METRICS_PORT", "PERSIA_JOB_NAME", JOB_NAME_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE",
                        "REPLICA_INDEX", "REPLICA_SIZE")}
    env.update(PERSIA_GLOBAL_CONFIG=str(config), PERSIA_METRICS_PORT_OFFSET=str(port - DEFAULT_PORT),
               PERSIA_BIND_ADDRESS="127.0.0.1", **extra)
    return env


def scrape_until(port: int, proc: subprocess.Popen, name: str, labels: dict[str, str],
                 deadline_s: float = 60.0) -> float:
    """Poll ``port``'s /metrics until it serves ``name`` with ``labels``; fail if the role exits."""
    end = time.monotonic() + deadline_s
    last = "nothing yet"
    while True:
        assert proc.poll() is None, f"the role exited ({proc.returncode}):\n{proc.stdout.read()[-3000:]}"
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            value = sample(text, name, **labels)
            if value is not None:
                return value
            last = text[-2000:]
        except OSError as exc:
            last = repr(exc)
        assert time.monotonic() < end, f"no {name}{labels} on port {port} within {deadline_s}s; last: {last}"
        time.sleep(0.1)


def run_role(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "persia.launcher", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # the nn-worker launcher passes it on to its ranks
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_enable_metrics_makes_an_nn_worker_serve_metrics_labelled_with_the_configured_job(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(NN_WORKER)
    port = free_ports(1)
    proc = run_role(["nn-worker", str(script), "--nproc-per-node", "1"], role_env(tmp_path, port))
    try:
        # no PERSIA_JOB_NAME (started by hand): the label is metrics_config.job_name
        labels = {"role": "nn_worker", "replica": "0", "persia_job": "from_config"}
        assert scrape_until(port, proc, "persia_nn_embedding_staleness", labels) == 3
    finally:
        stop(proc)


def test_enable_metrics_makes_a_data_loader_serve_metrics_under_its_replica_index(tmp_path, nats_server):
    script = tmp_path / "loader.py"
    script.write_text(DATA_LOADER)
    port = free_ports(1)
    env = role_env(tmp_path, port, PERSIA_NATS_URL=nats_server.url, PERSIA_JOB_NAME="dl-job",
                   **nats_server.client_env())
    proc = run_role(["data-loader", str(script), "--replica-index", "2", "--replica-size", "3"], env)
    try:
        # PERSIA_JOB_NAME (the operator's job name) wins over metrics_config.job_name
        labels = {"role": "data_loader", "replica": "2", "persia_job": "dl-job"}
        assert scrape_until(port, proc, "persia_data_loader_sends_in_flight", labels) == 0
        assert scrape_until(port, proc, "persia_data_loader_batches_held", labels) == 0
    finally:
        stop(proc)


def test_a_bad_global_config_stops_the_data_loader_naming_it(tmp_path):
    script = tmp_path / "loader.py"
    script.write_text(DATA_LOADER)
    env = role_env(tmp_path, free_ports(1))
    Path(env["PERSIA_GLOBAL_CONFIG"]).write_text("common_config: {metrics_config: {enable_metrics: maybe}}\n")
    proc = subprocess.run([sys.executable, "-m", "persia.launcher", "data-loader", str(script)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "persia-launcher: PERSIA_GLOBAL_CONFIG:" in proc.stderr and "enable_metrics" in proc.stderr, proc.stderr
