"""The model server end to end in one process: a trained checkpoint served by an inference PS and
embedding worker (real gRPC, no NATS), predictions over HTTP/JSON, HTTP binary and gRPC equal to
the training job's own evaluation; bad requests, readiness, batching and metrics."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from persia.errors import RemoteError
from persia.metrics import job_label
from persia.rpc import Client
from persia.serving.local_stack import post_json

from tests.integration.cluster import cluster
from tests.integration.test_training_path import make_batch
from tests.serving.helpers import ServedModel, dump, evaluate, serving, train_batches

pytestmark = pytest.mark.integration


def as_json(batch) -> dict:
    ids = {}
    for f in batch.id_type_features:
        values, offsets = f.to_csr()
        samples = [values[offsets[i]:offsets[i + 1]].tolist() for i in range(batch.batch_size)]
        ids[f.name] = [s[0] for s in samples] if f.name == "user" else samples
    return {"id_type_features": ids,
            "non_id_type_features": {p.name: p.data.tolist() for p in batch.non_id_type_features}}


def http(url: str, data: bytes | None = None, ctype: str = "application/json") -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def trained(persia_env, tmp_path):
    model = ServedModel()
    probes = [make_batch(5000 + i, requires_grad=False) for i in range(4)]
    with cluster():
        train_batches(model, range(8))
        expected = [evaluate(model, p) for p in probes]
        dump(model, tmp_path / "ckpt")
    return tmp_path / "ckpt", probes, expected


def test_served_predictions_equal_the_evaluation(trained):
    ckpt, probes, expected = trained
    with serving(ckpt, ckpt / "jit_dense.pt", max_latency_ms=1.0) as server:
        url = f"http://127.0.0.1:{server.http_port}"
        status, body = http(url + "/ready")
        assert status == 200, body
        status, body = post_json(url + "/v1/predict", as_json(probes[0]))
        assert status == 200, body
        np.testing.assert_allclose(np.asarray(body["predictions"]), expected[0], rtol=0, atol=1e-6)
        status, raw = http(url + "/v1/predict", probes[1].to_bytes(), "application/x-persia-batch")
        assert status == 200, raw
        np.testing.assert_allclose(np.asarray(json.loads(raw)["predictions"]), expected[1], rtol=0, atol=1e-6)
        client = Client(f"127.0.0.1:{server.grpc_port}", "persia.ModelServer")
        got = client.call("Predict", {"batch": probes[2].to_bytes()})["predictions"]
        np.testing.assert_allclose(got, expected[2], rtol=0, atol=1e-6)
        assert client.call("Ready", None)["ready"] is True
        # the predictions did not depend on the untrained rows being created: lookups never train
        assert not np.allclose(expected[0], expected[0].mean())


def test_concurrent_requests_are_batched_and_answered_separately(trained):
    ckpt, probes, expected = trained
    # the batch closes when it holds every probe's samples, long before the latency bound
    total = sum(p.batch_size for p in probes)
    with serving(ckpt, ckpt / "jit_dense.pt", max_batch_size=total, max_latency_ms=10_000) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        results: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, post_json(url, as_json(probes[i]))))
                   for i in range(len(probes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, want in enumerate(expected):
            status, body = results[i]
            assert status == 200, body
            np.testing.assert_allclose(np.asarray(body["predictions"]), want, rtol=0, atol=1e-6)
        metrics = http(f"http://127.0.0.1:{server.http_port}/metrics")[1].decode()
        job = f'persia_job="{job_label()}"'
        assert f"persia_serving_batch_size_count{{{job}}} 1.0" in metrics
        assert f"persia_serving_batch_size_sum{{{job}}} {float(total)}" in metrics


@pytest.mark.parametrize("body, field", [
    ({"id_type_features": {"user": ["x"]}}, "id_type_features.user[0]"),
    ({"id_type_features": {"user": [-1]}}, "id_type_features.user[0]"),
    ({"id_type_features": {"user": [1, 2]}, "non_id_type_features": {"dense": [[1.0, 2.0]]}},
     "non_id_type_features.dense"),
    ({"id_type_features": {"user": [1]}, "non_id_type_features": {"dense": [["a", 2.0]]}},
     "non_id_type_features.dense[0][0]"),
    ({"ids": {}}, "ids"),
    ([1, 2], "body"),
])
def test_bad_requests_are_answered_400_naming_the_field(body, field):
    """Pure parsing: the same function the HTTP handler calls (the handler's 400s: below)."""
    from persia.serving.request import RequestError, batch_from_json

    with pytest.raises(RequestError) as info:
        batch_from_json(body)
    assert info.value.field == field


def test_bad_requests_over_the_wire(trained, monkeypatch):
    ckpt, probes, _ = trained
    # the operator sets PERSIA_JOB_NAME on model-server pods: every series carries it as persia_job,
    # which the dashboard's job filter selects on
    monkeypatch.setenv("PERSIA_JOB_NAME", "serving-job-7")
    with serving(ckpt, ckpt / "jit_dense.pt") as server:
        base = f"http://127.0.0.1:{server.http_port}"
        status, raw = http(base + "/v1/predict", b"{not json")
        assert status == 400 and json.loads(raw)["field"] == "body"
        status, raw = http(base + "/v1/predict", json.dumps({"id_type_features": {"user": ["x"]}}).encode())
        assert status == 400 and json.loads(raw)["field"] == "id_type_features.user[0]", raw
        status, raw = http(base + "/v1/predict", b"abc", "text/plain")
        assert status == 415 and json.loads(raw)["field"] == "Content-Type"
        status, raw = http(base + "/v1/predict", b"\x00garbage", "application/x-persia-batch")
        assert status == 400 and b"not a PersiaBatch payload" in raw
        bad_slot = make_batch(1, requires_grad=False, unknown_slot=True)
        status, raw = http(base + "/v1/predict", bad_slot.to_bytes(), "application/x-persia-batch")
        assert status == 400 and b"not_a_slot" in raw, raw
        assert http(base + "/nope")[0] == 404
        client = Client(f"127.0.0.1:{server.grpc_port}", "persia.ModelServer")
        with pytest.raises(RemoteError) as info:
            client.call("Predict", {"batch": b"\x00garbage"})
        assert info.value.kind == "INVALID_ARGUMENT" and "PersiaBatch" in info.value.remote_message
        with pytest.raises(RemoteError) as info:
            client.call("Predict", {"batches": b"x"})
        assert info.value.kind == "INVALID_ARGUMENT" and "batch" in info.value.remote_message
        # the server still serves after all that
        status, _ = http(base + "/v1/predict", probes[0].to_bytes(), "application/x-persia-batch")
        assert status == 200
        metrics = http(base + "/metrics")[1].decode()
        assert 'persia_serving_errors_total{kind="bad_request",persia_job="serving-job-7"} 7.0' in metrics
        assert 'persia_serving_requests_total{code="200",persia_job="serving-job-7",protocol="http"} 1.0' in metrics
        series = [line for line in metrics.splitlines() if line.startswith("persia_serving_")]
        assert series and all('persia_job="serving-job-7"' in line for line in series), metrics


def test_readiness_follows_the_model_file(persia_env, tmp_path, trained):
    ckpt, probes, _ = trained
    missing = tmp_path / "later" / "jit_dense.pt"
    with serving(ckpt, missing, model_poll_seconds=0.1) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        status, raw = http(base + "/ready")
        assert status == 503 and b"no model" in raw
        assert http(base + "/live")[0] == 200
        status, raw = http(base + "/v1/predict", probes[0].to_bytes(), "application/x-persia-batch")
        assert status == 503 and json.loads(raw)["kind"] == "unavailable"


def test_persias_torchserve_handler_style_still_works(trained, monkeypatch):
    """PERSIA's handler: InferCtx(get_embedding_worker_services()), get_embedding_from_bytes,
    prepare_features, the jitted model (TorchServe itself is not installed here)."""
    import torch

    from persia.ctx import InferCtx
    from persia.service import get_embedding_worker_services

    ckpt, probes, expected = trained
    with serving(ckpt, ckpt / "jit_dense.pt") as server:
        monkeypatch.setenv("EMBEDDING_WORKER_SERVICE", server.predictor.ctx._workers[0].address)
        model = torch.jit.load(str(ckpt / "jit_dense.pt"))
        model.eval()
        ctx = InferCtx(get_embedding_worker_services())
        ctx.wait_for_serving()
        non_id, emb, _ = ctx.prepare_features(ctx.get_embedding_from_bytes(probes[3].to_bytes()))
        with torch.no_grad():
            out = model(non_id, emb)
        np.testing.assert_allclose(out.numpy(), expected[3], rtol=0, atol=1e-6)
