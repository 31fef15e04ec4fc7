"""A small async Kubernetes client for the few calls the operator makes itself.

It rides on the credentials kopf logged in with (a `kopf.ConnectionInfo`), so one login
serves kopf's watches and the operator's writes, in-cluster or from a kubeconfig.
Writes are create (POST) and JSON merge-patch, which every API server understands.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

from . import constants as C

log = logging.getLogger(__name__)

# kind -> (group, version, plural) of everything the operator reads or writes.
RESOURCES: dict[str, tuple[str, str, str]] = {
    "ConfigMap": ("", "v1", "configmaps"),
    "Service": ("", "v1", "services"),
    "Pod": ("", "v1", "pods"),
    "StatefulSet": ("apps", "v1", "statefulsets"),
    "Deployment": ("apps", "v1", "deployments"),
    "Job": ("batch", "v1", "jobs"),
    "Secret": ("", "v1", "secrets"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "Lease": ("coordination.k8s.io", "v1", "leases"),
    "Event": ("", "v1", "events"),
    C.KIND: (C.GROUP, C.VERSION, C.PLURAL),
}
# PodGroups of the two gang schedulers share a kind: their apiVersion tells them apart.
POD_GROUP_APIS = {
    "scheduling.volcano.sh/v1beta1": ("scheduling.volcano.sh", "v1beta1", "podgroups"),
    "scheduling.x-k8s.io/v1alpha1": ("scheduling.x-k8s.io", "v1alpha1", "podgroups"),
}


class ApiError(Exception):
    """A failed API call; `code` is the HTTP status (None for a network failure)."""

    def __init__(self, code: int | None, reason: str, message: str, retry_after_s: float | None = None):
        self.code = code
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s  # a 429's Retry-After
        super().__init__(f"{code} {reason}: {message}")


RETRY_DELAYS_S = (0.2, 1.0)  # two retries of a call that failed transiently
MAX_RETRY_AFTER_S = 5.0  # a throttling API server's Retry-After, honoured up to this
_TRANSIENT = (429, 500, 502, 503, 504)


def retry_delay(err: ApiError, attempt: int, jitter: float = 1.0) -> float | None:
    """How long to wait before trying a failed call again (``attempt`` retries done so far), or
    None: not again. Transient: a network failure (not a timeout: a second one would double a stall
    that holds the job's pass), throttling (its Retry-After, capped) and the server's 5xx. Creates
    are retried too: one that went through before its answer was lost is a 409, which the
    reconciler checks against the job's uid."""
    if attempt >= len(RETRY_DELAYS_S) or err.reason in ("NotLoggedIn", "Timeout"):
        return None
    if err.code is not None and err.code not in _TRANSIENT:
        return None
    delay = RETRY_DELAYS_S[attempt] * jitter
    if err.code == 429 and err.retry_after_s is not None:
        delay = max(delay, min(err.retry_after_s, MAX_RETRY_AFTER_S))
    return delay


def resource_path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None,
                  api_version: str | None = None) -> str:  # fmt: skip
    group, version, plural = POD_GROUP_APIS[api_version or ""] if kind == "PodGroup" else RESOURCES[kind]
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    path = f"{base}/namespaces/{quote(namespace)}/{plural}"
    if name is not None:
        path += f"/{quote(name)}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def _seconds(header: str | None) -> float | None:
    """A Retry-After header's seconds (the API server sends an integer), None otherwise."""
    try:
        value = float(header) if header is not None else None
    except ValueError:
        return None
    return value if value is not None and 0 <= value < 86_400 else None


@dataclass(eq=False)
class _Conn:
    """A session made for one set of credentials, and the calls running on it. Replaced by newer
    credentials, it is closed once its last call is done: closing it under a running call failed
    that call (a re-login after a 401 closed the session every other call of the pass was using)."""

    info: kopf.ConnectionInfo
    session: aiohttp.ClientSession
    calls: int = 0
    retired: bool = False


@dataclass(frozen=True)
class _Answer:
    status: int
    reason: str
    text: str
    retry_after_s: float | None
    info: kopf.ConnectionInfo  # the credentials the call was made with


