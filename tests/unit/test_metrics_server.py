"""The ``/metrics`` server on a real loopback socket: it serves the registry, closes a client
that stays silent, and answers 503 beyond its connection cap instead of starting a thread per
connection for ever (prometheus_client's own server waits on a silent client with no limit)."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from persia.metrics_server import serve_metrics
from tests.polling import poll_until


@pytest.fixture
def server():
    registry = CollectorRegistry()
    Counter("persia_probe", "a counter only this test's registry has", registry=registry).inc(3)
    srv = serve_metrics("127.0.0.1", 0, registry=registry, max_connections=2, timeout_s=0.5, deadline_s=2.0)
    yield srv
    srv.shutdown()
    srv.server_close()


def scrape(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_it_serves_the_registry(server):
    status, body = scrape(server.server_port)
    assert status == 200 and "persia_probe_total 3.0" in body


def test_a_silent_client_is_closed_after_the_timeout(server):
    idle = socket.create_connection(("127.0.0.1", server.server_port))
    idle.settimeout(10)
    t0 = time.monotonic()
    assert idle.recv(1) == b""  # the server hung up on it: end of stream, not our 10 s timeout
    assert time.monotonic() - t0 < 5
    idle.close()


def test_beyond_the_cap_a_connection_is_answered_503_and_the_slots_come_back(server):
    held = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(2)]
    # both slots are taken once the server accepted both (a poll, not a sleep)
    poll_until(lambda: server.connections == 2, what="both connections accepted")
    status, _ = scrape(server.server_port)
    assert status == 503 and server.refused == 1
    for s in held:
        s.close()
    # once the held connections end (closed by us, or the timeout), scrapes are served again
    poll_until(lambda: scrape(server.server_port)[0] == 200, what="a slot free again")


def test_a_client_sending_slowly_cannot_hold_a_thread_past_the_timeout_per_read(server):
    trickle = socket.create_connection(("127.0.0.1", server.server_port))
    trickle.sendall(b"GET /metr")  # then nothing more
    trickle.settimeout(10)
    t0 = time.monotonic()
    assert trickle.recv(1) == b""
    assert time.monotonic() - t0 < 5
    trickle.close()


def test_a_client_that_trickles_is_closed_at_the_connection_deadline(server):
    """A byte just inside each read timeout kept a slot for ever; the whole connection now has a
    deadline (2 s here, 30 s by default)."""
    slow = socket.create_connection(("127.0.0.1", server.server_port))
    slow.settimeout(0.2)
    t0 = time.monotonic()
    closed = False
    for ch in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 200:
        try:
            slow.sendall(bytes([ch]))
            if slow.recv(1) == b"":
                closed = True
                break
        except socket.timeout:  # nothing to read yet: the next byte, 0.2 s after the last
            continue
        except OSError:  # reset: closed too
            closed = True
            break
    assert closed and time.monotonic() - t0 < 10, "the trickling client was never cut"
    assert server.cut == 1
    slow.close()
    poll_until(lambda: server.connections == 0, what="its slot back")
