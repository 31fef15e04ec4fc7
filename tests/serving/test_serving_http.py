"""The model server's HTTP front on loopback, spoken to with raw sockets: message framing (a body
is never read as the next request, ambiguous framing is refused and the connection closed), probes
answered when every connection is taken, and the request clock starting at the request line.

The embedding worker address is unreachable: none of this needs a lookup to succeed.
"""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
import torch

from tests.polling import poll_until
from tests.serving.test_serving_limits import LimitsModel, body, metric, model_server

pytestmark = pytest.mark.integration

UNREACHABLE = ["127.0.0.1:1"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "jit_dense.pt"
    torch.jit.save(torch.jit.script(LimitsModel()), str(path))
    return path


class Raw:
    """One client connection: bytes out, whole HTTP/1.1 answers (by Content-Length) in."""

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> bool:
        try:
            chunk = self.sock.recv(1 << 16)
        except ConnectionResetError:
            chunk = b""
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict, bytes]:
        """The next answer: (status, lower-cased headers, body); fails at EOF before it."""
        while b"\r\n\r\n" not in self.buf:
            assert self._more(), f"the server closed the connection before answering (got {self.buf[:200]!r})"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            assert self._more(), "the server closed the connection mid-answer"
        data, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split()[1]), headers, data

    def closed(self) -> bool:
        """Whether the server closes the connection with nothing more sent (a TimeoutError if it
        keeps it open for the socket's timeout)."""
        while not self.buf:
            if not self._more():
                return True
        return False

    def close(self) -> None:
        self.sock.close()


def predict_request(data: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra +
            b"Content-Length: %d\r\n\r\n" % len(data) + data)