class KubeApi:
    """Create, get, merge-patch and delete namespaced objects."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo | None] | None = None, request_timeout: float = 30):
        self._login = login
        self._info: kopf.ConnectionInfo | None = None
        self._conn: _Conn | None = None
        self._retired: set[_Conn] = set()  # replaced, still running calls
        self._login_lock = asyncio.Lock()  # one re-login at a time
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)

    def set_connection(self, info: kopf.ConnectionInfo) -> None:
        """Use new credentials (called from the kopf login handler, maybe in another thread): the
        next call gets a session of its own, and the old one closes once its calls are done."""
        self._info = info

    async def close(self) -> None:
        conns = [*self._retired, *([self._conn] if self._conn is not None else [])]
        self._retired.clear()
        self._conn = None
        for conn in conns:
            await conn.session.close()

    async def _relogin(self, refused: kopf.ConnectionInfo | None) -> bool:
        """Log in again after ``refused`` credentials (None: none yet); whether there are newer
        ones to try. One login at a time, and none when another call (or kopf's login handler)
        has replaced them meanwhile: concurrent 401s of one rotated token make one login."""
        async with self._login_lock:
            if self._info is not refused:
                return self._info is not None
            info = await asyncio.to_thread(self._login) if self._login is not None else None
            if info is None:
                return False
            self._info = info
            return True

    async def _acquire(self) -> _Conn:
        """The session of the current credentials, held until :meth:`_release`. The swap to a new
        session happens before any await, so concurrent calls never see a half-made one."""
        if self._info is None:
            await self._relogin(None)
        info = self._info
        if info is None:
            raise ApiError(None, "NotLoggedIn", "no Kubernetes credentials yet")
        conn = self._conn
        if conn is None or conn.info is not info or conn.session.closed:
            ssl = info.as_ssl_context() if info.server.startswith("https") else False
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl),
                headers={**info.as_http_headers(), "User-Agent": C.FIELD_MANAGER},
                timeout=self._timeout,
            )
            self._conn = _Conn(info, session)
            if conn is not None:
                conn.retired = True
                self._retired.add(conn)
                if conn.calls == 0:
                    await self._release(conn, held=False)
            conn = self._conn
        conn.calls += 1
        return conn

    async def _release(self, conn: _Conn, held: bool = True) -> None:
        if held:
            conn.calls -= 1
        if conn.retired and conn.calls == 0 and conn in self._retired:
            self._retired.discard(conn)
            await conn.session.close()

    async def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                       params: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """One call, tried again after a transient failure (:func:`retry_delay`): a connection
        the server closed, a throttled or restarting API server ended the whole pass before, and a
        create refused so turned the job's Created condition False."""
        attempt = 0
        while True:
            try:
                return await self._request_once(method, path, body, content_type, params)
            except ApiError as err:
                delay = retry_delay(err, attempt, jitter=random.uniform(0.8, 1.2))
                if delay is None:
                    raise
                log.info(f"{method} {path} failed ({err}); trying again in {delay:.1f}s")
                await asyncio.sleep(delay)
                attempt += 1

    async def _request_once(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                            params: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """One call; on a 401 (token rotated) once more with the credentials of a new login."""
        answer = await self._exchange(method, path, body, content_type, params)
        if answer.status == 401 and self._login is not None and await self._relogin(answer.info):
            answer = await self._exchange(method, path, body, content_type, params)
        if answer.status >= 400:
            try:
                status = json.loads(answer.text)
                raise ApiError(answer.status, status.get("reason", ""), status.get("message", answer.text),
                               answer.retry_after_s)  # fmt: skip
            except (ValueError, AttributeError):
                raise ApiError(answer.status, answer.reason, answer.text[:500], answer.retry_after_s) from None
        return json.loads(answer.text) if answer.text else {}

    async def _exchange(self, method: str, path: str, body: Any, content_type: str,
                        params: dict[str, str] | None) -> _Answer:  # fmt: skip
        """The HTTP exchange on a held session; network failures become ApiError."""
        conn = await self._acquire()
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            url = conn.info.server.rstrip("/") + path
            async with conn.session.request(method, url, data=data, headers=headers, params=params) as resp:
                text = await resp.text()
                return _Answer(resp.status, resp.reason or "", text, _seconds(resp.headers.get("Retry-After")),
                               conn.info)  # fmt: skip
        except aiohttp.ClientError as err:
            raise ApiError(None, type(err).__name__, str(err)) from err
        except TimeoutError as err:
            raise ApiError(None, "Timeout", f"{method} {path} timed out") from err
        finally:
            await self._release(conn)

    async def get(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> dict[str, Any] | None:
        try:
            return await self._request("GET", resource_path(kind, namespace, name, api_version=api_version))
        except ApiError as err:
            if err.code == 404:
                return None
            raise

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        params = {"fieldManager": C.FIELD_MANAGER}
        path = resource_path(manifest["kind"], meta["namespace"], api_version=manifest.get("apiVersion"))
        return await self._request("POST", path, manifest, params=params)

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None, api_version: str | None = None) -> dict[str, Any]:  # fmt: skip
        params = {"fieldManager": C.FIELD_MANAGER}
        path = resource_path(kind, namespace, name, subresource, api_version=api_version)
        return await self._request("PATCH", path, patch, content_type="application/merge-patch+json", params=params)

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> bool:
        """Delete with background propagation; False when it was already gone. ``uid``: only that
        object, not another created since under the same name (the API server answers 409)."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self._request("DELETE", resource_path(kind, namespace, name), body)
            return True
        except ApiError as err:
            if err.code == 404:
                return False
            raise
