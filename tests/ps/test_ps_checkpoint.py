"""Checkpoint files: round trips (same and different internal shard counts), re-sharding between
replica counts, refusal of incomplete, truncated, corrupt and foreign files with memory untouched,
and dumps that do not stop training."""

from __future__ import annotations

import json
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from persia.embedding_ps import AdagradConfig, AdamConfig, CheckpointError, EmbeddingStore, SGDConfig
from persia.embedding_ps import checkpoint as ckpt
from persia.embedding_ps.table import DimTable
from persia.hashing import PS_SHARD_SALT, shard_of

DIMS = (4, 7)


def _signs(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.unique(rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True))


def _trained_replicas(num: int, cfg=None, shards: int = 4) -> tuple[list[EmbeddingStore], dict]:
    """``num`` PS replicas holding the rows that route to them, trained a little; returns them and
    the expected rows ``{dim: (signs, weights)}`` of the whole job."""
    cfg = cfg or AdamConfig(lr=0.05)
    stores = []
    for _ in range(num):
        s = EmbeddingStore(10_000, shards, evict_fraction=0.0)
        s.register_optimizer(cfg)
        stores.append(s)
    expected = {}
    rng = np.random.default_rng(1)
    for dim in DIMS:
        signs = _signs(1500, dim)
        owner = shard_of(signs, num, PS_SHARD_SALT)
        for i, s in enumerate(stores):
            mine = signs[owner == i]
            s.lookup(mine, dim, True)
            s.update(mine, rng.standard_normal((len(mine), dim)).astype(np.float32))
            s.update(mine[::3], rng.standard_normal((len(mine[::3]), dim)).astype(np.float32))
        expected[dim] = (signs, np.concatenate([s.lookup(signs, dim, False)[None] for s in stores]).sum(axis=0))
    return stores, expected


def _dump_all(stores, directory: Path, workers: int = 3) -> None:
    for i, s in enumerate(stores):
        s.dump(directory, i, workers, replica_size=len(stores), fsync=False)
    ckpt.mark_checkpoint_complete(directory, len(stores))


@pytest.mark.parametrize("writers, readers", [(1, 1), (1, 2), (2, 1), (2, 3), (3, 2)])
def test_resharding_round_trip(tmp_path, writers, readers):
    stores, expected = _trained_replicas(writers)
    _dump_all(stores, tmp_path)
    loaded = []
    for j in range(readers):
        s = EmbeddingStore(10_000, 3)  # a different internal shard count too
        s.register_optimizer(AdamConfig(lr=0.05))
        s.load(tmp_path, j, readers, num_workers=2)
        loaded.append(s)
    for dim, (signs, weights) in expected.items():
        owner = shard_of(signs, readers, PS_SHARD_SALT)
        for j, s in enumerate(loaded):
            mine = owner == j
            assert s.contains(signs, dim).tolist() == mine.tolist()  # each row on its replica only
            np.testing.assert_array_equal(s.lookup(signs[mine], dim, False), weights[mine])
    assert sum(len(s) for s in loaded) == sum(len(s) for s in stores)


def test_optimizer_state_survives_a_round_trip(tmp_path):
    (store,), _ = _trained_replicas(1, AdamConfig(lr=0.05))
    _dump_all([store], tmp_path)
    clone = EmbeddingStore(10_000, 7)
    clone.load(tmp_path, 0, 1)  # no optimizer registered yet: the state is kept as written
    clone.register_optimizer(AdamConfig(lr=0.05))  # same kind of state: still kept
    signs = _signs(1500, 4)
    grads = np.random.default_rng(9).standard_normal((len(signs), 4)).astype(np.float32)
    store.update(signs, grads)
    clone.update(signs, grads)
    np.testing.assert_array_equal(clone.lookup(signs, 4, False), store.lookup(signs, 4, False))
    for dim in DIMS:
        a, b = store.read_rows(_signs(1500, dim), dim), clone.read_rows(_signs(1500, dim), dim)
        np.testing.assert_array_equal(a[2], b[2])


def test_state_of_another_optimizer_is_reset_on_load(tmp_path):
    (store,), expected = _trained_replicas(1, AdamConfig(lr=0.05))
    _dump_all([store], tmp_path)
    other = EmbeddingStore(10_000, 2)
    other.register_optimizer(AdagradConfig(initial_accumulator_value=0.5))
    other.load(tmp_path, 0, 1)
    signs, weights = expected[4]
    found, w, state, _ = other.read_rows(signs, 4)
    np.testing.assert_array_equal(w, weights)
    np.testing.assert_array_equal(state, 0.5)


