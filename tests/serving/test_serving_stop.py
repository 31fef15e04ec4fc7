"""``persia-launcher serve`` as a real process: its listen backlog holds a burst of connections, and
SIGTERM (a rolling update) drains it: /ready fails at once, requests are still served for
``--drain-seconds``, requests in flight finish, later ones are answered 503, and it exits 0.

The embedding stack is an inference PS started empty and an embedding worker, in this process.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager

import pytest

from persia.procs import spawn
from tests.polling import poll_until
from tests.serving.test_serving_http import Raw, predict_request
from tests.serving.test_serving_limits import body, model_file, worker_address  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

PREDICT = predict_request(json.dumps(body([[1.0, 0.0]])).encode())


@contextmanager
def serve_process(model, worker: str, *flags: str, env: dict | None = None):
    """(process, HTTP port, its output lines so far) of ``persia-launcher serve``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PERSIA_")}
    environ.update(PERSIA_BIND_ADDRESS="127.0.0.1", **(env or {}))
    proc = spawn([sys.executable, "-m", "persia.launcher", "serve", "--model", str(model), "--embedding-worker",
                  worker, "--http-port", "0", "--grpc-port", "-1", *flags],
                 env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        port: list[int] = []

        def started() -> bool:
            assert proc.poll() is None, f"the model server exited {proc.returncode}: {''.join(lines)}"
            port[:] = [int(line.split()[3].rsplit(":", 1)[1]) for line in lines if line.startswith("model server: HTTP")]
            return bool(port)

        poll_until(started, "the model server printed its HTTP port", deadline_s=120)
        yield proc, port[0], lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(30)
        reader.join(10)


def get(port: int, path: str) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_the_stop_budget_fits_the_grace_period():
    from persia.serving.cli import stop_budget

    assert stop_budget(5.0, 30.0) == (5.0, 29.0)
    assert stop_budget(30.0, 10.0) == (4.5, 9.0)  # the drain leaves half of it to requests in flight
    assert stop_budget(5.0, 0.0) == (0.0, 0.0)


def test_the_listen_backlog_holds_a_burst_of_connections(model_file):
    """socketserver's listen backlog of 5: while the server was busy, the SYNs of a burst of
    clients beyond it were dropped, and those clients waited 1 s, 3 s, 7 s ... to connect."""
    with serve_process(model_file, "127.0.0.1:1") as (proc, port, _):
        poll_until(lambda: get(port, "/live")[0] == 200, "the model server answers /live")
        proc.send_signal(signal.SIGSTOP)  # it accepts nothing: the kernel's backlog holds the burst
        socks = []
        try:
            for _ in range(100):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                socks.append(s)
            poll = select.poll()
            for s in socks:
                poll.register(s, select.POLLOUT)
            connected: set[int] = set()

            def all_connected() -> bool:
                connected.update(fd for fd, ev in poll.poll(0) if ev & select.POLLOUT)
                return len(connected) == len(socks)

            poll_until(all_connected, "100 connections completed while the server was busy", deadline_s=10)
            proc.send_signal(signal.SIGCONT)
            for s in socks:  # and each is served once the server runs
                s.setblocking(True)
                s.settimeout(30)
                s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            for s in socks:
                assert s.recv(4096).startswith(b"HTTP/1.1 200"), "a connection from the burst was not served"
        finally:
            proc.send_signal(signal.SIGCONT)
            for s in socks:
                s.close()


def test_sigterm_drains_the_server_then_exits_0(model_file, worker_address):
    """Under load, SIGTERM answered queued requests 500 ("the model server is stopping"), reset
    connections and exited within a second: a rolling update lost traffic."""
    drain = 4.0
    with serve_process(model_file, worker_address, env={"PERSIA_SERVE_DRAIN_SECONDS": str(drain),
                                                        "PERSIA_GRACE_PERIOD_SECONDS": "60"}) as (proc, port, lines):
        poll_until(lambda: get(port, "/ready")[0] == 200, "the model server is ready", deadline_s=60)
        kept = Raw(port)  # a kept-alive connection, idle when the server stops
        kept.send(PREDICT)
        status, headers, _ = kept.response()
        assert status == 200 and headers.get("connection") != "close"
        slow = Raw(port, timeout=30)  # a request in flight when the drain ends: its body is late
        head, data = PREDICT.split(b"\r\n\r\n", 1)
        slow.send(head + b"\r\n\r\n" + data[:3])

        statuses: Counter = Counter()
        errors: Counter = Counter()
        signalled = threading.Event()
        after: Counter = Counter()

        def load() -> None:  # a client pool: keep-alive connections, reconnecting when one closes
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            while True:
                try:
                    c.request("POST", "/v1/predict", PREDICT.split(b"\r\n\r\n", 1)[1],
                              {"Content-Type": "application/json"})
                    r = c.getresponse()
                    r.read()
                except ConnectionRefusedError:  # the listener is closed: the drain is over
                    return
                except OSError as exc:
                    errors[type(exc).__name__] += 1
                    c.close()
                    continue
                except http.client.HTTPException as exc:  # RemoteDisconnected: a connection dropped
                    errors[type(exc).__name__] += 1
                    c.close()
                    continue
                statuses[r.status] += 1
                if signalled.is_set():
                    after[r.status] += 1
                if r.status == 503:  # "retry on another replica": a client with one goes there
                    return

        clients = [threading.Thread(target=load) for _ in range(3)]
        for t in clients:
            t.start()
        poll_until(lambda: statuses[200] >= 3, "the load is served")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        signalled.set()
        poll_until(lambda: get(port, "/ready") == (503, {"status": "unavailable", "reason": "stopping"}),
                   "/ready fails once the server is stopping")
        fresh = Raw(port)  # the drain: still served, but the connection is not kept
        fresh.send(PREDICT)
        status, headers, _ = fresh.response()
        assert status == 200 and headers.get("connection") == "close"
        assert fresh.closed()
        unused = Raw(port)  # opened during the drain; its request comes after it
        poll_until(lambda: refused(port), "the listener closes at the end of the drain", deadline_s=30)
        assert time.monotonic() - t0 >= drain - 0.5, "the drain was cut short"
        unused.send(PREDICT)
        status, headers, answer = unused.response()
        assert status == 503 and json.loads(answer)["kind"] == "unavailable", answer
        assert "stopping" in json.loads(answer)["error"] and headers.get("connection") == "close"
        assert kept.closed(), "the idle kept-alive connection was not closed"
        slow.send(data[3:])  # the request in flight finishes
        status, _, answer = slow.response()
        assert status == 200 and len(json.loads(answer)["predictions"]) == 1, answer
        assert proc.wait(30) == 0, "".join(lines)
        for t in clients:
            t.join(30)
        assert set(statuses) <= {200, 503} and after[200] >= 1, (statuses, after)
        assert not errors, errors  # no reset, no dropped connection
        out = "".join(lines)
        assert "Traceback" not in out and "prediction failed" not in out, out
        for c in (kept, slow, fresh, unused):
            c.close()
