"""The model server says what is wrong: features the model does not read are refused naming them
(400 / INVALID_ARGUMENT), a reloaded model that does not take what is served is refused while the
old one keeps serving (said in ``/ready`` and the metrics), and ``/ready`` stays 200 while an
embedding worker is down but its lookups fail over to another.

Real processes' pieces on loopback: an inference PS and embedding worker (real gRPC), the model
server with HTTP and gRPC.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from persia.data_loader.batch import IDTypeFeatureWithSingleID, NonIDTypeFeature, PersiaBatch
from persia.errors import RemoteError
from persia.rpc import Client
from persia.serving.grpc_api import SERVICE

from tests.polling import poll_until
from tests.ports import refusing_port
from tests.serving.test_serving_limits import (  # noqa: F401
    LimitsModel,
    metric,
    model_server,
    post,
    worker_address,
)

pytestmark = pytest.mark.integration

SAMPLE_IDS = {"user": [1], "item": [[1, 2]], "tags": [[3]], "nope": [4]}


def request(slots=("user", "item", "tags"), dense=None) -> bytes:
    dense = {"dense": [[1.0, 0.0]]} if dense is None else dense
    return json.dumps({"id_type_features": {s: SAMPLE_IDS[s] for s in slots},
                       "non_id_type_features": dense}).encode()


class TwoSlots(torch.nn.Module):
    """Reads non_id[0] and emb[0], emb[1] only."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 + 4 + 4, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]) -> torch.Tensor:
        return self.lin(torch.cat([non_id[0], emb[0], emb[1]], dim=1))


