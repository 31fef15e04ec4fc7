"""NATS request/reply for discovery, control and batch dispatch, behind a synchronous facade.

User scripts (data loaders, NN workers) are synchronous, nats-py is asyncio: every process owns one
:class:`NatsBus` whose event loop runs in a daemon thread. Payloads go through
:mod:`persia.wire.codec` (never pickle). Replies are ``{"ok": value}``, ``{"busy": True}`` or
``{"error": message, "kind": name}``, so a full buffer (back-pressure) is distinguishable from a
failure and from a missing responder.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Awaitable, Callable

import nats
import nats.errors

from persia.errors import INPUT_ERRORS, BusyError, RemoteError
from persia.security import (
    SIGNATURE_HEADER, NatsAuth, SignatureChecker, Unauthorized, job_secret, needs_signature, redact_url, ref_key,
    sign, with_tls_scheme,
)
from persia.wire.codec import decode, encode

log = logging.getLogger(__name__)

DEFAULT_NATS_URL = "nats://persia_nats_service:4222"
BUSY_MAX_BACKOFF = 0.02
DRAIN_TIMEOUT_S = 10.0  # how long unsubscribe(drain=True) lets received messages be answered
WAITING_REPORT_S = 30.0
# a request retried this long (a peer not up yet, or busy) says so in the log, then every
# WAITING_REPORT_S, so a role waiting out a 600 s discovery deadline is never silent
WAITING_FIRST_REPORT_S = 10.0
BUSY = object()
"""Return this from a handler to answer "busy, retry later"."""
WOULD_BLOCK = object()
"""Return this from a ``serve(..., try_first=)`` handler: the blocking handler takes the message."""


def nats_url() -> str:
    return os.environ.get("PERSIA_NATS_URL", DEFAULT_NATS_URL)


def job_name() -> str:
    return checked_job_name(os.environ.get("PERSIA_JOB_NAME", "persia"))


def subject_job() -> str:
    """The job's token in NATS subjects: ``PERSIA_JOB_NAME``, or ``<namespace>_<job>`` where
    ``PERSIA_JOB_NAMESPACE`` is set (the operator sets it: a job name is unique only in its
    namespace, and two jobs of one name in two namespaces on one NATS, an external one, answered
    each other's discovery and took each other's batches). ``_`` is in no Kubernetes name."""
    namespace = os.environ.get("PERSIA_JOB_NAMESPACE")
    if not namespace:
        return job_name()
    return f"{checked_job_name(namespace, 'environment variable PERSIA_JOB_NAMESPACE')}_{job_name()}"


@functools.lru_cache(maxsize=16)
def checked_job_name(name: str, what: str = "environment variable PERSIA_JOB_NAME") -> str:
    """``name`` if it can be one token of a NATS subject (``persia.<job>.<service>...``); else a
    ValueError naming ``what`` and the value. A space, ``.``, ``*`` or ``>`` in it failed every role
    at its first subject with ``nats: invalid subject``, after the job's restarts."""
    if not name or any(c.isspace() or c in ".*>" for c in name):
        raise ValueError(f"{what} must be a non-empty name without spaces, '.', '*' or '>' (it is a NATS "
                         f"subject token), got {name!r}")
    return name


def subject(service: str, method: str, replica: int | None = None, job: str | None = None) -> str:
    """``persia.<job>.<service>.<method>[.<replica>]`` (design §2; ``<job>``: :func:`subject_job`)."""
    base = f"persia.{job or subject_job()}.{service}.{method}"
    return base if replica is None else f"{base}.{replica}"


_CONNECTION_ERRORS = (OSError, nats.errors.UnexpectedEOF, nats.errors.StaleConnectionError)


