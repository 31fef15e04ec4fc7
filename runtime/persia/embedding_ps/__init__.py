"""The embedding parameter server's storage engine: rows, index, optimizers, checkpoints and
incremental updates (no networking; ``service.py`` puts gRPC around it)."""

from persia.embedding_ps.checkpoint import CheckpointError
from persia.embedding_ps.optimizers import (
    AdagradConfig,
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    optimizer_from_wire,
    optimizer_to_wire,
    state_width,
)
from persia.embedding_ps.store import EmbeddingStore, HyperParameters

__all__ = [
    "AdagradConfig",
    "AdamConfig",
    "CheckpointError",
    "EmbeddingStore",
    "HyperParameters",
    "OptimizerConfig",
    "SGDConfig",
    "optimizer_from_wire",
    "optimizer_to_wire",
    "state_width",
]
