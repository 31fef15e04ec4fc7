"""gRPC without generated stubs: unary methods whose messages are :mod:`persia.wire.codec` trees.

Lookups and gradients are big numpy payloads; a generic handler with our codec sends them as raw
buffers (no protobuf copy per field, no codegen step, nothing generated in the repo).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import grpc

from persia.errors import INPUT_ERRORS, BatchLost, RemoteError, ServersMisplaced, TooManyWaiting
from persia.messages import MessageError, validate
from persia.security import GRPC_AUTH_METADATA, GrpcTls, grpc_token, grpc_token_matches, job_secret
from persia.wire.codec import decode, encode

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 30
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# gRPC binds servers with SO_REUSEPORT by default: a second role given a taken port would start
# without an error and take part of the first one's connections.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]
# A channel whose server is not up yet (an inference PS loading its checkpoint, a role restarting)
# retries the connection with a backoff that grows to 120 s by default: the peer would stay
# unreachable for up to two minutes after it came up. Capped at 2 s, a few connects a second at most.
CLIENT_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def _pack(obj: Any) -> bytes:
    # gRPC treats a deserializer returning None as a failure, so every message is a one-key map.
    return encode({"m": obj})


def _unpack(buf: bytes) -> dict:
    """Returns the envelope, never None (gRPC would call None a deserialization failure)."""
    tree = decode(buf)
    if not isinstance(tree, dict) or "m" not in tree:
        raise ValueError("not a persia gRPC message")
    return tree


class _Malformed:
    def __init__(self, why: str):
        self.why = why


def _unpack_request(buf: bytes) -> Any:
    """Server side: a payload that does not decode becomes a marker the handler answers with
    INVALID_ARGUMENT (a raising deserializer would make gRPC answer INTERNAL)."""
    try:
        return _unpack(buf)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's
        return _Malformed(f"{type(exc).__name__}: {exc}")


Method = Callable[[Any], Any] | tuple[Callable[[Any], Any], Any]

_FROM_ENV: Any = object()  # the job secret of this process's environment (PERSIA_JOB_SECRET)


def _token(secret: Any) -> str | None:
    return grpc_token(job_secret() if secret is _FROM_ENV else secret)


class _Refusals:
    """Log refused calls at most once a second (a flood must not flood the log), counting the
    ones in between."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._last = float("-inf")
        self._quiet = 0
        self._lock = threading.Lock()

    def note(self, where: str, peer: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._quiet += 1
                return
            self._last, quiet, self._quiet = now, self._quiet, 0
        log.warning("refused a gRPC call to %s from %s: it does not carry this job's credential "
                    "(PERSIA_JOB_SECRET)%s", where, peer, f"; {quiet} more refused since the last line" if quiet else "")


_refusals = _Refusals()


HandlerFactory = Callable[[float], grpc.RpcMethodHandler]
"""``make(arrived)``: a method's handler, made by gRPC's serving thread as its call arrives
(``arrived``: ``time.monotonic()`` then), before the call waits for a handler thread."""


def fixed(handler: grpc.RpcMethodHandler) -> HandlerFactory:
    """A factory that answers every call with the same ``handler``."""
    return lambda _arrived: handler


class Service(grpc.GenericRpcHandler):
    """The methods of one service, ``factories`` by method name (each :data:`HandlerFactory`:
    :func:`fixed` for a handler made once, or one made per call, so that its deadline counts from
    the call's arrival). A method of another service is left to the server's other handlers (None).

    With ``token`` (:func:`persia.security.grpc_token` of the job secret), a call whose
    ``persia-auth`` metadata is not that token is answered UNAUTHENTICATED by a handler that takes
    the payload as raw bytes: nothing of it is decoded.

    ``on_over_limit(method)``: called for a call that gRPC is about to refuse RESOURCE_EXHAUSTED
    because ``maximum_concurrent_rpcs`` calls are in progress (:func:`start_server` wires it; gRPC
    itself counts such refusals nowhere)."""

    def __init__(self, service: str, factories: dict[str, HandlerFactory], token: str | None = None,
                 on_over_limit: Callable[[str], None] | None = None):
        self._service = service
        self._token = token
        self._factories = {f"/{service}/{name}": f for name, f in factories.items()}
        self._refuse = {path: grpc.unary_unary_rpc_method_handler(self._refuser(path.lstrip("/")))
                        for path in self._factories} if token else {}
        self.on_over_limit = on_over_limit
        self._over_limit: Callable[[], bool] | None = None  # set by start_server

    @staticmethod
    def _refuser(where: str):
        def refuse(_raw: bytes, context: grpc.ServicerContext) -> None:
            _refusals.note(where, context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{where}: this server requires the job's credential (a client with PERSIA_JOB_SECRET "
                          f"sends it); the call carried none or a wrong one")

        return refuse

    def service_name(self) -> str:
        return self._service

    def _authorized(self, handler_call_details: grpc.HandlerCallDetails) -> bool:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == GRPC_AUTH_METADATA:
                return grpc_token_matches(value, self._token)
        return False

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        arrived = time.monotonic()
        method = handler_call_details.method
        make = self._factories.get(method)
        if make is None:
            return None
        if self._token is not None and not self._authorized(handler_call_details):
            return self._refuse[method]
        if self.on_over_limit is not None and self._over_limit is not None and self._over_limit():
            self.on_over_limit(method.rsplit("/", 1)[-1])  # gRPC answers it RESOURCE_EXHAUSTED next
        return make(arrived)


def error_status(exc: Exception) -> tuple[str, str]:
    """The gRPC status name and detail a handler's exception is answered with: what callers act
    on (``BatchLost``/``TooManyWaiting`` by their own status, bad input as INVALID_ARGUMENT).
    Shared by the gRPC server and the in-process client of a colocated PS, so both answer alike."""
    if isinstance(exc, MessageError):
        return "INVALID_ARGUMENT", str(exc)
    if isinstance(exc, (BatchLost, TooManyWaiting, ServersMisplaced)):
        return exc.grpc_status, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, INPUT_ERRORS):
        return "INVALID_ARGUMENT", f"{type(exc).__name__}: {exc}"
    return "INTERNAL", f"{type(exc).__name__}: {exc}"


