"""Serving a trained model: the model server (``persia-launcher serve``).

The server loads the jitted dense model (``jit_dense.pt`` from ``ctx.dump_checkpoint(...,
with_jit_model=True)``), looks embeddings up on inference embedding workers given by address
(no NATS), batches concurrent requests within a bounded latency, and answers over HTTP/JSON and
gRPC. See docs/serving.md.
"""

from persia.serving.config import ServeConfig
from persia.serving.server import ModelServer

__all__ = ["ModelServer", "ServeConfig"]
