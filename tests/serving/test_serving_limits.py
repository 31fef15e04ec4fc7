"""The model server under requests and peers that misbehave: bodies that do not parse, slow
clients, a stuck or unreachable embedding worker, requests that time out or are too large,
inputs or outputs that are not finite, features the model does not take, a reload mid-batch.

No training here: the embedding stack is an inference PS started empty (lookups of rows it does
not hold read zeros) and an embedding worker, or a fake worker; the model is a small scripted one
whose second output column is ``sqrt(dense[:, 0])`` (per-row, so order shows; NaN for a negative).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import List

import numpy as np
import pytest
import torch

from persia.data_loader.batch import IDTypeFeature, IDTypeFeatureWithSingleID, NonIDTypeFeature, PersiaBatch
from persia.embedding_worker.service import SERVICE as WORKER_SERVICE
from persia.errors import RemoteError
from persia.rpc import Client, serve
from persia.serving import ModelServer, ServeConfig
from persia.serving.batcher import Batcher
from persia.serving.predictor import ModelInputError, Predictor
from persia.serving.request import RequestError, batch_from_bytes, batch_from_json, rows, signature

from tests.polling import poll_until
from tests.ports import refusing_port

pytestmark = pytest.mark.integration


class LimitsModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 + 4 + 4 + 3 * 4, 1)

    def forward(self, non_id: List[torch.Tensor], emb: List[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([non_id[0], emb[0], emb[1], emb[2].flatten(1)], dim=1)
        return torch.cat([self.lin(x), torch.sqrt(non_id[0][:, :1])], dim=1)


def body(dense: list, slots=("user", "item", "tags")) -> dict:
    n = len(dense)
    ids = {"user": list(range(n)), "item": [[1, 2]] * n, "tags": [[3]] * n}
    return {"id_type_features": {s: ids[s] for s in slots}, "non_id_type_features": {"dense": dense}}


def post(url: str, data: bytes, ctype: str = "application/json", timeout: float = 20.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get(url: str, timeout: float = 20.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def strict_json(raw: bytes):
    """JSON as the standard has it: a bare NaN or Infinity fails."""
    def refuse(name):
        raise AssertionError(f"the reply holds a bare {name}: {raw[:200]!r}")
    return json.loads(raw, parse_constant=refuse)


def metric(server: ModelServer, name: str) -> float:
    text = server.metrics.render().decode()
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "jit_dense.pt"
    torch.jit.save(torch.jit.script(LimitsModel()), str(path))
    return path


@pytest.fixture(scope="module")
def worker_address():
    """An inference PS started empty and an embedding worker in front of it (no NATS)."""
    from persia.config import load_embedding_config_from_dict, load_global_config_from_dict
    from persia.embedding_ps.service import EmbeddingParameterServer
    from persia.embedding_worker.service import EmbeddingWorker

    from tests.integration.cluster import EMBEDDING_CONFIG, GLOBAL_CONFIG

    gc = load_global_config_from_dict(dict(GLOBAL_CONFIG, common_config={"job_type": "Infer", "infer_config": {}}))
    ec = load_embedding_config_from_dict(EMBEDDING_CONFIG)
    ps = EmbeddingParameterServer(gc, 0, 1, port=0, host="127.0.0.1")
    worker = EmbeddingWorker(ec, gc, 0, 1, port=0, host="127.0.0.1", ps_addresses=[ps.address])
    try:
        yield worker.address
    finally:
        worker.stop()
        ps.stop()


@contextmanager
def model_server(embedding_workers: list[str], model, **cfg):
    cfg.setdefault("grpc_port", None)
    server = ModelServer(ServeConfig(embedding_workers=embedding_workers, model=str(model), http_port=0, **cfg))
    try:
        yield server
    finally:
        server.stop()


# -- parsing: every failure a 400 naming the field ---------------------------------------------------

@pytest.mark.parametrize("request_body, field", [
    ({"id_type_features": {"a": ["1" * 5000]}}, "id_type_features.a[0]"),  # int()'s 4300-digit limit
    ({"id_type_features": {"a": ["\u00b2"]}}, "id_type_features.a[0]"),  # isdigit() yet not int()
    ({"id_type_features": {"a": ["\u0661"]}}, "id_type_features.a[0]"),  # an Arabic-Indic digit
    ({"id_type_features": {"": [1]}}, "id_type_features"),
    ({"id_type_features": {"a": [1]}, "non_id_type_features": {"": [[1.0]]}}, "non_id_type_features"),
    ({"id_type_features": {"a": [1]}, "non_id_type_features": {"d": [[10 ** 400]]}}, "non_id_type_features.d"),
    ({"id_type_features": {"a": [1]}, "non_id_type_features": {"d": [[1e39]]}}, "non_id_type_features.d"),
])
def test_json_values_that_do_not_parse_name_their_field(request_body, field):
    with pytest.raises(RequestError) as info:
        batch_from_json(request_body)
    assert info.value.field == field


def _binary(dense: np.ndarray) -> bytes:
    return PersiaBatch([IDTypeFeatureWithSingleID("a", np.arange(len(dense), dtype=np.uint64))],
                       non_id_type_features=[NonIDTypeFeature(dense, name="d")], requires_grad=False).to_bytes()


def test_binary_dense_features_reach_the_model_as_finite_float32(monkeypatch):
    # a client that skips its own checks (or is not this library) can still send NaN: the server checks
    monkeypatch.setenv("PERSIA_SKIP_CHECK_DATA", "1")
    for dense in (np.ones((2, 2), dtype=np.float64), np.ones((2, 2), dtype=np.int64),
                  np.array([[1.0, np.nan]], dtype=np.float32), np.array([[np.inf]], dtype=np.float32)):
        with pytest.raises(RequestError) as info:
            batch_from_bytes(_binary(dense))
        assert info.value.field == "non_id_type_features.d", dense.dtype
    for dense in (np.array([[1, -2]], dtype=np.int16), np.array([[0.5]], dtype=np.float16)):  # widened exactly
        got = batch_from_bytes(_binary(dense)).non_id_type_features[0].data
        assert got.dtype == np.float32 and got.tolist() == dense.astype(np.float32).tolist()


def test_bodies_that_do_not_parse_are_400_never_a_dropped_connection(model_file):
    with model_server(["127.0.0.1:1"], model_file) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        for data in (b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json
                     json.dumps({"id_type_features": {"a": ["1" * 5000]}}).encode(),
                     json.dumps({"id_type_features": {"a": ["\u00b2"]}}).encode(),
                     json.dumps({"id_type_features": {"": [1]}}).encode(),
                     b'{"id_type_features": {"a": [1]}, "non_id_type_features": {"d": [[1' + b"0" * 400 + b']]}}'):
            status, raw = post(url, data)
            assert status == 400 and json.loads(raw)["kind"] == "bad_request", raw
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
            s.sendall("POST /v1/predict HTTP/1.1\r\nContent-Type: application/json\r\n"
                      "Content-Length: \u00b2\r\n\r\n".encode("latin-1"))
            assert s.recv(4096).startswith(b"HTTP/1.1 411")
        assert metric(server, "persia_serving_errors_total") == 6.0


# -- slow clients ------------------------------------------------------------------------------------

def _closed_within(s: socket.socket, seconds: float) -> bytes:
    """What the server sent before it closed ``s``; fails if it has not closed it in ``seconds``."""
    s.settimeout(seconds)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open for {seconds} s (got {got[:100]!r})") from None
    return got


def test_slow_and_idle_http_clients_are_cut_off(model_file):
    with model_server(["127.0.0.1:1"], model_file, http_timeout_s=0.5) as server:
        addr = ("127.0.0.1", server.http_port)
        with socket.create_connection(addr) as s:  # headers, then a stalled body
            s.sendall(b"POST /v1/predict HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            assert _closed_within(s, 10).startswith(b"HTTP/1.1 408")
        with socket.create_connection(addr) as s:  # an idle connection
            assert _closed_within(s, 10) == b""
        with socket.create_connection(addr) as s:  # a body trickled a byte at a time: the whole body has 0.5 s
            s.sendall(b"POST /v1/predict HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
            t0 = time.monotonic()
            try:
                while time.monotonic() - t0 < 10:
                    s.sendall(b" ")
                    time.sleep(0.05)
            except OSError:  # reset: the server closed it
                pass
            else:
                raise AssertionError("the server read a trickled body for 10 s")
        with socket.create_connection(addr) as s:  # the server still answers
            s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(10)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")


def _trickle_until_cut_off(s: socket.socket, chunks, every_s: float, for_s: float) -> float:
    """Send ``chunks`` one every ``every_s`` until the server cuts ``s`` off; how long that took
    (fails after ``for_s``)."""
    t0 = time.monotonic()
    try:
        for chunk in chunks:
            if time.monotonic() - t0 > for_s:
                break
            s.sendall(chunk)
            time.sleep(every_s)  # the trickle itself, not a synchronisation
    except OSError:  # reset or broken pipe: the server closed it
        return time.monotonic() - t0
    raise AssertionError(f"the server kept reading a trickle for {for_s} s")


def test_headers_trickled_byte_by_byte_or_line_by_line_are_cut_off(model_file):
    """The request line and headers have ``http_timeout_s`` altogether: a client that sends a byte
    or a header line just inside the per-read timeout each time held its thread for ever."""
    def header_lines():
        yield b"POST /v1/predict HTTP/1.1\r\n"
        for i in range(10_000):
            yield f"X-Pad-{i}: y\r\n".encode()

    def header_bytes():
        for i in range(10_000):
            yield b"GET /live HTTP/1.1\r\nX-Pad: "[i:i + 1] or b"y"

    with model_server(["127.0.0.1:1"], model_file, http_timeout_s=0.5) as server:
        addr = ("127.0.0.1", server.http_port)
        for chunks in (header_lines(), header_bytes()):
            with socket.create_connection(addr) as s:
                assert _trickle_until_cut_off(s, chunks, every_s=0.05, for_s=10) < 10
        with socket.create_connection(addr) as s:  # a whole request still has its time
            s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(10)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")


def _overloaded(server) -> float:
    text = server.metrics.render().decode()
    m = re.search(r'^persia_serving_errors_total\{[^}]*kind="overloaded"[^}]*\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_connections_over_max_connections_are_answered_503_and_closed(model_file):
    """Each connection holds a thread: past ``max_connections`` one more is refused at once (a
    flood of idle connections took a thread each, without limit); a slot frees when one closes."""
    with model_server(["127.0.0.1:1"], model_file, max_connections=2, http_timeout_s=30) as server:
        addr = ("127.0.0.1", server.http_port)
        held = [socket.create_connection(addr), socket.create_connection(addr)]
        try:
            poll_until(lambda: metric(server, "persia_serving_http_connections") == 2, "two connections open")
            with socket.create_connection(addr) as s:
                got = _closed_within(s, 10)
            assert got.startswith(b"HTTP/1.1 503"), got
            assert json.loads(got.split(b"\r\n\r\n", 1)[1])["kind"] == "overloaded"
            assert _overloaded(server) == 1
            held.pop().close()
            poll_until(lambda: metric(server, "persia_serving_http_connections") == 1, "a connection closed")
            with socket.create_connection(addr) as s:  # its slot is free again
                s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
                s.settimeout(10)
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            for s in held:
                s.close()


# -- deadlines: a stuck embedding worker, requests whose callers gave up ---------------------------

@pytest.fixture
def stuck_worker():
    """A fake embedding worker: its first lookup hangs (until the test ends), the others are
    refused at once (INVALID_ARGUMENT, as for an unknown slot). Records each lookup's batch size."""
    release = threading.Event()
    sizes: list[int] = []

    def lookup(req):
        sizes.append(int(req["batch_size"]))
        if len(sizes) == 1:
            release.wait(60)
            raise ValueError("released")
        raise ValueError("unknown slot 'x'")

    server, port = serve(WORKER_SERVICE, {"LookupDirect": lookup}, port=0, host="127.0.0.1")
    try:
        yield f"127.0.0.1:{port}", sizes
    finally:
        release.set()
        server.stop(grace=None).wait(10)


