"""The synthetic Criteo-schema generator: ID mixing, Zipf ranks, schema, reproducibility, teacher."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from synthetic_ctr.generate import generate_dataset, zipf_ranks
from synthetic_ctr.idmix import ids_for, mix64, slot_rank_of, unmix64
from synthetic_ctr.manifest import GeneratorConfig, load_manifest
from synthetic_ctr.reader import iter_chunks, load_vocab
from synthetic_ctr.schema import CRITEO_KAGGLE_CARDINALITIES, NUM_DENSE, NUM_SLOTS, scaled_cardinalities


@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=50))
def test_mix64_is_inverted_by_unmix64(values):
    x = np.array(values, dtype=np.uint64)
    assert np.array_equal(unmix64(mix64(x)), x)


def test_ids_spread_over_full_uint64_range_and_map_back_to_slot_and_rank():
    ranks = np.arange(100_000)
    ids = ids_for(5, ranks)
    assert len(np.unique(ids)) == len(ids)
    top_bit_share = float(np.mean(ids >= np.uint64(1 << 63)))
    assert 0.45 < top_bit_share < 0.55  # consecutive ranks land all over the range
    slot, rank = slot_rank_of(ids)
    assert (slot == 5).all() and np.array_equal(rank, ranks)
    assert not np.intersect1d(ids, ids_for(6, ranks)).size  # slots do not share IDs


def test_zipf_ranks_stay_in_range_and_favour_low_ranks():
    rng = np.random.default_rng(0)
    r = zipf_ranks(rng, 200_000, 1000, 1.1)
    assert r.min() >= 0 and r.max() <= 999
    counts = np.bincount(r, minlength=1000)
    assert counts[0] > counts[1] > counts[3] > counts[10] > counts[100]
    assert counts[:10].sum() > counts[500:].sum()  # heavy head, long tail


def test_scaled_cardinalities_keep_small_slots_and_shrink_big_ones():
    cards = scaled_cardinalities(0.01, floor=1000)
    assert len(cards) == NUM_SLOTS
    for orig, card in zip(CRITEO_KAGGLE_CARDINALITIES, cards):
        if orig <= 1000:
            assert card == orig
        else:
            assert 1000 <= card <= orig and card == max(1000, -(-orig // 100))
    with pytest.raises(ValueError, match="scale"):
        scaled_cardinalities(0.0)


def test_dataset_schema_manifest_and_vocab(small_dataset):
    out, manifest = small_dataset
    assert manifest.splits["train"].rows == 2500 and len(manifest.splits["train"].files) == 3
    assert manifest.splits["test"].rows == 1500 and len(manifest.splits["test"].files) == 2
    chunks = list(iter_chunks(out, "train"))
    assert [c.dense.shape[0] for c in chunks] == [1000, 1000, 500]
    for c in chunks:
        assert c.dense.dtype == np.float32 and c.dense.shape[1] == NUM_DENSE
        assert c.ids.dtype == np.uint64 and c.ids.shape[1] == NUM_SLOTS
        assert c.label.dtype == np.float32 and c.label.shape[1] == 1
        assert set(np.unique(c.label)) <= {0.0, 1.0}
    ids = np.concatenate([c.ids for c in chunks])
    slot, rank = slot_rank_of(ids)
    assert (slot == np.arange(NUM_SLOTS)).all()
    assert (rank < np.array(manifest.cardinalities)).all()
    vocab = load_vocab(out)
    for s in range(NUM_SLOTS):
        assert np.array_equal(vocab[s], np.unique(ids[:, s]))
    assert abs(manifest.splits["train"].positive_rate - 0.25) < 0.05
    assert load_manifest(out) == manifest


def test_teacher_auc_is_high_and_recorded(small_dataset):
    _, manifest = small_dataset
    # labels come from the teacher's probabilities, so the teacher ranks them well
    assert 0.75 < manifest.teacher.test_auc < 0.95
    assert manifest.teacher.test_logloss < 0.5623  # better than predicting the base rate 0.25


def _arrays(path):
    return [tuple(c) for c in iter_chunks(path, "train")] + [tuple(c) for c in iter_chunks(path, "test")]


def test_generation_is_reproducible_and_seeded(tmp_path):
    cfg = GeneratorConfig(train_rows=1200, test_rows=300, chunk_rows=500, scale=0.001, seed=3)
    a = generate_dataset(tmp_path / "a", cfg)
    b = generate_dataset(tmp_path / "b", cfg)
    for x, y in zip(_arrays(tmp_path / "a"), _arrays(tmp_path / "b")):
        for u, v in zip(x, y):
            assert np.array_equal(u, v)
    assert a.teacher == b.teacher
    other = generate_dataset(tmp_path / "c", cfg.model_copy(update={"seed": 4}))
    assert not np.array_equal(_arrays(tmp_path / "a")[0][1], _arrays(tmp_path / "c")[0][1])
    assert other.teacher.logit_bias != a.teacher.logit_bias


def test_existing_dataset_is_reused_only_for_the_same_config(tmp_path):
    cfg = GeneratorConfig(train_rows=600, test_rows=200, chunk_rows=500, scale=0.001)
    generate_dataset(tmp_path, cfg)
    chunk = tmp_path / "train" / "part-00000.npz"
    stamp = chunk.stat().st_mtime_ns
    generate_dataset(tmp_path, cfg)
    assert chunk.stat().st_mtime_ns == stamp
    bigger = generate_dataset(tmp_path, cfg.model_copy(update={"train_rows": 700}))
    assert bigger.splits["train"].rows == 700
    assert sum(c.dense.shape[0] for c in iter_chunks(tmp_path, "train")) == 700


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="zipf_exponent"):
        GeneratorConfig(train_rows=10, test_rows=10, zipf_exponent=1.0)
    with pytest.raises(ValueError, match="train_rows"):
        GeneratorConfig(train_rows=0, test_rows=10)