class _Outage:
    """One warning when the connection drops and one when it is back, whatever happens between:
    nats-py's default error callback logs a traceback at every reconnect attempt (twice a second
    for as long as the server is away)."""

    def __init__(self, url: str, name: str):
        self.url, self.name = url, name
        self.since: float | None = None
        self.errors = 0
        self.closing = False  # our own close() disconnects too; that is no outage
        self.connected = False  # before the first connection, errors mean "not reachable yet"
        self.last_report: float | None = None

    async def on_disconnected(self) -> None:
        if self.since is None and not self.closing:
            self.since = time.monotonic()
            self.errors = 0
            log.warning("%s: lost the NATS connection to %s; reconnecting", self.name, self.url)

    async def on_reconnected(self) -> None:
        if self.since is not None:
            log.warning("%s: NATS connection to %s is back after %.1fs (%d failed attempts)",
                        self.name, self.url, time.monotonic() - self.since, self.errors)
        self.since = None

    async def on_error(self, exc: Exception) -> None:
        if not self.connected:
            # not connected yet (NATS starting, a wrong URL): keep trying, and say so every 30 s
            self.errors += 1
            now = time.monotonic()
            if self.last_report is None or now - self.last_report >= WAITING_REPORT_S:
                self.last_report = now
                log.warning("%s: cannot reach NATS at %s yet (%s: %s); still trying (%d attempts)",
                            self.name, self.url, type(exc).__name__, exc, self.errors)
            return
        if self.since is not None or isinstance(exc, _CONNECTION_ERRORS):
            # expected while reconnecting (and as the first sign of an outage): counted and
            # reported once when the connection is back
            self.errors += 1
            return
        log.warning("%s: NATS error: %s: %s", self.name, type(exc).__name__, exc)