def test_a_stuck_embedding_worker_holds_a_batch_slot_only_until_the_deadline(model_file, stuck_worker):
    address, sizes = stuck_worker
    with model_server([address], model_file, workers=1, request_timeout_s=3.0, grpc_port=0) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        answers: dict = {}

        def send(name, dense):
            answers[name] = post(url, json.dumps(body(dense)).encode())

        a = threading.Thread(target=send, args=("a", [[1.0, 0.0]] * 2))
        a.start()
        poll_until(lambda: len(sizes) == 1, "request a's lookup reached the worker")
        # b: a gRPC caller that gives up after 1 s; its request must never run
        b = PersiaBatch([IDTypeFeatureWithSingleID("user", np.arange(3, dtype=np.uint64))], requires_grad=False)
        with pytest.raises(RemoteError) as info:
            Client(f"127.0.0.1:{server.grpc_port}", "persia.ModelServer").call("Predict", {"batch": b.to_bytes()},
                                                                              timeout=1.0)
        assert info.value.kind == "DEADLINE_EXCEEDED"
        c = threading.Thread(target=send, args=("c", [[1.0, 0.0]]))
        c.start()
        a.join(20)
        c.join(20)
        status, raw = answers["a"]
        assert status == 504 and json.loads(raw)["kind"] == "timeout", raw
        # the only batch slot was free again at a's deadline (not after rpc's 60 s): c ran, and was
        # answered by the worker (refused: a 400), not timed out behind a
        status, raw = answers["c"]
        assert status == 400 and "unknown slot" in json.loads(raw)["error"], raw
        assert sizes == [2, 1], sizes  # b (3 samples) was dropped, never looked up


