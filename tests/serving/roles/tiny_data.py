"""Tiny job for the metrics test: random batches of three slots (user, item, tags) and a dense part."""

import numpy as np

from persia.embedding.data import IDTypeFeature, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch

BS = 16
EMBEDDING_CONFIG = {"feature_index_prefix_bit": 8,
                    "slots_config": {"user": {"dim": 4}, "item": {"dim": 4}, "tags": {"dim": 3}}}


def make_batch(seed: int, requires_grad: bool = True) -> PersiaBatch:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 50, size=BS, dtype=np.uint64)
    items = [rng.integers(1000, 1100, size=rng.integers(1, 4), dtype=np.uint64) for _ in range(BS)]
    tags = [rng.integers(0, 10, size=rng.integers(0, 5), dtype=np.uint64) for _ in range(BS)]
    return PersiaBatch(
        [IDTypeFeatureWithSingleID("user", users), IDTypeFeature("item", items), IDTypeFeature("tags", tags)],
        non_id_type_features=[NonIDTypeFeature(rng.standard_normal((BS, 2)).astype(np.float32), name="dense")],
        labels=[Label((users % 2).astype(np.float32).reshape(-1, 1), name="y")],
        requires_grad=requires_grad,
    )