def serve(
    service: str,
    methods: dict[str, Method],
    port: int,
    host: str = "0.0.0.0",
    max_workers: int = 8,
    tls: GrpcTls | None = None,
    secret: bytes | None = _FROM_ENV,
) -> tuple[Server, int]:
    """Start a gRPC server for ``methods`` (each ``fn`` or ``(fn, schema)``, ``fn(request) ->
    response``, the schema from :mod:`persia.messages`); returns the bound port.

    ``tls`` defaults to ``PERSIA_GRPC_TLS_*`` (TLS with a certificate, mutual TLS with a CA too).
    ``secret`` defaults to ``PERSIA_JOB_SECRET``: with one, every call must carry the job's
    credential (``persia-auth`` metadata, which :class:`Client` sends) or is answered
    UNAUTHENTICATED before its payload is decoded. Without one, any client is served.
    """
    tls = GrpcTls.from_env() if tls is None else tls
    token = _token(secret)

    def wrap(name: str, method: Method):
        fn, schema = method if isinstance(method, tuple) else (method, None)
        where = f"{service}/{name}"

        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: malformed message: {request.why}")
            try:
                return fn(validate(schema, request["m"], where))
            except Exception as exc:  # noqa: BLE001 - every failure becomes the caller's status
                code, detail = error_status(exc)
                if code == "INTERNAL":
                    log.exception("%s/%s failed", service, name)
                context.abort(getattr(grpc.StatusCode, code), detail)

        return grpc.unary_unary_rpc_method_handler(
            handler, request_deserializer=_unpack_request, response_serializer=_pack
        )

    handlers = Service(service, {n: fixed(wrap(n, f)) for n, f in methods.items()}, token)
    server = start_server(handlers, host, port, tls, max_workers=max_workers, thread_name_prefix="persia-grpc")
    return server, server.port


class Server:
    """A started gRPC server that owns its handler threads.

    ``grpc.Server.stop`` leaves the executor it was given running, so a process that starts and
    stops servers (``PersiaServiceCtx``, a model server, the tests) kept every pool's idle threads
    until it exited. ``stop`` here shuts the pool down once the server has stopped.
    """

    def __init__(self, server: grpc.Server, executor: ThreadPoolExecutor, port: int):
        self._server = server
        self._executor = executor
        self.port = port

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop as ``grpc.Server.stop`` does (the event is set once every call has ended); the
        handler threads end after that. Calls already running finish; none can start."""
        stopped = self._server.stop(grace)

        def release() -> None:
            stopped.wait()
            self._executor.shutdown(wait=False)

        if stopped.is_set():
            release()
        else:
            threading.Thread(target=release, name="persia-grpc-release", daemon=True).start()
        return stopped

    def backlog(self) -> int:
        """Calls accepted and waiting for a handler thread (the executor's queue; approximate)."""
        return self._executor._work_queue.qsize()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)

    def add_generic_rpc_handlers(self, handlers: list[grpc.GenericRpcHandler]) -> None:
        """More services on the same port (``bench/rpc_call.py`` adds a raw stream beside ours)."""
        self._server.add_generic_rpc_handlers(handlers)