def test_the_batcher_never_runs_cancelled_or_expired_requests():
    started, release = threading.Event(), threading.Event()
    ran: list[list[int]] = []

    def run(batches, deadline):
        ran.append([b.batch_size for b in batches])
        if len(ran) == 1:
            started.set()
            release.wait(10)
        return [np.zeros((b.batch_size, 1), dtype=np.float32) for b in batches]

    def batch(n):
        return PersiaBatch([IDTypeFeatureWithSingleID("a", np.arange(n, dtype=np.uint64))], requires_grad=False)

    batcher = Batcher(run, max_batch_size=100, max_latency_s=0.0, workers=1)
    try:
        first = batcher.submit(batch(1), time.monotonic() + 30)
        assert started.wait(10)
        # while the only slot is taken: one request whose caller gives up, one whose deadline passes
        cancelled = batcher.submit(batch(2), time.monotonic() + 30)
        expires_at = time.monotonic() + 0.05
        expired = batcher.submit(batch(3), expires_at)
        assert cancelled.cancel()
        poll_until(lambda: time.monotonic() > expires_at, "the deadline passed")
        last = batcher.submit(batch(4), time.monotonic() + 30)
        release.set()
        with pytest.raises(TimeoutError):
            expired.result(10)
        assert first.result(10).shape == (1, 1) and last.result(10).shape == (4, 1)
        assert ran == [[1], [4]]
    finally:
        release.set()
        batcher.stop()


