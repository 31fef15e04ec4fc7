"""The embedding layout a checkpoint records (checkpoint.embedding_layout): per slot what decides
where its rows live (index prefix, hash stacking) and their shape (dim). An embedding config that
puts a slot elsewhere (slots listed in another order, another feature_index_prefix_bit or
feature_groups) or gives it another dim is a difference naming the first such slot and both values;
a slot added to or dropped from the config is only a note."""

from __future__ import annotations

import json

import numpy as np
import pytest
from persia.config import load_embedding_config_from_dict
from persia.embedding_ps import EmbeddingStore
from persia.embedding_ps import checkpoint as ckpt

SLOTS = {"user": {"dim": 4}, "item": {"dim": 4}, "tags": {"dim": 3}}


def layout(slots=SLOTS, **extra) -> dict:
    return ckpt.embedding_layout(load_embedding_config_from_dict({"slots_config": slots, **extra}))


def test_the_layout_records_each_slots_prefix_dim_and_group():
    got = layout(feature_groups={"ui": ["user", "item"]})
    assert got["feature_index_prefix_bit"] == 8 and got["feature_groups"] == {"ui": ["user", "item"]}
    assert got["slots"]["user"] == {"index_prefix": 1 << 56, "dim": 4, "group": "ui", "hash_stack_rounds": 0,
                                    "hash_stack_embedding_size": 0}
    assert got["slots"]["item"]["index_prefix"] == 1 << 56 and got["slots"]["tags"]["index_prefix"] == 2 << 56
    assert json.loads(json.dumps(got)) == got  # plain JSON for the done marker


@pytest.mark.parametrize("config, why", [
    ({"slots_config": dict(sorted(SLOTS.items()))},
     ("slot 'user': index_prefix 0x0100000000000000 in the checkpoint, 0x0300000000000000 in the embedding config; "
      "slots_config lists the slots as ['user', 'item', 'tags'] in the checkpoint, ['item', 'tags', 'user']")),
    ({"slots_config": SLOTS, "feature_index_prefix_bit": 6},
     ("slot 'user': index_prefix 0x0100000000000000 in the checkpoint, 0x0400000000000000 in the embedding config; "
      "feature_index_prefix_bit is 8 in the checkpoint, 6 in the embedding config")),
    ({"slots_config": SLOTS, "feature_groups": {"ui": ["user", "item"]}},
     ("slot 'item': index_prefix 0x0200000000000000 in the checkpoint, 0x0100000000000000 in the embedding config; "
      "feature_groups are {} in the checkpoint, {'ui': ['user', 'item']}")),
    ({"slots_config": dict(SLOTS, tags={"dim": 8})}, "slot 'tags': dim 3 in the checkpoint, 8 in the embedding config"),
    ({"slots_config": dict(SLOTS, tags={"dim": 3, "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 10}})},
     "slot 'tags': hash_stack_rounds 0 in the checkpoint, 2 in the embedding config"),
    ({"slots_config": {"a": {"dim": 4}}}, "have none in common"),
])
def test_a_config_that_moves_a_slots_rows_differs_naming_the_slot(config, why):
    found, _ = ckpt.layout_differences(layout(), ckpt.embedding_layout(load_embedding_config_from_dict(config)))
    assert found is not None and why in found, found


def test_slots_added_or_dropped_at_the_end_are_notes_not_differences():
    found, notes = ckpt.layout_differences(layout(), layout(dict(SLOTS, extra={"dim": 2})))
    assert found is None and notes == [("slot 'extra' is in the embedding config but not in the checkpoint: it has "
                                        "no rows there")]
    found, notes = ckpt.layout_differences(layout(), layout({"user": {"dim": 4}, "item": {"dim": 4}}))
    assert found is None and notes == ["slot 'tags' is in the checkpoint but not in the embedding config"]
    assert ckpt.layout_differences(layout(), layout()) == (None, [])


def test_the_top_level_marker_carries_the_layout_and_an_old_one_has_none(tmp_path):
    store = EmbeddingStore(100)
    store.lookup(np.arange(3, dtype=np.uint64), 4, True)
    store.dump(tmp_path, 0, replica_size=1)
    ckpt.mark_checkpoint_complete(tmp_path, 1)
    assert ckpt.checkpoint_layout(tmp_path) is None  # as written before the record existed
    ckpt.mark_checkpoint_complete(tmp_path, 1, layout())
    assert ckpt.checkpoint_layout(tmp_path) == layout()
    marker = tmp_path / ckpt.DONE_MARKER
    marker.write_text(json.dumps(dict(json.loads(marker.read_text()), embedding_layout={"slots": {"user": 4}})))
    with pytest.raises(ckpt.CheckpointError, match="malformed embedding_layout record"):
        ckpt.checkpoint_layout(tmp_path)