def start_server(
    handlers: grpc.GenericRpcHandler,
    host: str,
    port: int,
    tls: GrpcTls,
    max_workers: int,
    thread_name_prefix: str,
    maximum_concurrent_rpcs: int | None = None,
    max_receive_bytes: int | None = None,
) -> Server:
    """Bind and start a server for ``handlers`` on ``host:port`` (0 picks a free port), with our
    message size limits and, when ``tls`` is enabled, its credentials.

    ``maximum_concurrent_rpcs``: calls in progress at most, those waiting for a handler thread
    included; gRPC answers one more RESOURCE_EXHAUSTED at once, without queueing it (None: no
    limit). ``max_receive_bytes``: a larger request message is refused RESOURCE_EXHAUSTED by gRPC
    before any of our code decodes it (None: ``MAX_MESSAGE_BYTES``)."""
    options = SERVER_OPTIONS
    if max_receive_bytes is not None:
        options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", int(max_receive_bytes)))
    executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
    server = grpc.server(executor, options=options, maximum_concurrent_rpcs=maximum_concurrent_rpcs)
    if isinstance(handlers, Service) and maximum_concurrent_rpcs is not None:
        handlers._over_limit = _limit_reached(server)
    server.add_generic_rpc_handlers([handlers])
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:  # grpcio answers a failed bind with 0 in older releases, RuntimeError in newer ones
        bound = server.add_secure_port(addr, tls.server_credentials()) if tls.enabled \
            else server.add_insecure_port(addr)
    except RuntimeError:
        bound = 0
    if bound == 0:
        executor.shutdown(wait=False)
        raise OSError(f"cannot bind gRPC {handlers.service_name()} to {host}:{port} (port in use?)")
    server.start()
    return Server(server, executor, bound)


def _limit_reached(server: grpc.Server) -> Callable[[], bool] | None:
    """Whether ``server`` is about to refuse the call whose handler it is looking up because
    ``maximum_concurrent_rpcs`` calls are in progress. gRPC (``grpc._server._handle_call``) looks the
    handler up and decides the refusal under one hold of its state lock, from the same count, so
    this read, made in :meth:`Service.service`, sees the count the decision is made on. gRPC offers
    no hook or counter for these refusals; this reads its private state, and where that is not
    there (another grpcio), returns None: refusals are then not counted, never miscounted."""
    state = getattr(server, "_state", None)
    if state is None or not hasattr(state, "active_rpc_count") or not hasattr(state, "maximum_concurrent_rpcs"):
        log.warning("this grpcio (%s) does not expose its call count: calls it refuses over "
                    "maximum_concurrent_rpcs are not counted", grpc.__version__)
        return None

    def reached() -> bool:
        limit = state.maximum_concurrent_rpcs
        return limit is not None and state.active_rpc_count >= limit

    return reached


class Client:
    """A channel to one server; ``call`` blocks, ``future`` lets callers fan out in parallel."""

    def __init__(self, address: str, service: str, tls: GrpcTls | None = None, secret: bytes | None = _FROM_ENV):
        """``secret`` defaults to ``PERSIA_JOB_SECRET``: with one, every call carries the job's
        credential (:func:`persia.security.grpc_token`, computed here once)."""
        self.address = address
        self.service = service
        tls = GrpcTls.from_env() if tls is None else tls
        token = _token(secret)
        self._metadata = ((GRPC_AUTH_METADATA, token),) if token else None
        if tls.enabled:
            options = list(CLIENT_OPTIONS)
            if os.environ.get("PERSIA_GRPC_TLS_SERVER_NAME"):  # when certificates name a service, not the pod IP
                options.append(("grpc.ssl_target_name_override", os.environ["PERSIA_GRPC_TLS_SERVER_NAME"]))
            self._channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        self._methods: dict[str, Any] = {}

    def _method(self, name: str):
        m = self._methods.get(name)
        if m is None:
            m = self._channel.unary_unary(
                f"/{self.service}/{name}", request_serializer=_pack, response_deserializer=_unpack
            )
            self._methods[name] = m
        return m

    def call(self, name: str, request: Any = None, timeout: float = 60.0) -> Any:
        try:
            return self._method(name)(request, timeout=timeout, metadata=self._metadata)["m"]
        except grpc.RpcError as exc:
            raise _as_remote_error(self, name, exc) from None

    def future(self, name: str, request: Any = None, timeout: float = 60.0):
        return self._method(name).future(request, timeout=timeout, metadata=self._metadata)

    def result(self, name: str, fut) -> Any:
        try:
            return fut.result()["m"]
        except grpc.RpcError as exc:
            raise _as_remote_error(self, name, exc) from None

    def close(self) -> None:
        self._channel.close()


def _as_remote_error(client: Client, name: str, exc: grpc.RpcError) -> RemoteError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    kind = code.name if code is not None else "UNKNOWN"
    return RemoteError(f"{client.service}/{name}@{client.address}", detail or kind, kind=kind)