class NatsBus:
    """One NATS connection and its event loop thread, usable from any thread."""

    def __init__(self, url: str | None = None, name: str = "persia", executor_workers: int = 8,
                 auth: NatsAuth | None = None, secret: bytes | None = None):
        self.url = url or nats_url()
        self.auth = NatsAuth.from_env() if auth is None else auth
        # Controls that destroy state or end training are signed with the job's secret, and only
        # accepted signed, when one is set (several jobs on one NATS): persia.security.
        self._secret = job_secret() if secret is None else secret
        self._checker = SignatureChecker(self._secret) if self._secret else None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"nats-{name}", daemon=True)
        self._thread.start()
        self._executor = ThreadPoolExecutor(max_workers=executor_workers, thread_name_prefix=f"bus-{name}")
        self._subs: list[Any] = []
        try:
            self.nc = self.run(self._connect(name))
        except BaseException:  # refused or interrupted: no loop thread and pool left behind per try
            self._stop_loop()
            raise

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _connect(self, name: str):
        servers = with_tls_scheme([u if "://" in u else f"nats://{u}" for u in self.url.split(",")], self.auth)
        # our callbacks: one warning per outage, and never the URL's credentials
        outage = self._outage = _Outage(redact_url(self.url), name)
        refused: asyncio.Future = self._loop.create_future()

        async def on_error(exc: Exception) -> None:
            permanent = "authorization" in str(exc).lower() or isinstance(exc, ssl.SSLError)
            if not outage.connected and permanent and not refused.done():
                refused.set_result(exc)  # wrong credentials or certificates: fail now, do not retry forever
            await outage.on_error(exc)

        connect = asyncio.ensure_future(nats.connect(
            servers,
            name=name,
            max_reconnect_attempts=-1,  # wait for a NATS that is not up yet (pods start in any order)
            reconnect_time_wait=0.5,
            connect_timeout=5,
            allow_reconnect=True,
            error_cb=on_error,
            disconnected_cb=outage.on_disconnected,
            reconnected_cb=outage.on_reconnected,
            **self.auth.connect_kwargs(),
        ))
        await asyncio.wait([connect, refused], return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():
            connect.cancel()
            raise ConnectionError(f"NATS at {redact_url(self.url)} refused this client's credentials or TLS "
                                  f"({type(refused.result()).__name__}: {refused.result()}); "
                                  "see PERSIA_NATS_* in docs/security.md")
        try:
            nc = connect.result()
        except Exception as exc:
            raise ConnectionError(f"cannot connect to NATS at {redact_url(self.url)}: {type(exc).__name__}: {exc}") from None
        outage.connected = True
        return nc

    # -- plumbing ---------------------------------------------------------------------------------
    def run(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        """Run a coroutine on the bus loop from a foreign thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload)

    @property
    def ref_key(self) -> bytes | None:
        """The key of this job's batch refs (``persia.security.batch_ref``), derived from the job
        secret this bus signs with; None without one."""
        return ref_key(self._secret)

    # -- client side ------------------------------------------------------------------------------
    async def arequest(self, subj: str, obj: Any, timeout: float = 10.0) -> Any:
        payload = encode(obj)
        if len(payload) > self.nc.max_payload:
            raise RemoteError(
                subj,
                f"payload of {len(payload)} bytes exceeds the NATS server's max_payload "
                f"{self.nc.max_payload}; raise max_payload (<= 64 MiB) or send smaller batches",
                kind="payload",
            )
        msg = await self.nc.request(subj, payload, timeout=timeout, headers=self._headers(subj, payload))
        reply = decode(msg.data)
        if "ok" in reply:
            return reply["ok"]
        if reply.get("busy"):
            raise BusyError(subj)
        raise RemoteError(subj, reply.get("error", "unknown error"), reply.get("kind", "error"))

    def request(self, subj: str, obj: Any = None, timeout: float = 10.0) -> Any:
        """One request; raises BusyError, RemoteError, or nats' TimeoutError/NoRespondersError."""
        return self.run(self.arequest(subj, obj, timeout), timeout + 5.0)

    def request_retry(self, subj: str, obj: Any = None, **retry: Any) -> Any:
        """Request with bounded exponential backoff on busy / no responder / timeout
        (:meth:`arequest_retry`'s arguments). ``RemoteError`` (a real failure answered by the peer)
        is never retried."""
        return self.run(self.arequest_retry(subj, obj, **retry))

    def request_retry_all(self, *calls: tuple[str, Any, dict]) -> list[Any]:
        """``(subject, payload, retry arguments)`` requests in flight at once (one round trip for
        all instead of one each); each one's reply or exception, in order, once all are done."""
        async def all_of():
            return await asyncio.gather(*(self.arequest_retry(s, o, **kw) for s, o, kw in calls),
                                        return_exceptions=True)

        return self.run(all_of())

    async def arequest_retry(
        self,
        subj: str,
        obj: Any = None,
        *,
        deadline_s: float = 600.0,
        timeout: float = 10.0,
        retry_busy: bool = True,
        first_backoff: float = 0.002,
        max_backoff: float = 0.5,
        what: str | None = None,
        on_answer: Callable[[], None] | None = None,
        give_up: Callable[[Exception], BaseException | None] | None = None,
    ) -> Any:
        """``arequest`` until it succeeds, retrying a busy or missing peer with backoff until
        ``deadline_s``. ``on_answer``: called on the loop as the answer arrives. ``give_up``: shown
        each failed attempt, it may return an error to raise at once instead of retrying (the
        data loader's rule for an NN rank that finished training)."""
        started = time.monotonic()
        end = started + deadline_s
        report_at = started + WAITING_FIRST_REPORT_S
        backoff = first_backoff
        last: Exception | None = None
        while True:
            try:
                reply = await self.arequest(subj, obj, timeout=min(timeout, max(0.05, end - time.monotonic())))
            except BusyError as exc:
                if not retry_busy:
                    raise
                last = exc
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError,
                    nats.errors.ConnectionReconnectingError) as exc:
                last = exc  # a peer not there yet, or NATS itself away for a moment: ask again
            else:
                if on_answer is not None:
                    on_answer()
                return reply
            stop = give_up(last) if give_up is not None else None
            if stop is not None:
                raise stop from last
            # A busy peer has usually already held the request for a while (long poll), so the
            # retry comes soon; a missing peer (not started yet) is polled more slowly.
            wait = min(backoff, BUSY_MAX_BACKOFF) if isinstance(last, BusyError) else backoff
            now = time.monotonic()
            kind = "busy" if isinstance(last, BusyError) else type(last).__name__
            if now >= report_at and now + wait <= end:
                log.warning("%s: no successful reply after %.0fs (last: %s); still trying, for up to %.0fs more",
                            what or subj, now - started, kind, end - now)
                report_at = now + WAITING_REPORT_S
            if now + wait > end:
                raise BusyError(
                    f"{what or subj}: no successful reply within {deadline_s:.0f}s (last: {kind})"
                ) from last
            await asyncio.sleep(wait)
            backoff = min(max_backoff, backoff * 2)

    def _headers(self, subj: str, payload: bytes) -> dict[str, str] | None:
        if self._secret is None or not needs_signature(subj):
            return None
        return {SIGNATURE_HEADER: sign(self._secret, subj, payload)}

    def _publishing(self, subj: str, obj: Any) -> Awaitable[None]:
        payload = encode(obj)
        return self.nc.publish(subj, payload, headers=self._headers(subj, payload))

    def publish(self, subj: str, obj: Any) -> None:
        self.run(self._publishing(subj, obj))

    def publish_soon(self, subj: str, obj: Any) -> Future:
        """Hand a publish to the bus loop and return at once: for best-effort reports from a
        thread that must not wait for the loop, such as the NN worker's training thread. Waiting
        there cost a cross-CPU round trip to a loop busy on a shared core, a few ms a report
        (docs/benchmarks.md, issue 15, session 28). A failure is logged; the returned future
        holds it too."""
        future = asyncio.run_coroutine_threadsafe(self._publishing(subj, obj), self._loop)
        future.add_done_callback(lambda f: _log_publish_failure(subj, f))
        return future

    # -- server side ------------------------------------------------------------------------------
    def serve(
        self,
        subj: str,
        handler: Callable[[Any], Any],
        *,
        queue: str = "",
        blocking: bool = True,
        schema: Any = None,
        try_first: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Answer requests on ``subj`` with ``handler(obj)``.

        ``schema`` (a :mod:`persia.messages` model) checks every message before the handler sees
        it: a missing or wrong-typed field is answered with an error naming it, and the role keeps
        serving. Subjects of signed controls (:data:`persia.security.SIGNED_METHODS`) are checked
        against the job secret first when one is set. ``blocking`` handlers run on the bus's
        thread pool so they may wait (e.g. for buffer space) without stalling other subscriptions;
        messages of one subscription are still handled in order, which keeps per-sender ordering.
        ``try_first``: a variant of a blocking handler that never waits, run on the loop thread
        first; only when it returns :data:`WOULD_BLOCK` does the message go to the pool (a hand-off
        to another thread and back saved on every message that finds room at once). A non-blocking
        ``handler`` may be a coroutine function: it is awaited on the loop, so it can wait (for
        room in a buffer) without holding a pool thread, and without the two thread hand-offs a
        pool thread's wait costs; messages of the subscription still wait for it in order.
        """
        from persia.messages import MessageError, validate

        checker = self._checker if needs_signature(subj) else None

        async def cb(msg):
            try:
                if checker is not None:
                    checker.check(msg.subject, msg.data, (msg.headers or {}).get(SIGNATURE_HEADER))
                obj = validate(schema, decode(msg.data), subj)
                result = WOULD_BLOCK if try_first is None else try_first(obj)
                if result is WOULD_BLOCK:
                    result = (await self._loop.run_in_executor(self._executor, handler, obj) if blocking
                              else handler(obj))
                    if asyncio.iscoroutine(result):
                        result = await result
                reply = {"busy": True} if result is BUSY else {"ok": result}
            except (Unauthorized, MessageError) as exc:
                _rejected(str(exc))
                reply = {"error": str(exc), "kind": type(exc).__name__}
            except Exception as exc:  # noqa: BLE001 - every failure is answered, not swallowed
                if not isinstance(exc, INPUT_ERRORS):
                    log.exception("handler for %s failed", subj)
                reply = {"error": str(exc), "kind": type(exc).__name__}
            if msg.reply:
                await msg.respond(encode(reply))

        sub = self.run(self.nc.subscribe(subj, queue=queue, cb=cb))
        self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Any, drain: bool = False, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Stop answering on a subscription returned by :meth:`serve`. ``drain``: the messages it
        has received are still handled and answered (within ``timeout_s``), not dropped with a
        handler cut off mid-way: their senders waited out their whole request timeout (10 s)."""
        if sub not in self._subs:
            return
        self._subs.remove(sub)
        if self._outage.closing:  # closed: its subscriptions went with it, and its loop runs nothing more
            return
        if drain:
            try:
                self.run(asyncio.wait_for(sub.drain(), timeout_s))
                return
            except Exception as exc:  # noqa: BLE001 - a NATS outage, a handler slower than timeout_s
                log.warning("draining the subscription to %s: %s: %s; dropped instead", sub.subject,
                            type(exc).__name__, exc)
            with contextlib.suppress(Exception):  # already closed by the drain it cut short
                self.run(sub.unsubscribe())
            return
        self.run(sub.unsubscribe())

    def subscribe_events(self, subj: str, handler: Callable[[Any], None], schema: Any = None) -> None:
        """Fire-and-forget messages (progress, notifications); handler runs on the loop thread.
        Events of signed subjects (``nn.done``) are verified first when a job secret is set: an
        unsigned, forged or replayed one is dropped, with a log line at most once a second."""
        from persia.messages import validate

        # a checker of its own: every subscription of an event gets each message, and a nonce seen
        # by another subscription of this bus is no replay for this one
        checker = SignatureChecker(self._secret) if self._secret and needs_signature(subj) else None

        async def cb(msg):
            try:
                if checker is not None:
                    checker.check(msg.subject, msg.data, (msg.headers or {}).get(SIGNATURE_HEADER))
                handler(validate(schema, decode(msg.data), subj))
            except Unauthorized as exc:
                _rejected(str(exc), "dropped event")
            except ValueError as exc:
                _rejected(f"{subj}: {exc}")
            except Exception:  # noqa: BLE001
                log.exception("event handler for %s failed", subj)

        self._subs.append(self.run(self.nc.subscribe(subj, cb=cb)))

    def flush(self, timeout: float = 5.0) -> None:
        self.run(self.nc.flush(timeout=timeout), timeout + 1)

    def close(self) -> None:
        """Drain and stop; a second call does nothing (its loop is stopped: a coroutine run on it
        would never be awaited)."""
        if self._loop.is_closed() or self._outage.closing:
            return
        self._outage.closing = True
        try:
            # draining needs the server; with NATS gone it would only wait out its timeout
            if self.nc.is_connected:
                self.run(self.nc.drain(), 3)
            else:
                self.run(self.nc.close(), 1)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        try:  # tasks left on the loop would be collected after it closed, each with a traceback
            self.run(_cancel_other_tasks(), 2)
        except Exception:  # noqa: BLE001
            pass
        self._stop_loop()


async def _cancel_other_tasks() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in others:
        t.cancel()
    await asyncio.gather(*others, return_exceptions=True)


class _LogThrottle:
    """At most one log line every ``interval_s``: a flood of the same failure must not flood the log."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last = float("-inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True


_rejections = _LogThrottle(1.0)
_publish_failures = _LogThrottle(10.0)  # a report sent twice a second through an outage


def _log_publish_failure(subj: str, future: Future) -> None:
    """A failed :meth:`NatsBus.publish_soon` in the log (``_publish_failures`` paces it)."""
    if future.cancelled() or future.exception() is None:
        return
    if _publish_failures.due():
        exc = future.exception()
        log.warning("publish to %s failed: %s: %s", subj, type(exc).__name__, exc)


def _rejected(what: str, kind: str = "refused message") -> None:
    """Log refusals, at most one line a second."""
    if _rejections.due():
        log.warning("%s: %s", kind, what)


_shared: NatsBus | None = None
_shared_lock = threading.Lock()


def shared_bus() -> NatsBus:
    """The process-wide bus (contexts nest: eval_ctx inside TrainCtx shares one connection)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = NatsBus(name=f"{job_name()}-{os.getpid()}")
        return _shared


def close_shared_bus() -> None:
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.close()
            _shared = None
