"""read_chunks batching, sharding and schema checks; the vocabulary index of the baselines."""

from __future__ import annotations

import numpy as np
import pytest

from synthetic_ctr.reader import VocabIndex, iter_chunks, load_chunk, load_vocab, read_chunks


def _all(data_dir, split="train"):
    chunks = list(iter_chunks(data_dir, split))
    return np.concatenate([c.ids for c in chunks]), np.concatenate([c.label for c in chunks])


def test_batches_span_chunks_and_cover_every_row_once(small_dataset):
    out, _ = small_dataset
    batches = list(read_chunks(out, 300))
    assert [b.ids.shape[0] for b in batches] == [300] * 8 + [100]
    ids, labels = _all(out)
    assert np.array_equal(np.concatenate([b.ids for b in batches]), ids)
    assert np.array_equal(np.concatenate([b.label for b in batches]), labels)


def test_max_rows_and_drop_last(small_dataset):
    out, _ = small_dataset
    assert sum(b.ids.shape[0] for b in read_chunks(out, 256, max_rows=1100)) == 1100
    assert [b.ids.shape[0] for b in read_chunks(out, 1000, max_rows=2500, drop_last=True)] == [1000, 1000]
    assert [b.ids.shape[0] for b in read_chunks(out, 4096, split="test")] == [1500]


def test_replicas_partition_the_batches(small_dataset):
    out, _ = small_dataset
    whole = list(read_chunks(out, 200))
    parts = [list(read_chunks(out, 200, replica_index=i, replica_size=3)) for i in range(3)]
    assert sum(len(p) for p in parts) == len(whole)
    for i, part in enumerate(parts):
        for j, batch in enumerate(part):
            assert np.array_equal(batch.ids, whole[i + 3 * j].ids)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"batch_size": 0}, "batch_size"), ({"batch_size": 8, "max_rows": 0}, "max_rows"),
     ({"batch_size": 8, "replica_index": 2, "replica_size": 2}, "replica_index")],
)  # fmt: skip
def test_bad_arguments_name_the_field(small_dataset, kwargs, field):
    out, _ = small_dataset
    with pytest.raises(ValueError, match=field):
        list(read_chunks(out, **kwargs))


def test_chunk_with_wrong_schema_is_rejected_with_file_and_field(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, dense=np.zeros((4, 13), np.float32), ids=np.zeros((4, 26), np.int64), label=np.zeros((4, 1), np.float32))
    with pytest.raises(ValueError, match=r"bad\.npz.*'ids'.*int64"):
        load_chunk(bad)
    missing = tmp_path / "missing.npz"
    np.savez(missing, dense=np.zeros((4, 13), np.float32))
    with pytest.raises(ValueError, match="lacks arrays"):
        load_chunk(missing)


def test_missing_dataset_says_which_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_dir"):
        list(read_chunks(tmp_path / "nowhere", 10))


def test_vocab_index_maps_into_slot_ranges_and_unknown_ids_to_oov(small_dataset):
    out, _ = small_dataset
    index = VocabIndex(load_vocab(out))
    ids, _ = _all(out)
    rows = index.rows(ids)
    lo, hi = index.offsets, index.offsets + index.slot_rows - 1
    assert ((rows >= lo) & (rows < hi)).all()  # every training ID is in vocabulary
    assert len(np.unique(rows[:, 0])) == len(np.unique(ids[:, 0]))  # distinct IDs, distinct rows
    unknown = ids[:3].copy()
    unknown[:, 4] ^= np.uint64(0x5A5A5A5A5A5A5A5A)
    assert (index.rows(unknown)[:, 4] == index.oov_rows[4]).all()
    assert np.array_equal(index.local_rows(ids), rows - index.offsets)
