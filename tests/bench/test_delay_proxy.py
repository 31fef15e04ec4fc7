"""The latency benchmark's delaying proxy: bytes pass unchanged, every chunk waits the delay after
it arrived (checked with an injected clock, not by timing), connections close cleanly, CONNECT
works for real gRPC and refuses what it must."""

from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import pytest

from bench.delay_proxy import DelayProxy, ProxySet, parse_connect_request, parse_hostport
from bench.latency_run import launcher_env, launcher_split, unproxied
from tests.ports import refusing_port


class EchoServer:
    """Echoes every byte back; closes its side after the peer's EOF."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.eof_seen = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)
            self.eof_seen.set()

    def close(self):
        self.sock.close()


def wait_for(pred, deadline_s=10.0, what="condition"):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def recv_exactly(sock, n):
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"connection closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


def test_bytes_pass_unchanged_and_half_close_travels_both_ways(echo):
    proxy = DelayProxy(0.0005, upstream=("127.0.0.1", echo.port)).start()
    try:
        payload = os.urandom(3 * 1024 * 1024 + 17)
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            sender = threading.Thread(target=c.sendall, args=(payload,))
            sender.start()
            got = recv_exactly(c, len(payload))
            sender.join()
            assert got == payload
            c.shutdown(socket.SHUT_WR)  # our EOF reaches the server, then the server's reaches us
            wait_for(echo.eof_seen.is_set, what="the server to see EOF")
            assert c.recv(1) == b""
        wait_for(lambda: proxy.open_connections == 0, what="the proxy to drop the connection")
        assert proxy.stats.connections == 1
        assert proxy.stats.bytes_up == proxy.stats.bytes_down == len(payload)
    finally:
        proxy.close()


def test_every_chunk_waits_the_delay_after_its_arrival(echo):
    """With a clock that stands still, the writer's wait is exactly (arrival + delay) - now."""
    sleeps: list[float] = []
    proxy = DelayProxy(0.25, upstream=("127.0.0.1", echo.port), clock=lambda: 1000.0, sleep=sleeps.append).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            for i in range(5):
                c.sendall(b"x" * (i + 1))
                assert recv_exactly(c, i + 1) == b"x" * (i + 1)
        wait_for(lambda: proxy.open_connections == 0, what="the connection to close")
        # 5 chunks each way, plus the EOFs (the server's EOF can race our close: at least one)
        assert len(sleeps) >= 11
        assert set(sleeps) == {0.25}
    finally:
        proxy.close()


def test_zero_delay_never_sleeps(echo):
    sleeps: list[float] = []
    proxy = DelayProxy(0.0, upstream=("127.0.0.1", echo.port), sleep=sleeps.append).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            c.sendall(b"hello")
            assert recv_exactly(c, 5) == b"hello"
    finally:
        proxy.close()
    assert sleeps == []


def test_close_ends_open_connections_and_stops_listening(echo):
    proxy = DelayProxy(0.0, upstream=("127.0.0.1", echo.port)).start()
    c = socket.create_connection(("127.0.0.1", proxy.port))
    c.sendall(b"ping")
    assert recv_exactly(c, 4) == b"ping"
    proxy.close()
    c.settimeout(10)
    try:
        assert c.recv(1) == b""
    except ConnectionResetError:
        pass  # a reset is as clear an end as an EOF
    c.close()
    assert proxy.open_connections == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5)


def test_unreachable_upstream_closes_the_client():
    with refusing_port() as dead_port:
        proxy = DelayProxy(0.0, upstream=("127.0.0.1", dead_port)).start()
        try:
            with socket.create_connection(("127.0.0.1", proxy.port)) as c:
                c.settimeout(10)
                assert c.recv(1) == b""
            assert proxy.stats.connections == 0
        finally:
            proxy.close()