# -- sizes, values and shapes -------------------------------------------------------------------------

def test_rows_cuts_every_feature_at_the_same_samples():
    b = PersiaBatch([IDTypeFeatureWithSingleID("a", np.arange(5, dtype=np.uint64)),
                     IDTypeFeature("m", [np.arange(i, dtype=np.uint64) + 10 * i for i in range(5)])],
                    non_id_type_features=[NonIDTypeFeature(np.arange(10, dtype=np.float32).reshape(5, 2), name="d")],
                    requires_grad=False)
    part = rows(b, 1, 4)
    assert part.batch_size == 3
    assert part.id_type_features[0].data.tolist() == [1, 2, 3]
    assert [s.tolist() for s in part.id_type_features[1].data] == [[10], [20, 21], [30, 31, 32]]
    assert part.non_id_type_features[0].data.tolist() == [[2, 3], [4, 5], [6, 7]]


def test_a_request_over_max_batch_size_runs_in_chunks_in_order(model_file, worker_address):
    with model_server([worker_address], model_file, max_batch_size=2) as server:
        dense = [[float(i * i), 0.0] for i in range(5)]
        status, raw = post(f"http://127.0.0.1:{server.http_port}/v1/predict", json.dumps(body(dense)).encode())
        assert status == 200, raw
        assert [row[1] for row in strict_json(raw)["predictions"]] == [0.0, 1.0, 2.0, 3.0, 4.0]
        # three model calls of at most max_batch_size samples: 2 + 2 + 1
        assert metric(server, "persia_serving_batch_size_count") == 3.0
        assert metric(server, "persia_serving_batch_size_sum") == 5.0