def test_dump_replaces_an_older_dump_of_the_same_replica(tmp_path):
    store = EmbeddingStore(100, 2)
    store.lookup(np.arange(50, dtype=np.uint64), 3, True)
    store.lookup(np.arange(10, dtype=np.uint64), 5, True)
    store.dump(tmp_path, 0, fsync=False)
    assert len(list((tmp_path / "s0").glob("*.emb"))) == 4  # two internal shards x two dims
    store.clear()
    store.lookup(np.arange(5, dtype=np.uint64), 3, True)
    store.dump(tmp_path, 0, fsync=False)
    again = EmbeddingStore(100, 1)
    again.load(tmp_path, 0, 1)
    assert len(again) == 5 and again.dims() == [3]
    manifest = json.loads((tmp_path / "s0" / ckpt.DONE_MARKER).read_text())
    assert manifest["rows"] == 5 and manifest["format"] == ckpt.MANIFEST_FORMAT


def test_empty_store_round_trip(tmp_path):
    EmbeddingStore(10).dump(tmp_path, 0, fsync=False)
    s = EmbeddingStore(10)
    s.lookup(np.array([1], np.uint64), 2, True)
    s.load(tmp_path, 0, 1)
    assert len(s) == 0


def test_more_rows_than_capacity_is_refused(tmp_path):
    (store,), _ = _trained_replicas(1)
    _dump_all([store], tmp_path)
    small = EmbeddingStore(100)
    with pytest.raises(ValueError, match=r"holds \d+ rows for replica 0/1, more than this PS's capacity of 100 rows"):
        small.load(tmp_path, 0, 1)


# -- refusals -----------------------------------------------------------------------------------
def _one_file(directory: Path) -> Path:
    return sorted((directory / "s0").glob("*.emb"))[0]


def _rewrite_header(path: Path, **changes) -> None:
    raw = bytearray(path.read_bytes())
    fields = list(ckpt._HEADER.unpack(bytes(raw[: ckpt.HEADER_SIZE])))
    names = ["magic", "version", "header_len", "kind", "code", "dim", "width", "rows", "payload", "crc",
             "r1", "created", "r2", "hcrc"]
    for name, value in changes.items():
        fields[names.index(name)] = value
    body = ckpt._HEADER.pack(*fields)[:-4]
    raw[: ckpt.HEADER_SIZE] = body + struct.pack("<I", zlib.crc32(body))
    path.write_bytes(bytes(raw))


def _edit_manifest(path: Path, **changes) -> None:
    manifest = json.loads(path.read_text())
    manifest["files"][0].update(changes)
    path.write_text(json.dumps(manifest))


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