def test_grpc_channels_go_through_the_connect_proxy():
    from persia import rpc

    server, port = rpc.serve("persia.Test", {"Echo": lambda m: {"back": m}}, 0, host="127.0.0.1")
    proxies = ProxySet.start(0.0005, connect=True)
    try:
        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.http_proxy", f"http://127.0.0.1:{proxies.connect.port}")]
        )
        call = channel.unary_unary("/persia.Test/Echo", request_serializer=rpc._pack, response_deserializer=rpc._unpack)
        for i in range(3):
            assert call({"i": i}, timeout=10)["m"] == {"back": {"i": i}}
        stats = proxies.stats()["connect"]
        assert stats["connections"] == 1 and stats["bytes_up"] > 0 and stats["bytes_down"] > 0
        channel.close()
    finally:
        proxies.close()
        server.stop(None)


def test_connect_refuses_other_hosts_and_names_the_target():
    proxy = DelayProxy(0.0).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            c.sendall(b"CONNECT 10.1.2.3:80 HTTP/1.1\r\nHost: 10.1.2.3:80\r\n\r\n")
            c.settimeout(10)
            reply = b""
            while chunk := c.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 403")
        assert b"10.1.2.3:80" in reply
        assert proxy.stats.refused == 1
    finally:
        proxy.close()


def test_connect_request_parsing():
    assert parse_connect_request(b"CONNECT 127.0.0.1:5000 HTTP/1.1\r\nHost: x") == ("127.0.0.1", 5000)
    assert parse_connect_request(b"CONNECT localhost:1 HTTP/1.0") == ("localhost", 1)
    assert parse_connect_request(b"CONNECT [::1]:8080 HTTP/1.1") == ("::1", 8080)
    with pytest.raises(ValueError, match="GET"):
        parse_connect_request(b"GET / HTTP/1.1")
    with pytest.raises(ValueError, match="example.com:443"):
        parse_connect_request(b"CONNECT example.com:443 HTTP/1.1")
    with pytest.raises(ValueError, match="'127.0.0.1:99999'"):
        parse_connect_request(b"CONNECT 127.0.0.1:99999 HTTP/1.1")
    with pytest.raises(ValueError, match="--forward"):
        parse_hostport("nohost", "--forward")
    with pytest.raises(ValueError, match="delay_s"):
        DelayProxy(-1.0)


def test_latency_run_routes_grpc_through_the_proxy_and_fails_runs_that_bypass_it():
    env = launcher_env({"PATH": "/bin", "no_proxy": "127.0.0.1", "HTTPS_PROXY": "http://corp:3128", "PERSIA_NATS_TOKEN": "t"},
                       4321, {"PERSIA_NATS_USER": "u", "PERSIA_NATS_PASSWORD": "p"})
    # nothing may exempt loopback; our server's credentials replace the caller's
    assert env == {"PATH": "/bin", "grpc_proxy": "http://127.0.0.1:4321", "PERSIA_NATS_USER": "u", "PERSIA_NATS_PASSWORD": "p"}
    ok = {"connect": {"connections": 2}, "forward": {"127.0.0.1:4222": {"connections": 5}}}
    assert unproxied(ok, "127.0.0.1:4222") == []
    bad = {"connect": {"connections": 1}, "forward": {"127.0.0.1:4222": {"connections": 0}}}
    problems = unproxied(bad, "127.0.0.1:4222")
    assert "1 gRPC connection(s)" in problems[0] and "0 NATS connection(s)" in problems[1]


def test_the_latency_run_splits_the_cpus_as_its_launcher_command_will():
    local = ["persia-launcher", "local", "--nn-worker", "t.py", "--data-loader", "d.py", "--embedding-config", "e.yml"]
    split = launcher_split(local, {0, 1, 2})
    assert split is not None and split.training == (0,) and split.rest == {1, 2}
    assert launcher_split(local + ["--nproc-per-node", "2"], {0, 1, 2}).training == (0, 1)
    assert launcher_split(local + ["--cpu-placement", "off"], {0, 1, 2}) is None
    assert launcher_split(local + ["--nproc-per-node", "2"], {0, 1}) is None