def test_no_reply_holds_a_bare_nan_and_features_the_model_does_not_take_are_400(model_file, worker_address):
    with model_server([worker_address], model_file) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        status, raw = post(url, json.dumps(body([[-1.0, 0.0], [4.0, 0.0]])).encode())
        assert status == 200, raw
        predictions = strict_json(raw)["predictions"]
        assert predictions[0][1] is None and predictions[1][1] == 2.0
        # the same over gRPC/binary keeps the float32 NaN; a float64 dense column is refused
        status, raw = post(url, _binary(np.ones((1, 2), dtype=np.float64)), "application/x-persia-batch")
        assert status == 400 and json.loads(raw)["field"] == "non_id_type_features.d", raw
        # no "tags" slot: the model's emb[2] does not exist
        status, raw = post(url, json.dumps(body([[1.0, 0.0]], slots=("user", "item"))).encode())
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert "does not take" in error and "['user', 'item', 'tags']" in error, error
        # a dense column of another width
        status, raw = post(url, json.dumps(body([[1.0, 0.0, 0.0]])).encode())
        assert status == 400 and "shapes cannot be multiplied" in json.loads(raw)["error"], raw
        assert metric(server, "persia_serving_errors_total") == 3.0


def test_a_shape_error_on_a_layout_the_model_took_before_is_the_servers():
    class Holder:
        last_error = None

        def current(self):
            return None

    predictor = Predictor(["127.0.0.1:1"], Holder())
    model = object()
    b = batch_from_json(body([[1.0, 0.0]]))
    shape_error = RuntimeError("The following operation failed...\nRuntimeError: mat1 and mat2 shapes cannot be "
                               "multiplied (1x25 and 22x1)")
    assert isinstance(predictor._model_error(shape_error, b, model), ModelInputError)
    other = RuntimeError("RuntimeError: division by zero")
    assert predictor._model_error(other, b, model) is other
    predictor._known_inputs(model)[signature(b)] = True  # as after a request of this layout went through
    assert predictor._model_error(shape_error, b, model) is shape_error  # 500: the request's layout worked


# -- one model version per batch ---------------------------------------------------------------------

def test_a_batch_rerun_request_by_request_uses_one_model_version(monkeypatch):
    """The merged batch fails (one request refused): the rerun of each request must not pick up a
    model reloaded meanwhile."""
    versions = iter(range(1, 100))

    class Reloading:
        last_error = None

        def current(self):  # a reload between every two reads
            v = float(next(versions))
            return lambda non_id, emb: torch.full((non_id[0].shape[0], 1), v)

    predictor = Predictor(["127.0.0.1:1"], Reloading())

    def lookup(batch, timeout=60.0, failover=False):
        if batch.batch_size == 3:  # the merged batch
            raise RemoteError("ew", "unknown slot", kind="INVALID_ARGUMENT")
        return batch

    monkeypatch.setattr(predictor.ctx, "_lookup_batch", lookup)
    monkeypatch.setattr(predictor.ctx, "prepare_features",
                        lambda b: ([torch.from_numpy(b.non_id_type_features[0].data.copy())], [], None))
    out = predictor.run([batch_from_json(body([[1.0, 0.0]], slots=("user",))),
                         batch_from_json(body([[1.0, 0.0]] * 2, slots=("user",)))])
    assert {float(o[0, 0]) for o in out} == {1.0}, out


# -- failover ----------------------------------------------------------------------------------------

def test_an_unreachable_embedding_worker_is_failed_over(model_file, worker_address):
    with refusing_port() as port, model_server([f"127.0.0.1:{port}", worker_address], model_file) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        for _ in range(4):  # round-robin: every other lookup goes to the dead worker first
            status, raw = post(url, json.dumps(body([[1.0, 0.0]])).encode())
            assert status == 200, raw


def test_lookups_fail_over_through_every_unreachable_worker_to_one_that_answers(model_file, worker_address):
    """Two workers down ahead of the live one: before, a lookup was tried on the next worker only,
    so the one that started on the first dead worker failed (a third of the requests)."""
    with refusing_port() as a, refusing_port() as b, \
            model_server([f"127.0.0.1:{a}", f"127.0.0.1:{b}", worker_address], model_file) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/predict"
        for _ in range(6):  # round-robin: each start, twice
            status, raw = post(url, json.dumps(body([[1.0, 0.0]])).encode())
            assert status == 200, raw
        status, raw = get(f"http://127.0.0.1:{server.http_port}/ready")
        assert status == 200 and b"1 of 3 embedding workers answer" in raw, raw
