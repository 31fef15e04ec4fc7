"""A stopped gRPC server (``persia.rpc.Server``) lets the calls it was running finish and then ends
its handler threads, with a real server and client on loopback. ``grpc.Server.stop`` alone left
every server's thread pool idling until the process exited."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from persia import rpc
from persia.errors import RemoteError
from persia.security import GrpcTls, grpc_token

from tests.polling import poll_until
from tests.ports import free_ports

pytestmark = pytest.mark.integration


def _handler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("persia-grpc_")}


def test_stop_ends_the_handler_threads_after_the_running_call_finishes():
    before = _handler_threads()
    entered, release = threading.Event(), threading.Event()

    def slow(request):
        entered.set()
        assert release.wait(10), "the test never released the call"
        return {"echo": request["x"]}

    server, port = rpc.serve("persia.Slow", {"Echo": lambda r: {"echo": r["x"]}, "Slow": slow},
                             0, host="127.0.0.1", max_workers=4)
    client = rpc.Client(f"127.0.0.1:{port}", "persia.Slow")
    try:
        with ThreadPoolExecutor(4) as pool:  # several calls at once, so the pool grows past one thread
            answers = list(pool.map(lambda i: client.call("Echo", {"x": np.arange(i)}, timeout=10), range(8)))
        assert [a["echo"].tolist() for a in answers] == [list(range(i)) for i in range(8)]
        started = _handler_threads() - before
        assert started, "the server ran its handlers on no thread of its own"

        pending = client.future("Slow", {"x": np.arange(3)}, timeout=10)
        assert entered.wait(10), "the slow call never reached its handler"
        stopped = server.stop(grace=10)
        assert not stopped.is_set(), "the server stopped with a call still running"
        assert all(t.is_alive() for t in started & _handler_threads()), "threads ended under a running call"

        release.set()
        assert client.result("Slow", pending)["echo"].tolist() == [0, 1, 2]
        assert stopped.wait(10), "the server did not stop once its last call ended"
        poll_until(lambda: not (_handler_threads() - before), "the stopped server's handler threads end")
    finally:
        release.set()
        client.close()
        server.stop(None)


def test_stop_without_grace_ends_an_idle_servers_threads():
    before = _handler_threads()
    server, port = rpc.serve("persia.Echo", {"Echo": lambda r: {"echo": r["x"]}}, 0, host="127.0.0.1")
    client = rpc.Client(f"127.0.0.1:{port}", "persia.Echo")
    try:
        assert client.call("Echo", {"x": np.arange(2)}, timeout=10)["echo"].tolist() == [0, 1]
        assert _handler_threads() - before
    finally:
        client.close()
    assert server.stop(None).wait(10)
    poll_until(lambda: not (_handler_threads() - before), "an idle stopped server's handler threads end")


def test_a_port_that_cannot_be_bound_is_an_error_naming_the_service():
    """gRPC binds with SO_REUSEPORT unless told not to: a second server on a taken port would
    silently take half of the first one's connections."""
    taken, port = rpc.serve("persia.First", {"Echo": lambda r: r}, 0, host="127.0.0.1")
    try:
        with pytest.raises(OSError, match="persia.Second.*127.0.0.1"):
            rpc.start_server(_generic("persia.Second"), "127.0.0.1", port, GrpcTls(),
                             max_workers=1, thread_name_prefix="persia-grpc")
    finally:
        taken.stop(None)


def _generic(service: str):
    import grpc

    return grpc.method_handlers_generic_handler(service, {})


def test_a_client_reaches_a_server_that_came_up_late_within_seconds():
    """A client that kept failing to connect (its server loading a checkpoint, restarting) reaches
    the server within about 2 s of it coming up: gRPC's reconnect backoff grows to 120 s by
    default. After 30 s of failures the default would have tried at about 26 s and next try at
    about 43 s (each wait jittered 20%), about 13 s after the server came up; under 8 s in 2% of
    runs. Capped at 2 s (2.4 s with jitter) the client is in by then with room for a slow machine."""
    port = free_ports(1)
    client = rpc.Client(f"127.0.0.1:{port}", "persia.Late")
    server = None
    try:
        failing_until = time.monotonic() + 30.0
        while time.monotonic() < failing_until:  # the channel's backoff grows while nothing listens
            with pytest.raises(RemoteError):
                client.call("Echo", {"x": 1}, timeout=0.5)
            time.sleep(0.2)
        server, _ = rpc.serve("persia.Late", {"Echo": lambda r: {"echo": r["x"]}}, port, host="127.0.0.1")
        up = time.monotonic()

        def answers() -> bool:
            try:
                return client.call("Echo", {"x": 7}, timeout=0.5)["echo"] == 7
            except RemoteError:
                return False

        poll_until(answers, "the client reaches the late server", deadline_s=30)
        took = time.monotonic() - up
        assert took < 8.0, f"the client waited out a long reconnect backoff: in after {took:.1f} s"
    finally:
        client.close()
        if server is not None:
            server.stop(None)


def test_a_service_makes_each_handler_as_its_call_arrives_after_the_credential_check():
    """``rpc.Service`` is both the fixed table of ``rpc.serve`` and the model server's per-call
    handler factories: a factory is called once per call, with the call's arrival time, and only
    for a call that carries the job's credential (one without is refused UNAUTHENTICATED and makes
    nothing)."""
    made: list[float] = []

    def make(arrived: float) -> grpc.RpcMethodHandler:
        made.append(arrived)
        return grpc.unary_unary_rpc_method_handler(lambda req, _ctx: {"arrived": arrived},
                                                   request_deserializer=rpc._unpack_request,
                                                   response_serializer=rpc._pack)

    service = rpc.Service("persia.Made", {"When": make}, token=grpc_token(b"s1"))
    server = rpc.start_server(service, "127.0.0.1", 0, GrpcTls(), max_workers=2, thread_name_prefix="persia-grpc")
    member = rpc.Client(f"127.0.0.1:{server.port}", "persia.Made", secret=b"s1")
    stranger = rpc.Client(f"127.0.0.1:{server.port}", "persia.Made", secret=None)
    other = rpc.Client(f"127.0.0.1:{server.port}", "persia.Other", secret=b"s1")
    try:
        before = time.monotonic()
        answers = [member.call("When", None, timeout=10)["arrived"] for _ in range(2)]
        assert made == answers and before <= answers[0] < answers[1] <= time.monotonic()
        with pytest.raises(RemoteError) as info:
            stranger.call("When", None, timeout=10)
        assert info.value.kind == "UNAUTHENTICATED" and len(made) == 2
        with pytest.raises(RemoteError) as info:  # another service's method: not ours (UNIMPLEMENTED)
            other.call("When", None, timeout=10)
        assert info.value.kind == "UNIMPLEMENTED"
    finally:
        for client in (member, stranger, other):
            client.close()
        server.stop(None)
