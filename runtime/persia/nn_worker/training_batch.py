"""What the NN worker's DataLoader yields: a batch whose embeddings have been looked up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PersiaTrainingBatch:
    """A batch whose embeddings have been looked up; what ``ctx.forward`` consumes."""

    non_id_type_features: list[np.ndarray]
    non_id_type_feature_names: list[str]
    labels: list[np.ndarray]
    label_names: list[str]
    embeddings: list[dict]  # per slot: {"name", "emb"} or {"name", "distinct", "index"}
    meta: bytes | None = None
    batch_id: int | None = None
    ref: int | None = None
    worker: int | None = None
    loader: int | None = None  # the data loader that sent it (checkpoint positions)
    requires_grad: bool = False
    holds_permit: bool = False  # a staleness permit is released when its gradients are applied
    # filled by ctx.prepare_features: the leaf tensors whose .grad goes back to the PS
    emb_leaves: list[Any] = field(default_factory=list)

    def consume_all_meta_data(self) -> bytes | None:
        return self.meta
