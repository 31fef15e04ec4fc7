"""How a PersiaBatch's parts go on the wire (shared by DataCtx and the NN worker's direct lookups)."""

from __future__ import annotations

import numpy as np

from persia.data_loader.batch import PersiaBatch


def id_features_to_wire(batch: PersiaBatch) -> list[dict]:
    out = []
    for f in batch.id_type_features:
        values, offsets = f.to_csr()
        out.append({"name": f.name, "values": values, "offsets": offsets})
    return out


def _named_arrays(items) -> list[dict]:
    return [{"name": x.name, "data": np.asarray(x.data)} for x in (items or [])]

