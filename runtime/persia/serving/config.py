"""The model server's settings (pydantic: a bad value is refused at start, naming the field)."""

from __future__ import annotations

from typing import List, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    embedding_workers: List[str] = Field(min_length=1)
    """Inference embedding workers, ``host:port`` (static list; no NATS)."""
    model: str
    """``jit_dense.pt``, or a directory: its ``jit_dense.pt``, or the newest complete
    ``ckpt-<step>/jit_dense.pt`` under it (periodic checkpoints)."""
    http_port: int = Field(default=8080, ge=0, le=65535)
    grpc_port: Optional[int] = Field(default=8081, ge=0, le=65535)
    """None: no gRPC listener."""
    host: str = "127.0.0.1"
    max_batch_size: int = Field(default=512, ge=1, le=65535)
    """Samples per model call: concurrent requests are merged up to this many."""
    max_latency_ms: float = Field(default=5.0, ge=0.0, le=10_000.0)
    """How long the first request of a batch may wait for others to join it."""
    max_queue: int = Field(default=1024, ge=1)
    """Requests waiting at most; more are answered 503 (back-pressure, not an unbounded queue)."""
    workers: int = Field(default=2, ge=1, le=64)
    """Batches run at once (lookup + model)."""
    model_poll_seconds: float = Field(default=5.0, gt=0.0)
    """How often the model file is checked for a new version (reloaded without a restart)."""
    max_request_bytes: int = Field(default=64 << 20, ge=1024)
    max_bytes_in_flight: int = Field(default=256 << 20, ge=1024)
    """Request bodies read or parsed at once, in bytes (at least ``max_request_bytes``); a body
    that finds no room within a second is answered 503 before it is read (:mod:`persia.serving.budget`)."""
    request_timeout_s: float = Field(default=30.0, gt=0.0)
    """A request not answered within this is answered 504 (and dropped if it has not run); its
    embedding lookup gets what is left of it."""
    http_timeout_s: float = Field(default=30.0, gt=0.0)
    """HTTP: every socket write waits at most this; a request's line and headers must arrive
    within it (an idle keep-alive connection is closed after it), then its body (else 408)."""
    max_connections: int = Field(default=256, ge=1, le=65535)
    """HTTP connections open at once (each holds a thread); one more goes to the probe lane: its
    GET /live, /ready or /metrics is answered, anything else 503 and closed."""

    @model_validator(mode="after")
    def _a_largest_request_fits(self) -> "ServeConfig":
        if self.max_bytes_in_flight < self.max_request_bytes:
            raise ValueError(f"max_bytes_in_flight ({self.max_bytes_in_flight}) must be at least max_request_bytes "
                             f"({self.max_request_bytes}): a request of that size could never be read")
        return self

    @field_validator("embedding_workers")
    @classmethod
    def _host_port(cls, value: list[str]) -> list[str]:
        for i, addr in enumerate(value):
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"embedding_workers[{i}] must be host:port, got {addr!r}")
        return value
