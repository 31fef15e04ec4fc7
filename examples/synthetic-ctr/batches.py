"""Turn a generated batch into a PersiaBatch (shared by the data loader and the test set)."""

from __future__ import annotations

import numpy as np
from persia.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch

from synthetic_ctr.reader import Batch
from synthetic_ctr.schema import SLOT_NAMES


def to_persia_batch(batch: Batch, requires_grad: bool) -> PersiaBatch:
    by_slot = np.ascontiguousarray(batch.ids.T)  # one transposing copy; each slot's IDs a contiguous row of it
    return PersiaBatch(
        [IDTypeFeatureWithSingleID(name, by_slot[s]) for s, name in enumerate(SLOT_NAMES)],
        non_id_type_features=[NonIDTypeFeature(batch.dense, name="dense")],
        labels=[Label(batch.label, name="click")],
        requires_grad=requires_grad,
    )