class WiderItem(torch.nn.Module):
    """Trained with an "item" slot of dim 8: the embedding workers serve dim 4."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 + 4 + 8 + 3 * 4, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]) -> torch.Tensor:
        return self.lin(torch.cat([non_id[0], emb[0], emb[1], emb[2].flatten(1)], dim=1))


class EveryDense(torch.nn.Module):
    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]) -> torch.Tensor:
        out = emb[0][:, :1]
        for x in non_id:
            out = out + x.sum(dim=1, keepdim=True)
        return out


def save(module: torch.nn.Module, path) -> None:
    """Write elsewhere, rename into place (what docs/serving.md asks of a model reload)."""
    tmp = f"{path}.tmp"
    torch.jit.save(torch.jit.script(module), tmp)
    os.replace(tmp, path)


def test_what_a_model_reads_comes_from_its_graph():
    from persia.serving.predictor import model_reads

    assert model_reads(torch.jit.script(LimitsModel())) == (1, 3)
    assert model_reads(torch.jit.script(TwoSlots())) == (1, 2)
    assert model_reads(torch.jit.script(EveryDense())) == (None, 1)  # a loop: any number
    assert model_reads(lambda non_id, emb: None) == (None, None)


def test_a_dense_feature_the_model_does_not_read_is_refused_naming_it(tmp_path, worker_address):  # noqa: F811
    save(LimitsModel(), tmp_path / "three.pt")
    with model_server([worker_address], tmp_path / "three.pt", grpc_port=0) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        status, raw = post(url, request())
        assert status == 200, raw
        # a dense feature the model never reads (it takes non_id[0] only): silently dropped before
        status, raw = post(url, request(dense={"dense": [[1.0, 0.0]], "extra": [[5.0]]}))
        assert status == 400, raw
        answer = json.loads(raw)
        assert answer["field"] == "non_id_type_features.extra" and answer["kind"] == "bad_request", answer
        assert "['dense', 'extra']" in answer["error"], answer
        # the same over gRPC
        one = [IDTypeFeatureWithSingleID(s, np.array([i], dtype=np.uint64))
               for i, s in enumerate(["user", "item", "tags"])]
        dense = [NonIDTypeFeature(np.array([[1.0, 0.0]], np.float32), name="dense"),
                 NonIDTypeFeature(np.array([[2.0]], np.float32), name="more")]
        batch = PersiaBatch(one, non_id_type_features=dense, requires_grad=False)
        client = Client(f"127.0.0.1:{server.grpc_port}", SERVICE)
        with pytest.raises(RemoteError) as info:
            client.call("Predict", {"batch": batch.to_bytes()}, timeout=20)
        assert info.value.kind == "INVALID_ARGUMENT" and "non_id_type_features.more" in info.value.remote_message
        client.close()
        assert metric(server, "persia_serving_errors_total") == 2.0


def test_a_slot_the_embedding_worker_does_not_know_is_named(tmp_path, worker_address):  # noqa: F811
    save(LimitsModel(), tmp_path / "three.pt")
    with model_server([worker_address], tmp_path / "three.pt") as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        status, raw = post(url, request(slots=("user", "item", "nope")))  # the field was "id_type_features"
        assert status == 400 and json.loads(raw)["field"] == "id_type_features.nope", raw
        assert "unknown slot 'nope'" in json.loads(raw)["error"], raw


def test_a_slot_the_model_does_not_read_is_refused_naming_it(tmp_path, worker_address):  # noqa: F811
    save(TwoSlots(), tmp_path / "two.pt")
    with model_server([worker_address], tmp_path / "two.pt") as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        assert post(url, request(slots=("user", "item")))[0] == 200
        # a slot the embedding worker knows but the model never reads (emb[2])
        status, raw = post(url, request())
        assert status == 400 and json.loads(raw)["field"] == "id_type_features.tags", raw


def test_a_reload_the_served_layout_does_not_fit_is_refused_and_the_old_model_serves(
        tmp_path, worker_address):  # noqa: F811
    path = tmp_path / "jit_dense.pt"
    save(LimitsModel(), path)
    with model_server([worker_address], path, model_poll_seconds=0.1) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        status, raw = post(base + "/v1/predict", request(dense={"dense": [[4.0, 0.0]]}))
        assert status == 200, raw
        served = json.loads(raw)["predictions"]
        before = server.model.version
        save(WiderItem(), path)  # its item slot is dim 8, the embedding workers serve dim 4
        poll_until(lambda: getattr(server.model, "refused", None) is not None or server.model.version != before,
                   "the new model file taken or refused")
        status, raw = post(base + "/v1/predict", request(dense={"dense": [[4.0, 0.0]]}))
        assert status == 200 and json.loads(raw)["predictions"] == served, raw  # the old model serves on
        assert server.model.version == before and "jit_dense.pt" in server.model.refused
        status, raw = post_get(base + "/ready")
        assert status == 200, raw
        reason = json.loads(raw)["reason"]
        assert "refused to reload the model" in reason and "mat1 and mat2" in reason, reason
        text = server.metrics.render().decode()
        assert re.search(r'^persia_serving_model_loads_total\{[^}]*result="refused"[^}]*\} 1\.0$', text,
                         re.MULTILINE), text
        assert re.search(r"^persia_serving_model_reload_refused\{[^}]*\} 1\.0$", text, re.MULTILINE), text
        # a model that fits is taken again, and the refusal is over
        save(LimitsModel(), path)
        poll_until(lambda: server.model.refused is None, "the fitting model loaded")
        assert json.loads(post_get(base + "/ready")[1])["reason"] == "ready"
        assert re.search(r"^persia_serving_model_reload_refused\{[^}]*\} 0\.0$",
                         server.metrics.render().decode(), re.MULTILINE)


def post_get(url: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_ready_while_one_of_two_embedding_workers_is_down(tmp_path, worker_address):  # noqa: F811
    save(LimitsModel(), tmp_path / "m.pt")
    with refusing_port() as port, \
            model_server([f"127.0.0.1:{port}", worker_address], tmp_path / "m.pt") as server:
        base = f"http://127.0.0.1:{server.http_port}"
        status, raw = post_get(base + "/ready")
        assert status == 200, raw
        reason = json.loads(raw)["reason"]
        assert f"127.0.0.1:{port}" in reason and "1 of 2" in reason, reason
        text = server.metrics.render().decode()
        assert worker_gauge(text, f"127.0.0.1:{port}") == 0.0, text
        assert worker_gauge(text, worker_address) == 1.0, text
        for _ in range(2):  # requests are served: the dead worker's lookups fail over
            assert post(base + "/v1/predict", request())[0] == 200
    with refusing_port() as a, refusing_port() as b, \
            model_server([f"127.0.0.1:{a}", f"127.0.0.1:{b}"], tmp_path / "m.pt") as server:
        status, raw = post_get(f"http://127.0.0.1:{server.http_port}/ready")
        assert status == 503 and "no embedding worker" in json.loads(raw)["reason"], raw


def worker_gauge(text: str, address: str) -> float | None:
    m = re.search(r'^persia_serving_embedding_worker_ready\{embedding_worker="' + re.escape(address) +
                  r'"[^}]*\} (\S+)$', text, re.MULTILINE)
    return None if m is None else float(m.group(1))


class FakeWorker:
    """An embedding worker's client whose ``Ready`` answers as told: True, False (not ready) or a
    status name the call fails with."""

    def __init__(self, address: str, answer):
        self.address, self.answer = address, answer

    def future(self, _name, _req, timeout):
        return self.answer

    def result(self, name, answer):
        if isinstance(answer, str):
            raise RemoteError(f"persia.EmbeddingWorker/{name}@{self.address}", "no", kind=answer)
        return {"ready": answer, "why": "PS replica 0 not loaded"}


@pytest.mark.parametrize("answers, ready, named", [
    ([True, True], True, None),
    (["UNAVAILABLE", True], True, "w0"),  # down: its lookups fail over to w1
    ([True, "UNAVAILABLE"], True, "w1"),  # w1's fail over to w0
    (["UNAVAILABLE", "UNAVAILABLE"], False, "no embedding worker"),
    (["UNAVAILABLE"], False, "w0"),  # alone: nothing to fail over to
    ([False, True], False, "w0: PS replica 0 not loaded"),  # answers, but its lookups fail (no failover)
    (["DEADLINE_EXCEEDED", True], False, "w0"),  # hangs: its lookups time out
    (["UNAVAILABLE", "UNAVAILABLE", True], True, "1 of 3"),  # w0's and w1's go on to w2
    (["UNAVAILABLE", True, True], True, "2 of 3"),
    (["UNAVAILABLE", True, "UNAVAILABLE"], True, "1 of 3"),  # w2's go on through w0 to w1
])
def test_readiness_with_several_embedding_workers(answers, ready, named):
    from persia.serving.predictor import Predictor

    class Holder:
        last_error = None

        def current(self):
            return object()

    predictor = Predictor(["127.0.0.1:1"], Holder())
    predictor.ctx._workers = [FakeWorker(f"w{i}", a) for i, a in enumerate(answers)]
    ok, why = predictor.readiness()
    assert ok is ready, why
    assert (why == "ready") if named is None else (named in why), why
    assert predictor.worker_ready == {f"w{i}": a is True for i, a in enumerate(answers)}