# a whole request, as the body of another: parsed as the next request, it would be answered 400
SMUGGLED = b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@pytest.mark.parametrize("head", [b"POST /nowhere HTTP/1.1\r\n", b"GET /live HTTP/1.1\r\n", b"GET /nowhere HTTP/1.1\r\n"])
def test_a_body_the_server_does_not_take_is_never_parsed_as_the_next_request(model_file, head):
    """A 404 POST and a GET with a body were answered without reading the body, which the kept-alive
    connection then parsed as the next request (request smuggling behind a proxy)."""
    with model_server(UNREACHABLE, model_file) as server:
        c = Raw(server.http_port)
        try:
            c.send(head + b"Host: x\r\nContent-Length: %d\r\n\r\n" % len(SMUGGLED) + SMUGGLED)
            status, _, _ = c.response()
            assert status == (200 if b"/live" in head else 404)
            c.send(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")  # the next request on the same connection
            status, _, data = c.response()
            assert status == 200 and json.loads(data)["status"] == "ok", data
        finally:
            c.close()
        c = Raw(server.http_port)  # a body too large to read and drop: answered, then the connection closes
        try:
            big = b"x" * (1 << 20)
            c.send(b"GET /live HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
            status, headers, _ = c.response()
            assert status == 200 and headers.get("connection") == "close"
            assert c.closed()
        finally:
            c.close()
        assert metric(server, "persia_serving_errors_total") == 0.0  # the smuggled request never ran


@pytest.mark.parametrize("framing, field", [
    (b"Content-Length: %d\r\nContent-Length: 5\r\n", "Content-Length"),  # the first one won
    (b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n", "Transfer-Encoding"),  # chunked was ignored
    (b"Transfer-Encoding: chunked\r\n", "Transfer-Encoding"),
    (b"Content-Length: %d\r\nTransfer-Encoding : chunked\r\n", "headers"),  # space before the colon: skipped
])
def test_ambiguous_framing_is_answered_400_and_the_connection_closed(model_file, framing, field):
    """RFC 9112 section 6.3: framing a proxy in front may read differently is refused, and the
    connection closed, so nothing after it can be taken for a request."""
    data = json.dumps(body([[1.0, 0.0]])).encode() + SMUGGLED
    with model_server(UNREACHABLE, model_file) as server:
        c = Raw(server.http_port)
        try:
            head = b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            c.send(head + (framing % len(data) if b"%d" in framing else framing) + b"\r\n" + data)
            status, headers, answer = c.response()
            assert status == 400, answer
            assert json.loads(answer)["kind"] == "bad_request" and json.loads(answer)["field"] == field, answer
            assert headers.get("connection") == "close"
            assert c.closed(), f"a second answer on the connection: {c.buf[:200]!r}"
        finally:
            c.close()
        assert metric(server, "persia_serving_errors_total") == 1.0


def test_probes_are_answered_when_every_connection_is_taken(model_file):
    """With ``max_connections`` connections held (a busy keep-alive pool, or a slowloris), /live,
    /ready and /metrics were answered 503 (overloaded) like any other request: the kubelet's
    liveness probe then restarted the pod. They are answered; anything else is still 503."""
    with model_server(UNREACHABLE, model_file, max_connections=2, http_timeout_s=30) as server:
        held = [Raw(server.http_port) for _ in range(2)]
        for c in held:  # kept-alive pool connections, idle between requests
            c.send(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.response()[0] == 200
        silent = []
        try:
            poll_until(lambda: metric(server, "persia_serving_http_connections") == 2, "two connections open")
            silent = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(300)]  # a flood
            for path in ("/live", "/ready", "/metrics"):
                c = Raw(server.http_port)
                try:
                    c.send(b"GET %s HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.30\r\n\r\n" % path.encode())
                    status, _, data = c.response()
                    if path == "/live":
                        assert status == 200 and json.loads(data) == {"status": "ok", "reason": "live"}
                    elif path == "/ready":  # the real readiness (the embedding worker is unreachable)
                        assert status == 503 and "embedding worker" in json.loads(data)["reason"], data
                    else:
                        assert status == 200 and b"persia_serving_http_connections" in data
                    assert c.closed()
                finally:
                    c.close()
            c = Raw(server.http_port)  # a prediction over the limit: still refused
            try:
                c.send(predict_request(json.dumps(body([[1.0, 0.0]])).encode()))
                status, _, data = c.response()
                assert status == 503 and json.loads(data)["kind"] == "overloaded", data
                assert c.closed()
            finally:
                c.close()
        finally:
            for s in silent:
                s.close()
            for c in held:
                c.close()


def test_the_request_clock_starts_at_the_request_line(model_file):
    """The latency metric and ``request_timeout_s`` left out reading and parsing the body: a
    client that took 1 s to send it was measured from the parse on, and never timed out."""
    with model_server(UNREACHABLE, model_file, request_timeout_s=0.5, http_timeout_s=10) as server:
        c = Raw(server.http_port)
        try:
            request = predict_request(json.dumps(body([[1.0, 0.0]])).encode())
            head, data = request.split(b"\r\n\r\n", 1)
            c.send(head + b"\r\n\r\n" + data[:5])
            time.sleep(1.0)  # the slow client itself, not a synchronisation
            c.send(data[5:])
            status, _, answer = c.response()
            assert status == 504 and json.loads(answer)["kind"] == "timeout", answer
        finally:
            c.close()
        text = server.metrics.render().decode()
        latency = float(re.search(r'^persia_serving_request_latency_seconds_sum\{[^}]*protocol="http"[^}]*\} (\S+)$',
                                  text, re.MULTILINE).group(1))
        # the client's 1 s pause, less the moments between its send and the server's read of the
        # request line (0.99993 s was seen under load); measured from the parse it was about 0.5 s
        assert latency >= 0.9, text


def test_request_bodies_held_at_once_are_bounded_in_bytes(model_file):
    """Each connection could hold a body of max_request_bytes, 256 of them 16 GiB: a body is now
    read only once its bytes fit --max-bytes-in-flight; one that finds no room within a
    second is answered 503 before it is read, and the bytes come back once the first is done."""
    with model_server(UNREACHABLE, model_file, max_request_bytes=4096, max_bytes_in_flight=4096,
                      http_timeout_s=5.0) as server:  # the first body may take 5 s; the second waits 1 s
        port = server.http_port
        holder = Raw(port)
        holder.send(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 4000\r\n\r\n" + b"{")  # its 4000 bytes reserved, one arrived
        poll_until(lambda: server.body_budget.held == 4000, what="the first body's bytes reserved")
        second = Raw(port)
        second.send(predict_request(json.dumps(body([[1.0, 0.0]])).encode()))
        status, _, answer = second.response()
        assert status == 503 and json.loads(answer)["kind"] == "overloaded", answer
        assert b"max-bytes-in-flight" in answer
        holder.close()  # its body never comes: read times out, and its bytes are released
        poll_until(lambda: server.body_budget.held == 0, what="the first body's bytes released")
        third = Raw(port)
        third.send(predict_request(json.dumps(body([[1.0, 0.0]])).encode()))
        status, _, answer = third.response()
        assert status != 503 or json.loads(answer)["kind"] != "overloaded", answer
        for c in (second, third):
            c.close()


def test_a_byte_budget_smaller_than_the_largest_request_is_refused():
    from pydantic import ValidationError

    from persia.serving.config import ServeConfig

    with pytest.raises(ValidationError, match="max_bytes_in_flight .* must be at least max_request_bytes"):
        ServeConfig(embedding_workers=UNREACHABLE, model="m.pt", max_request_bytes=8192, max_bytes_in_flight=4096)
