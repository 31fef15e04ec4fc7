"""Refresh without a restart: a running inference PS applies the training PS's incremental packets
within its poll interval, and the model server picks up a new jit file; each changes a served
prediction to what the training job itself now predicts."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

from persia.metrics import job_label
from persia.serving.local_stack import post_json
from tests.integration.cluster import GLOBAL_CONFIG, cluster
from tests.integration.test_training_path import make_batch
from tests.polling import poll_until
from tests.serving.helpers import ServedModel, dump, evaluate, serving, train_batches
from tests.serving.test_server import as_json

pytestmark = pytest.mark.integration

POLL_S = 0.2


def wait_for_prediction(url: str, body: dict, want: np.ndarray, deadline_s: float = 30.0) -> float:
    """Seconds until the served prediction equals ``want`` (polling, bounded)."""
    t0 = time.monotonic()
    got = None
    while time.monotonic() - t0 < deadline_s:
        status, answer = post_json(url, body)
        assert status == 200, answer
        got = np.asarray(answer["predictions"])
        if np.allclose(got, want, rtol=0, atol=1e-6):
            return time.monotonic() - t0
        time.sleep(POLL_S / 2)
    raise AssertionError(f"served prediction never became the training job's: {got} != {want}")


def test_incremental_packets_and_a_new_jit_file_refresh_a_running_server(persia_env, tmp_path, monkeypatch):
    monkeypatch.setenv("PERSIA_INCREMENTAL_POLL_SECONDS", str(POLL_S))
    inc = {"enable_incremental_update": True, "incremental_dir": str(tmp_path / "inc"),
           "incremental_buffer_size": 1}
    train_gc = dict(GLOBAL_CONFIG, embedding_parameter_server_config=dict(
        GLOBAL_CONFIG["embedding_parameter_server_config"], **inc))
    model = ServedModel()
    probe = make_batch(7, requires_grad=False)  # users 0..49: every training batch touches some
    body = as_json(probe)
    model_file = tmp_path / "serve" / "jit_dense.pt"
    with cluster(global_config=train_gc):
        train_batches(model, range(4))
        dump(model, tmp_path / "ckpt")
        first = evaluate(model, probe)
        model_file.parent.mkdir()
        model_file.write_bytes((tmp_path / "ckpt" / "jit_dense.pt").read_bytes())
        with serving(tmp_path / "ckpt", model_file, ps_config=inc, model_poll_seconds=POLL_S) as server:
            url = f"http://127.0.0.1:{server.http_port}/v1/predict"
            wait_for_prediction(url, body, first)

            # more training: the training PS ships changed rows as packets; the served embeddings follow
            # while the served dense model is still the old one
            old_dense = copy.deepcopy(model)
            train_batches(model, range(100, 106))
            embeddings_only = evaluate(old_dense, probe)
            assert not np.allclose(embeddings_only, first, atol=1e-4)
            wait_for_prediction(url, body, embeddings_only)
            stats = server.test_ps.stats()
            assert stats["incremental_packets_applied"] > 0 and stats["incremental_rows_applied"] > 0, stats
            assert stats["incremental_packets_rejected"] == 0 and stats["incremental_delay_seconds"] >= 0

            # a new jit file (written elsewhere, renamed into place) is served without a restart
            dump(model, tmp_path / "ckpt2")
            tmp = model_file.with_suffix(".tmp")
            tmp.write_bytes((tmp_path / "ckpt2" / "jit_dense.pt").read_bytes())
            tmp.rename(model_file)
            wait_for_prediction(url, body, evaluate(model, probe))
            # the server counts the load just after it swaps the model in: the new prediction can
            # be served a moment before the count reads 2
            loads_ok = f'persia_serving_model_loads_total{{persia_job="{job_label()}",result="ok"}} 2.0'
            poll_until(lambda: loads_ok in server.metrics.render().decode(),
                       "the model server to count the second model load", deadline_s=10.0)