CORRUPTIONS = {
    "payload byte": (lambda d: _flip(_one_file(d), ckpt.HEADER_SIZE + 100), r"payload checksum mismatch"),
    "header byte": (lambda d: _flip(_one_file(d), 20), r"header checksum mismatch"),
    "truncated": (lambda d: _one_file(d).write_bytes(_one_file(d).read_bytes()[:-7]), r"truncated: \d+ bytes, header says"),
    "truncated header": (lambda d: _one_file(d).write_bytes(_one_file(d).read_bytes()[:30]), r"truncated header"),
    "trailing bytes": (lambda d: _one_file(d).write_bytes(_one_file(d).read_bytes() + b"xx"), r"has trailing bytes"),
    "foreign file": (lambda d: _one_file(d).write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(500)), r"not a PERSIA embedding file"),
    "newer version": (lambda d: _rewrite_header(_one_file(d), version=2), r"format version 2; this PS reads up to 1"),
    "manifest disagrees": (lambda d: _edit_manifest(d / "s0" / ckpt.DONE_MARKER, rows=3),
                           r"header rows=\d+ but the manifest says 3"),
    "file missing": (lambda d: _one_file(d).unlink(), r"listed in the manifest but missing"),
    "no done marker": (lambda d: (d / "s0" / ckpt.DONE_MARKER).unlink(), r"incomplete: no embedding_dump_done marker"),
    "replica missing": (lambda d: __import__("shutil").rmtree(d / "s1"), r"incomplete: replica directories \['s1'\] missing of 2"),
    "not a checkpoint": (lambda d: [p.unlink() for p in d.rglob("*") if p.is_file()] and None, r"(no embedding_dump_done|no replica)"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_refused_checkpoints_leave_the_store_untouched(tmp_path, name):
    stores, _ = _trained_replicas(2, AdamConfig(lr=0.05))
    _dump_all(stores, tmp_path)
    spoil, match = CORRUPTIONS[name]
    spoil(tmp_path)
    victim = EmbeddingStore(10_000, 2)
    victim.register_optimizer(SGDConfig(lr=0.1))
    keep = np.arange(100, 160, dtype=np.uint64)
    before = victim.lookup(keep, 4, True)
    with pytest.raises(CheckpointError, match=match):
        victim.load(tmp_path, 0, 2)
    assert len(victim) == 60 and victim.dims() == [4]
    np.testing.assert_array_equal(victim.lookup(keep, 4, False), before)


def test_duplicate_signs_in_a_checkpoint_are_refused():
    signs = np.array([5, 9, 5], dtype=np.uint64)
    with pytest.raises(ValueError, match="sign 5 is already in the index"):
        DimTable.from_parts(2, 1, [(signs, np.zeros((3, 2), np.float32), np.zeros((3, 0), np.float32))],
                            0, 0.0, 10, 1)


def test_incremental_packet_is_not_a_checkpoint_file(tmp_path):
    path = tmp_path / "x.emb"
    ckpt.write_rows_file(path, np.arange(3, dtype=np.uint64), np.ones((3, 2), np.float32), np.zeros((3, 0), np.float32),
                         0, kind=ckpt.KIND_INCREMENTAL, fsync=False)
    header, part = ckpt.read_rows_file(path)
    assert header.kind == ckpt.KIND_INCREMENTAL and part.weights.shape == (3, 2)


# -- dumping while training -----------------------------------------------------------------------
def test_dump_holds_one_internal_shard_at_a_time(tmp_path, monkeypatch):
    """While the dump copies shard 0 (paused inside the copy), an update of a row in another
    shard completes; the dump then finishes and loads."""
    store = EmbeddingStore(1000, 4)
    store.register_optimizer(SGDConfig(lr=1.0))
    signs = np.arange(400, dtype=np.uint64)
    store.lookup(signs, 3, True)
    from persia.embedding_ps import index as ix

    shard = ix.shard_ids(ix.sign_hash(signs), 4)
    other = signs[shard == 3][:5]
    inside, release = threading.Event(), threading.Event()
    original = DimTable.snapshot_region

    def slow_snapshot(self, k):
        if k == 0:
            inside.set()
            assert release.wait(30)
        return original(self, k)

    monkeypatch.setattr(DimTable, "snapshot_region", slow_snapshot)
    dumper = threading.Thread(target=store.dump, args=(tmp_path, 0, 1), kwargs={"fsync": False})
    dumper.start()
    assert inside.wait(30)
    before = store.lookup(other, 3, False)
    assert store.update(other, np.ones((5, 3), np.float32)) == 0  # shard 3 is not blocked
    np.testing.assert_array_equal(store.lookup(other, 3, False), before - 1)
    release.set()
    dumper.join(30)
    fresh = EmbeddingStore(1000, 2)
    fresh.load(tmp_path, 0, 1)
    assert len(fresh) == 400


def test_dump_during_concurrent_updates_is_loadable(tmp_path):
    store = EmbeddingStore(5000, 8)
    store.register_optimizer(SGDConfig(lr=0.01))
    signs = np.arange(4000, dtype=np.uint64)
    store.lookup(signs, 4, True)
    untouched, busy = signs[:2000], signs[2000:]
    expected = store.lookup(untouched, 4, False)
    stop = threading.Event()

    def train():
        while not stop.is_set():
            store.update(busy, np.ones((len(busy), 4), np.float32))

    worker = threading.Thread(target=train)
    worker.start()
    try:
        store.dump(tmp_path, 0, 4, fsync=False)
    finally:
        stop.set()
        worker.join(30)
    fresh = EmbeddingStore(5000, 3)
    fresh.load(tmp_path, 0, 1)
    assert len(fresh) == 4000
    np.testing.assert_array_equal(fresh.lookup(untouched, 4, False), expected)
