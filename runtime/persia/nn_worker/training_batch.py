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
    # the embedding worker's lookup reply (persia.embedding_worker.pipeline.lookup_reply): per
    # slot, indices into its dim's distinct rows; per dim, those rows (and the one-ID slots' index)
    embeddings: list[dict]
    meta: bytes | None = None
    batch_id: int | None = None
    ref: int | None = None
    worker: int | None = None
    loader: int | None = None  # the data loader that sent it (checkpoint positions)
    requires_grad: bool = False
    holds_permit: bool = False  # a staleness permit is released when its gradients are applied
    emb_tables: list[dict] = field(default_factory=list)
    # filled by ctx.prepare_features: one leaf per dim (its .grad, one row per distinct ID, goes
    # back to the PS) and, per slot, whether backward reached its tensor (a slot the model did not
    # use gets no update, as in PERSIA)
    emb_leaves: list[Any] = field(default_factory=list)
    slot_used: list[bool] = field(default_factory=list)
    # (leaves, slot_used) of earlier forwards of this batch since its backward began: each forward
    # builds its own leaves, and a loss over two forwards (R-drop) has gradients in both
    earlier_leaves: list[tuple[list[Any], list[bool]]] = field(default_factory=list, repr=False)
    # what became of it once its update was sent or it was let go ("trained", "no_backward", ...):
    # forwarded again, it is only evaluated
    settled: str | None = None
    # tensors the lookup thread built ahead (``EmbeddingCtx._prebuild``); one forward consumes them
    prepared: Any = field(default=None, repr=False)
    # what re-applying the NN worker's own missed updates needs (persia.nn_worker.own_updates):
    # the reply's ``replay`` part plus the lookup's ``since``; None when the lookup did not ask
    replay: dict | None = field(default=None, repr=False)

    def unused_slots(self) -> list[int]:
        """Positions of the slots whose tensor got no gradient in any forward (after backward)."""
        used = list(self.slot_used)
        for _, earlier in self.earlier_leaves:
            used = [a or b for a, b in zip(used, earlier)]
        return [i for i, u in enumerate(used) if not u]

    def embedding_grads(self) -> list[Any]:
        """Per dim, the gradient of its rows over every forward of this batch (None: none reached
        it), as torch tensors (after backward)."""
        out = []
        for i, leaf in enumerate(self.emb_leaves):
            parts = [g for g in (leaf.grad, *(leaves[i].grad for leaves, _ in self.earlier_leaves)) if g is not None]
            out.append(None if not parts else parts[0] if len(parts) == 1 else sum(parts[1:], parts[0]))
        return out

    def consume_all_meta_data(self) -> bytes | None:
        return self.meta
