"""Serving a trained model: the model server (``persia-launcher serve``).

The server loads the jitted dense model (``jit_dense.pt`` from ``ctx.dump_checkpoint(...,
with_jit_model=True)``), looks embeddings up on inference embedding workers given by address
(no NATS), batches concurrent requests within a bounded latency, and answers over HTTP/JSON and
gRPC. See docs/serving.md.

The names below load on first use: ``persia.launcher`` builds its ``serve`` flags from
:mod:`persia.serving.cli` in every role's process, and the server's module imports torch (about
2 s of CPU), which the PS, embedding worker and data loader never need.
"""

from __future__ import annotations

import importlib

__all__ = ["ModelServer", "ServeConfig"]

_WHERE = {"ModelServer": "persia.serving.server", "ServeConfig": "persia.serving.config"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'persia.serving' has no attribute {name!r}")
