"""The operator's API client logging in again while other calls run: a rotated token answers 401,
the client logs in once and tries again, and the calls already running on the old session finish
on it (closing it under them failed them).

Against a small aiohttp server that checks a bearer token. What it cannot check: a real API
server's token review, client-certificate rotation (a new TLS context is a new session too, made
the same way)."""

from __future__ import annotations

import asyncio
import collections

import kopf
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from persia_operator import kube
from persia_operator.kube import ApiError, KubeApi

SLOW, FAST = 4, 4


class RotatingApiServer:
    """Accepts one token at a time. A call authenticated before the token rotates is answered
    (held until ``release``, so that it is in flight while the client logs in again); a call
    with the old token after the rotation is a 401."""

    def __init__(self) -> None:
        self.token = "old"
        self.arrivals: collections.Counter[str] = collections.Counter()
        self.held = 0
        self.all_held = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.arrivals[name] += 1
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized",
                                      "message": "token expired"}, status=401)  # fmt: skip
        if name.startswith("slow"):
            self.held += 1
            if self.held == SLOW:
                self.all_held.set()
            await self.release.wait()
        return web.json_response({"metadata": {"name": name}})


@pytest.mark.parametrize("rotation", ["401", "kopf login handler"])
async def test_calls_in_flight_survive_a_relogin(monkeypatch, rotation):
    # A call that failed because its session was closed must show, not be hidden by a retry.
    monkeypatch.setattr(kube, "RETRY_DELAYS_S", ())
    server = RotatingApiServer()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns1/configmaps/{name}", server.handle)
    http = TestServer(app)
    await http.start_server()
    url = str(http.make_url("")).rstrip("/")
    logins: list[str] = []

    def login() -> kopf.ConnectionInfo:
        logins.append(server.token)
        return kopf.ConnectionInfo(server=url, token=server.token)

    api = KubeApi(login=login)
    try:
        slow = [asyncio.create_task(api.get("ConfigMap", "ns1", f"slow-{i}")) for i in range(SLOW)]
        await asyncio.wait_for(server.all_held.wait(), 10)  # authenticated with "old", in flight
        server.token = "new"
        if rotation != "401":
            api.set_connection(login())  # as kopf's login handler does after its own re-login
        fast = await asyncio.wait_for(
            asyncio.gather(*(api.get("ConfigMap", "ns1", f"fast-{i}") for i in range(FAST)), return_exceptions=True),
            10)  # fmt: skip
        server.release.set()
        held = await asyncio.wait_for(asyncio.gather(*slow, return_exceptions=True), 10)
    finally:
        server.release.set()
        await api.close()
        await http.close()

    failures = [r for r in [*fast, *held] if isinstance(r, ApiError)]
    assert failures == [], failures
    assert [r["metadata"]["name"] for r in held] == [f"slow-{i}" for i in range(SLOW)]
    assert [r["metadata"]["name"] for r in fast] == [f"fast-{i}" for i in range(FAST)]
    assert logins == ["old", "new"]  # concurrent 401s of one rotated token: one login
    assert all(server.arrivals[f"slow-{i}"] == 1 for i in range(SLOW))  # answered on the old session
    expected_fast = 2 if rotation == "401" else 1  # a 401, then the new token
    assert all(server.arrivals[f"fast-{i}"] == expected_fast for i in range(FAST)), server.arrivals

