"""The model server's gRPC front under load, with HTTP's limits: calls beyond the queue limit are
refused at once, a message over ``max_request_bytes`` is refused before it is decoded, and a
call's ``request_timeout_s`` counts from its arrival, not from when a handler thread takes it.

Real gRPC on loopback: the model server, and a fake embedding worker (``persia.rpc.serve``)
whose lookups hang until the test releases them, then are refused (INVALID_ARGUMENT).
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from typing import List

import numpy as np
import pytest
import torch

from persia.data_loader.batch import IDTypeFeatureWithSingleID, NonIDTypeFeature, PersiaBatch
from persia.embedding_worker.service import SERVICE as WORKER_SERVICE
from persia.errors import RemoteError
from persia.rpc import Client, serve
from persia.serving import ModelServer, ServeConfig
from persia.serving.grpc_api import SERVICE

from tests.polling import poll_until

pytestmark = pytest.mark.integration

HANDLER_THREADS = 8  # the gRPC pool: max(8, 4 * workers), workers=1 here


class TinyModel(torch.nn.Module):
    def forward(self, non_id: List[torch.Tensor], emb: List[torch.Tensor]) -> torch.Tensor:
        out = emb[0][:, :1]
        for x in non_id:  # any number of dense features (a request's are never refused as unread)
            out = out + 0.0 * x.sum(dim=1, keepdim=True)
        return out


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "jit_dense.pt"
    torch.jit.save(torch.jit.script(TinyModel()), str(path))
    return path


def payload(dense_floats: int = 0) -> dict:
    dense = [NonIDTypeFeature(np.zeros((1, dense_floats), np.float32), name="d")] if dense_floats else []
    b = PersiaBatch([IDTypeFeatureWithSingleID("user", np.arange(1, dtype=np.uint64))],
                    non_id_type_features=dense, requires_grad=False)
    return {"batch": b.to_bytes()}


@contextmanager
def served(model_file, **cfg):
    """(model server, the lookups' batch sizes, the event that releases the hanging lookups)."""
    release = threading.Event()
    lookups: list[int] = []

    def lookup(req):
        lookups.append(int(req["batch_size"]))
        release.wait(60)
        raise ValueError("unknown slot 'x'")

    worker, port = serve(WORKER_SERVICE, {"LookupDirect": lookup}, port=0, host="127.0.0.1")
    try:
        server = ModelServer(ServeConfig(embedding_workers=[f"127.0.0.1:{port}"], model=str(model_file),
                                         http_port=0, grpc_port=0, **cfg))
        try:
            yield server, lookups, release
        finally:
            release.set()
            server.stop()
    finally:
        release.set()
        worker.stop(grace=None).wait(10)


class Calls:
    """Predict calls in threads, each recording (status name, seconds from its start)."""

    def __init__(self, client: Client):
        self.client = client
        self.results: list = []
        self.threads: list[threading.Thread] = []

    def start(self, n: int, timeout: float | None = 60.0) -> None:
        for _ in range(n):
            t = threading.Thread(target=self._one, args=(timeout,), daemon=True)
            t.start()
            self.threads.append(t)

    def _one(self, timeout) -> None:
        t0 = time.monotonic()
        try:
            self.client.call("Predict", payload(), timeout=timeout)
            kind = "OK"
        except RemoteError as exc:
            kind = exc.kind
        self.results.append((kind, time.monotonic() - t0))

    def join(self) -> list:
        for t in self.threads:
            t.join(30)
            assert not t.is_alive(), "a Predict call did not end"
        return self.results


def grpc_requests(server: ModelServer) -> float:
    text = server.metrics.render().decode()
    return sum(float(v) for v in re.findall(r'^persia_serving_requests_total\{[^}]*protocol="grpc"[^}]*\} (\S+)$',
                                            text, re.MULTILINE))


def queue_depth(server: ModelServer) -> float:
    m = re.search(r"^persia_serving_queue_depth\{[^}]*\} (\S+)$", server.metrics.render().decode(), re.MULTILINE)
    return float(m.group(1))


def in_batcher(server: ModelServer, lookups: list[int]) -> int:
    """Requests (1 sample each) that reached the batcher: the hanging batch's, and those queued."""
    return server.batcher.depth() + (lookups[0] if lookups else 0)


def test_grpc_calls_beyond_the_queue_limit_are_refused_at_once(model_file):
    with served(model_file, workers=1, max_queue=4) as (server, lookups, release):
        client = Client(f"127.0.0.1:{server.grpc_port}", SERVICE)
        calls = Calls(client)
        calls.start(4)
        poll_until(lambda: len(lookups) == 1 and in_batcher(server, lookups) == 4, "4 calls in the batcher")
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as info:
            client.call("Predict", payload(), timeout=5.0)
        assert info.value.kind == "RESOURCE_EXHAUSTED", info.value
        assert time.monotonic() - t0 < 2.0
        # gRPC's own refusal is counted as an overloaded request (HTTP's queue-full refusal is)
        text = server.metrics.render().decode()
        assert re.search(r'^persia_serving_errors_total\{kind="overloaded"[^}]*\} 1\.0$', text, re.MULTILINE), text
        assert re.search(r'^persia_serving_requests_total\{code="503"[^}]*protocol="grpc"\} 1\.0$', text,
                         re.MULTILINE), text
        with pytest.raises(RemoteError) as info:  # a Ready call refused is not a request: not counted
            client.call("Ready", None, timeout=5.0)
        assert info.value.kind == "RESOURCE_EXHAUSTED", info.value
        assert grpc_requests(server) == 1.0
        release.set()  # the 4 are answered (the worker refuses their lookup): the limit frees
        assert sorted(k for k, _ in calls.join()) == ["INVALID_ARGUMENT"] * 4
        with pytest.raises(RemoteError) as info:
            client.call("Predict", payload(), timeout=10.0)
        assert info.value.kind == "INVALID_ARGUMENT" and "unknown slot" in str(info.value), info.value
        client.close()


def test_a_grpc_message_over_max_request_bytes_is_refused_undecoded(model_file):
    with served(model_file, max_request_bytes=64 << 10) as (server, lookups, release):
        release.set()
        client = Client(f"127.0.0.1:{server.grpc_port}", SERVICE)
        with pytest.raises(RemoteError) as info:  # under the limit: decoded, looked up (and refused there)
            client.call("Predict", payload(1024), timeout=10.0)
        assert info.value.kind == "INVALID_ARGUMENT", info.value
        assert grpc_requests(server) == 1.0
        with pytest.raises(RemoteError) as info:  # 1 MiB: refused by gRPC, our handler never saw it
            client.call("Predict", payload(1 << 18), timeout=10.0)
        assert info.value.kind == "RESOURCE_EXHAUSTED", info.value
        assert grpc_requests(server) == 1.0 and lookups == [1]
        client.close()


def test_a_grpc_call_waiting_for_a_thread_times_out_counted_from_its_arrival(model_file):
    timeout = 2.0
    with served(model_file, workers=1, request_timeout_s=timeout) as (server, _lookups, _release):
        client = Client(f"127.0.0.1:{server.grpc_port}", SERVICE)
        calls = Calls(client)
        calls.start(3 * HANDLER_THREADS, timeout=None)  # no deadline of the caller's: request_timeout_s
        results = calls.join()
        assert [k for k, _ in results] == ["DEADLINE_EXCEEDED"] * (3 * HANDLER_THREADS), results
        # not 2, 4, 6 s as the calls waiting for a handler thread got their turn
        assert max(s for _, s in results) < timeout + 1.5, sorted(round(s, 2) for _, s in results)
        client.close()


def test_the_queue_depth_counts_grpc_calls_waiting_for_a_thread(model_file):
    with served(model_file, workers=1, request_timeout_s=60.0) as (server, lookups, release):
        client = Client(f"127.0.0.1:{server.grpc_port}", SERVICE)
        calls = Calls(client)
        calls.start(HANDLER_THREADS + 4)
        poll_until(lambda: len(lookups) == 1 and in_batcher(server, lookups) == HANDLER_THREADS,
                   "every handler thread's call in the batcher")
        # the other 4 wait for a thread: counted with those waiting in the batcher
        poll_until(lambda: queue_depth(server) == server.batcher.depth() + 4,
                   "persia_serving_queue_depth counts the 4 calls waiting for a thread", deadline_s=10)
        release.set()
        assert len(calls.join()) == HANDLER_THREADS + 4
        client.close()
