"""gRPC front of the model server: ``persia.ModelServer/Predict`` and ``/Ready``, generic handlers
with :mod:`persia.rpc`'s codec envelope and TLS (no generated stubs), so ``persia.rpc.Client``
calls it: ``Client(addr, "persia.ModelServer").call("Predict", {"batch": batch.to_bytes()})``.

Predict: ``{"batch": PersiaBatch.to_bytes()}`` -> ``{"predictions": float32 array (bs, out)}``.
Status codes: bad request INVALID_ARGUMENT (naming the field), overloaded / no model / embedding
worker down UNAVAILABLE, timeout DEADLINE_EXCEEDED (``request_timeout_s``, or the caller's deadline
when shorter: it bounds the request, its lookup included), other INTERNAL.

Limits, as HTTP's: at most ``max_queue`` calls at once, those waiting for a handler thread
included (gRPC answers one more RESOURCE_EXHAUSTED at once, never queues it; a ``Predict`` so
refused is counted as an ``overloaded`` request, :class:`persia.rpc.Service`); a request message
over ``max_request_bytes`` is refused RESOURCE_EXHAUSTED by gRPC before it is decoded. A call's
``request_timeout_s`` counts from its arrival, not from when a handler thread takes it: one that
waited for a thread past its deadline (or the caller's) is answered DEADLINE_EXCEEDED at once,
before its batch is parsed. ``persia_serving_queue_depth`` counts the calls waiting for a thread too.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import grpc
from pydantic import Field

from persia import rpc
from persia.messages import MessageError, NoPayload, _Msg, validate
from persia.security import GrpcTls
from persia.serving.request import RequestError, batch_from_bytes
from persia.serving.answers import ServeError

SERVICE = "persia.ModelServer"
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 503: grpc.StatusCode.UNAVAILABLE,
          504: grpc.StatusCode.DEADLINE_EXCEEDED}


class PredictRequest(_Msg):
    batch: Annotated[bytes, Field(min_length=1)]


class _Expired:
    """A request message left undecoded: its deadline passed while it waited for a thread."""


def start_grpc(server: Any, host: str, port: int, tls: GrpcTls | None = None):
    timeout_s = server.config.request_timeout_s

    def time_left(arrived: float, context: grpc.ServicerContext) -> float:
        """Seconds the call has left: ``request_timeout_s`` from its arrival, or the caller's
        deadline when that is sooner."""
        left = arrived + timeout_s - time.monotonic()
        caller = context.time_remaining()
        return left if caller is None else min(left, caller)

    def refuse_late(context: grpc.ServicerContext) -> None:
        err = ServeError(504, "timeout", "no answer in time: the request's deadline passed before a gRPC "
                         "handler thread could take it")
        server.count_refused("grpc", err)
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))

    def predict(req: dict, context: grpc.ServicerContext, arrived: float) -> dict:
        try:
            batch = batch_from_bytes(req["batch"])
        except RequestError as exc:
            err = ServeError(400, "bad_request", str(exc), exc.field)
            server.count_refused("grpc", err)
            raise err from None
        if time_left(arrived, context) <= 0:
            refuse_late(context)
        # counted from its arrival (latency too), bounded by the caller's deadline when sooner
        caller = context.time_remaining()
        since = None if caller is None else time.monotonic() - arrived + caller
        return {"predictions": server.predict(batch, "grpc", since, started=arrived)}

    def ready(_req, _context, _arrived) -> dict:
        ok, why = server.ready()
        return {"ready": ok, "reason": why}

    methods = {"Predict": (predict, PredictRequest, True), "Ready": (ready, NoPayload, False)}

    def wrap(name: str, fn, schema, deadline: bool):
        """A handler factory: ``make(arrived)`` is called by gRPC's serving thread as the call
        arrives, before it waits for a handler thread, so the call's deadline counts from then."""
        where = f"{SERVICE}/{name}"

        def make(arrived: float) -> grpc.RpcMethodHandler:
            def deserialize(buf: bytes) -> Any:
                if deadline and time.monotonic() >= arrived + timeout_s:
                    return _Expired()  # not worth decoding
                return rpc._unpack_request(buf)

            def handler(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Expired) or (deadline and time_left(arrived, context) <= 0):
                    refuse_late(context)
                if isinstance(request, rpc._Malformed):
                    server.count_refused("grpc", ServeError(400, "bad_request", request.why))
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: malformed message: {request.why}")
                try:
                    return fn(validate(schema, request["m"], where), context, arrived)
                except MessageError as exc:
                    server.count_refused("grpc", ServeError(400, "bad_request", str(exc)))
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                except ServeError as err:
                    context.abort(_CODES.get(err.status, grpc.StatusCode.INTERNAL), str(err))

            return grpc.unary_unary_rpc_method_handler(
                handler, request_deserializer=deserialize, response_serializer=rpc._pack)

        return make

    def over_limit(method: str) -> None:
        if method == "Predict":  # counted as HTTP counts its queue-full refusals; Ready calls are not requests
            server.count_refused("grpc", ServeError(
                503, "overloaded", f"overloaded: {server.config.max_queue} gRPC calls in progress "
                                   f"(max_queue); refused RESOURCE_EXHAUSTED by gRPC"))

    tls = GrpcTls.from_env() if tls is None else tls
    # no job credential: the model server's clients are outside the job
    handlers = rpc.Service(SERVICE, {n: wrap(n, *spec) for n, spec in methods.items()}, token=None,
                           on_over_limit=over_limit)
    grpc_server = rpc.start_server(handlers, host, port, tls, max_workers=max(8, server.config.workers * 4),
                                   thread_name_prefix="serve-grpc",
                                   maximum_concurrent_rpcs=server.config.max_queue,
                                   max_receive_bytes=server.config.max_request_bytes)
    return grpc_server, grpc_server.port
