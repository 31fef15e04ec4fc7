"""gRPC front of the model server: ``persia.ModelServer/Predict`` and ``/Ready``, generic handlers
with :mod:`persia.rpc`'s codec envelope and TLS (no generated stubs), so ``persia.rpc.Client``
calls it: ``Client(addr, "persia.ModelServer").call("Predict", {"batch": batch.to_bytes()})``.

Predict: ``{"batch": PersiaBatch.to_bytes()}`` -> ``{"predictions": float32 array (bs, out)}``.
Status codes: bad request INVALID_ARGUMENT (naming the field), overloaded / no model / embedding
worker down UNAVAILABLE, timeout DEADLINE_EXCEEDED (``request_timeout_s``, or the caller's deadline
when shorter: it bounds the request, its lookup included), other INTERNAL.
"""

from __future__ import annotations

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


def start_grpc(server: Any, host: str, port: int, tls: GrpcTls | None = None):
    def predict(req: dict, context: grpc.ServicerContext) -> dict:
        try:
            batch = batch_from_bytes(req["batch"])
        except RequestError as exc:
            err = ServeError(400, "bad_request", str(exc), exc.field)
            server.count_refused("grpc", err)
            raise err from None
        # the caller's deadline, when it set one shorter than request_timeout_s, bounds the request
        return {"predictions": server.predict(batch, "grpc", context.time_remaining())}

    def ready(_req, _context) -> dict:
        ok, why = server.ready()
        return {"ready": ok, "reason": why}

    methods = {"Predict": (predict, PredictRequest), "Ready": (ready, NoPayload)}

    def wrap(name: str, fn, schema):
        where = f"{SERVICE}/{name}"

        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, rpc._Malformed):
                server.count_refused("grpc", ServeError(400, "bad_request", request.why))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: malformed message: {request.why}")
            try:
                return fn(validate(schema, request["m"], where), context)
            except MessageError as exc:
                server.count_refused("grpc", ServeError(400, "bad_request", str(exc)))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except ServeError as err:
                context.abort(_CODES.get(err.status, grpc.StatusCode.INTERNAL), str(err))

        return grpc.unary_unary_rpc_method_handler(
            handler, request_deserializer=rpc._unpack_request, response_serializer=rpc._pack)

    tls = GrpcTls.from_env() if tls is None else tls
    handlers = grpc.method_handlers_generic_handler(
        SERVICE, {n: wrap(n, fn, schema) for n, (fn, schema) in methods.items()})
    grpc_server = rpc.start_server(handlers, host, port, tls, max_workers=max(8, server.config.workers * 4),
                                   thread_name_prefix="serve-grpc")
    return grpc_server, grpc_server.port
