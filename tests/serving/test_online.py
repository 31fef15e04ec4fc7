"""Online training end to end in local mode, with serving that follows it: `persia-launcher local`
(real nats-server and processes) runs an endless data loader and an NN worker whose ranks come
from the NATS rendezvous, with incremental updates on and a checkpoint (with the jit model) every
few steps; an inference PS + embedding worker + model server (processes, no NATS) start at the
same time. The server becomes ready with the first checkpoint, and a served prediction then moves
while training goes on, with no restart."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from persia.serving.local_stack import InferenceStack, post_json
from tests.ports import free_ports
from tests.serving.test_metrics_catalog import assert_catalogued_metrics_served, sample

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROLES = Path(__file__).parent / "roles"
sys.path.insert(0, str(ROLES))
from tiny_data import EMBEDDING_CONFIG, make_batch  # noqa: E402


def probe_body() -> dict:
    b = make_batch(424242, requires_grad=False)
    ids = {}
    for f in b.id_type_features:
        values, offsets = f.to_csr()
        ids[f.name] = [[str(v) for v in values[offsets[i]:offsets[i + 1]]] for i in range(b.batch_size)]
    return {"id_type_features": ids, "non_id_type_features": {"dense": b.non_id_type_features[0].data.tolist()}}


def tail(path: Path, chars: int = 4000) -> str:
    """The last ``chars`` of a log file."""
    return path.read_text(errors="replace")[-chars:]


def scrape(port: int, job: subprocess.Popen, job_log: Path, deadline_s: float = 20.0) -> str:
    """A role's /metrics, polled until its exporter answers (it starts after the role's server)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        except OSError as exc:
            if time.monotonic() > end or job.poll() is not None:
                ended = f"the job ended ({job.returncode}):\n{tail(job_log)}" if job.poll() is not None \
                    else "the job still runs"
                raise AssertionError(f"no metrics on port {port}: {exc}; {ended}") from exc
            time.sleep(0.2)


def test_online_training_refreshes_a_running_model_server(tmp_path):
    ec = tmp_path / "embedding_config.yml"
    ec.write_text(yaml.safe_dump(EMBEDDING_CONFIG))
    # a small capacity, so the PS evicts rows during the run (its metrics are checked below)
    train_gc = {"embedding_parameter_server_config": {
        "capacity": 64, "num_hashmap_internal_shards": 1,
        "enable_incremental_update": True, "incremental_dir": str(tmp_path / "inc"), "incremental_buffer_size": 20}}
    (tmp_path / "global_config.yml").write_text(yaml.safe_dump(train_gc))
    ckpts = tmp_path / "ckpts"
    # training: PS, EW, NN rank, data loader; then the inference PS and EW
    train_metrics = free_ports(6)
    infer_metrics = train_metrics + 4
    # the job's output goes to a file: a pipe read only at the end fills (64 KiB) and freezes the job
    job_log = tmp_path / "job.log"
    with job_log.open("w") as job_out:  # the job keeps its own copy of the descriptor
        job = subprocess.Popen(
            [sys.executable, "-m", "persia.launcher", "local", "--nn-worker", str(ROLES / "online_train.py"),
             "--data-loader", str(ROLES / "online_loader.py"), "--embedding-config", str(ec),
             "--global-config", str(tmp_path / "global_config.yml"), "--no-progress", "--max-restarts", "0",
             "--env", "PERSIA_RENDEZVOUS=nats", "--env", f"ONLINE_CKPT_DIR={ckpts}", "--env", "ONLINE_CKPT_EVERY=25",
             "--env", "ONLINE_MAX_BATCHES=20000", "--env", "ONLINE_BATCH_INTERVAL=0.01",
             "--env", f"PERSIA_METRICS_PORT={train_metrics}"],
            stdout=job_out, stderr=subprocess.STDOUT)
    stack = InferenceStack(tmp_path / "serving", str(ec), train_gc, model=str(ckpts), checkpoint=None,
                           serve_flags=["--model-poll-seconds", "0.5"], metrics_port=infer_metrics,
                           env={**os.environ, "PERSIA_INCREMENTAL_POLL_SECONDS": "0.5"})
    passed = False
    try:
        stack.wait_ready(deadline_s=180, upstream=job)  # ready once the first ckpt-*/ with its jit model is complete
        url = stack.url + "/v1/predict"
        status, first = post_json(url, probe_body())
        assert status == 200, first
        first = np.asarray(first["predictions"])
        end, moved = time.monotonic() + 120, None
        while time.monotonic() < end and job.poll() is None:
            status, body = post_json(url, probe_body())
            assert status == 200, body
            now = np.asarray(body["predictions"])
            if np.abs(now - first).max() > 1e-5:
                moved = now
                break
            time.sleep(0.2)
        assert job.poll() is None, "the online job ended early:\n" + tail(job_log)
        assert moved is not None, "the served prediction never moved\n" + stack.logs()
        metrics = urllib.request.urlopen(stack.url + "/metrics", timeout=10).read().decode()
        assert re.search(r'persia_serving_model_loads_total\{persia_job="[^"]+",result="ok"\}', metrics)
        assert any(p.name.startswith("inc_") for p in (tmp_path / "inc").glob("s*/inc_*"))
        # every role of both jobs serves the catalogued metrics (docs/metrics.md), while they run
        scrapes = [metrics] + [scrape(port, job, job_log) for port in
                               [*range(train_metrics, train_metrics + 4), *range(infer_metrics, infer_metrics + 2)]]
        assert_catalogued_metrics_served(scrapes)
        # each training role under its own role and replica, all under local mode's job name
        for text, role in zip(scrapes[1:5], ("embedding_parameter_server", "embedding_worker", "nn_worker",
                                             "data_loader")):
            assert sample(text, role=role, replica="0", persia_job="local") is not None, text[-2000:]
        passed = True
    finally:
        stack.stop()
        if job.poll() is None:
            job.send_signal(signal.SIGINT)
        job.wait(timeout=60)
        if not passed:  # pytest shows a failed test's stdout: the training job's side of the story
            print("--- the training job's output (tail)\n" + tail(job_log, 8000))
    out = job_log.read_text(errors="replace")
    # the NN worker and the data loader took their indices from the rendezvous (no ordinals)
    assert "nn index 0 of 1 from the NATS rendezvous" in out, out[-3000:]
    assert "dl index 0 of 1 from the NATS rendezvous" in out, out[-3000:]
