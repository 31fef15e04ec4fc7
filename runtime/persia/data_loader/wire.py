"""How a PersiaBatch's parts go on the wire (shared by DataCtx and the NN worker's direct lookups)."""

from __future__ import annotations

import numpy as np

from persia.data_loader.batch import IDTypeFeatureWithSingleID, PersiaBatch
from persia.wire import ids


def id_features_to_wire(batch: PersiaBatch) -> dict:
    """All of the batch's ID features as one packed record (:mod:`persia.wire.ids`): one IDs
    array for all, offsets only for features that may hold other than one ID per sample."""
    values, offsets = [], []
    for f in batch.id_type_features:
        if isinstance(f, IDTypeFeatureWithSingleID):  # one ID per sample: no offsets to build
            values.append(f.id_values())
            offsets.append(None)
        else:
            v, o = f.to_csr()
            values.append(v)
            offsets.append(o)
    return ids.pack([f.name for f in batch.id_type_features], values, offsets, batch.batch_size)


def _named_arrays(items) -> list[dict]:
    """The dense features or labels of a batch, copied: a batch held for its group partner is
    encoded later, and a loader that refills one buffer per batch would send the next batch's
    values with this batch's IDs (the ID leg is packed into new arrays already)."""
    return [{"name": x.name, "data": np.array(x.data, copy=True)} for x in (items or [])]

