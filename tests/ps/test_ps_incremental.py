"""Incremental updates: a training store ships changed rows as packets; an inference store (with a
different replica count) applies them and serves the trained values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from persia.embedding_ps import AdagradConfig, EmbeddingStore
from persia.embedding_ps import checkpoint as ckpt
from persia.embedding_ps.incremental import (
    INC_DONE_MARKER,
    IncrementalApplier,
    IncrementalDumper,
    apply_incremental_updates,
    complete_packets,
    packet_time,
)
from persia.hashing import PS_SHARD_SALT, shard_of


def _trainer(replica_index: int, replicas: int, directory, buffer_size: int):
    store = EmbeddingStore(10_000, 3)
    store.register_optimizer(AdagradConfig(lr=0.1))
    dumper = IncrementalDumper(store, directory, replica_index, buffer_size, num_workers=3, fsync=False)
    return store, dumper


def test_packets_are_written_once_enough_distinct_rows_changed(tmp_path):
    store, dumper = _trainer(0, 1, tmp_path, buffer_size=100)
    try:
        signs = np.arange(60, dtype=np.uint64)
        store.lookup(signs, 4, True)
        store.update(signs, np.ones((60, 4), np.float32))
        store.update(signs, np.ones((60, 4), np.float32))  # the same 60 again: still below 100
        assert complete_packets(tmp_path) == []
        more = np.arange(60, 130, dtype=np.uint64)
        store.lookup(more, 4, True)
        store.update(more, np.ones((70, 4), np.float32))
        dumper.flush()  # waits for the packet the buffer triggered
        packets = complete_packets(tmp_path)
        assert len(packets) == 1 and packets[0].parent.name == "s0" and packets[0].name.startswith("inc_")
        manifest = json.loads((packets[0] / INC_DONE_MARKER).read_text())
        assert manifest["rows"] == 130 and len(manifest["files"]) == 3  # split over num_workers files
        dumper.flush()  # nothing pending: no new packet
        assert len(complete_packets(tmp_path)) == 1
    finally:
        dumper.close()


def test_inference_store_follows_training_through_packets(tmp_path):
    trainers = [_trainer(i, 2, tmp_path, buffer_size=10**6) for i in range(2)]
    signs = np.arange(1000, 1400, dtype=np.uint64)
    owner = shard_of(signs, 2, PS_SHARD_SALT)
    rng = np.random.default_rng(0)
    try:
        for step in range(3):
            for i, (store, dumper) in enumerate(trainers):
                mine = signs[owner == i]
                store.lookup(mine, 8, True)
                store.update(mine, rng.standard_normal((len(mine), 8)).astype(np.float32))
                dumper.flush()
        expected = sum(store.lookup(signs, 8, False) for store, _ in trainers)
    finally:
        for _, dumper in trainers:
            dumper.close()
    servers = [EmbeddingStore(10_000, 2) for _ in range(3)]  # 2 training replicas -> 3 serving ones
    appliers = [IncrementalApplier(s, tmp_path, j, 3) for j, s in enumerate(servers)]
    assert all(a.poll() > 0 for a in appliers)
    serving_owner = shard_of(signs, 3, PS_SHARD_SALT)
    for j, s in enumerate(servers):
        mine = serving_owner == j
        assert s.contains(signs, 8).tolist() == mine.tolist()
        np.testing.assert_array_equal(s.lookup(signs[mine], 8, False), expected[mine])
    assert all(a.poll() == 0 for a in appliers)  # nothing new
    assert len(appliers[0].applied) == 6 and appliers[0].last_delay_sec is not None


def test_newer_packets_overwrite_older_values(tmp_path):
    store, dumper = _trainer(0, 1, tmp_path, buffer_size=10**6)
    server = EmbeddingStore(100)
    applied: set[str] = set()
    signs = np.array([7, 8], dtype=np.uint64)
    try:
        store.lookup(signs, 2, True)
        for _ in range(2):
            store.update(signs, np.ones((2, 2), np.float32))
            dumper.flush()
            applied = apply_incremental_updates(server, tmp_path, 0, 1, applied)
            np.testing.assert_array_equal(server.lookup(signs, 2, False), store.lookup(signs, 2, False))
    finally:
        dumper.close()
    assert len(applied) == 2


def test_close_ships_what_is_pending_and_detaches(tmp_path):
    store, dumper = _trainer(0, 1, tmp_path, buffer_size=10**6)
    signs = np.arange(5, dtype=np.uint64)
    store.lookup(signs, 3, True)
    store.update(signs, np.ones((5, 3), np.float32))
    dumper.close()
    assert len(complete_packets(tmp_path)) == 1
    store.update(signs, np.ones((5, 3), np.float32))  # no longer listened to
    assert len(complete_packets(tmp_path)) == 1


def test_record_without_dim_finds_rows_in_every_dim(tmp_path):
    store = EmbeddingStore(100)
    dumper = IncrementalDumper(store, tmp_path, 0, 10**6, attach=False, fsync=False)
    try:
        store.lookup(np.array([1, 2], np.uint64), 2, True)
        store.lookup(np.array([2, 3], np.uint64), 5, True)
        dumper.record(np.array([2, 3, 99], np.uint64))
        dumper.flush()
    finally:
        dumper.close()
    server = EmbeddingStore(100)
    assert IncrementalApplier(server, tmp_path, 0, 1).poll() == 3  # sign 2 of dim 2, signs 2 and 3 of dim 5
    assert server.contains(np.array([2], np.uint64), 2).all() and server.contains(np.array([2, 3], np.uint64), 5).all()


def test_unfinished_and_corrupt_packets(tmp_path):
    store, dumper = _trainer(0, 1, tmp_path, buffer_size=10**6)
    signs = np.arange(20, dtype=np.uint64)
    try:
        store.lookup(signs, 4, True)
        store.update(signs, np.ones((20, 4), np.float32))
        dumper.flush()
    finally:
        dumper.close()
    (packet,) = complete_packets(tmp_path)
    unfinished = packet.parent / "inc_29990101000000_000000_000001"
    unfinished.mkdir()  # no done marker: not a packet yet
    file = sorted(packet.glob("*.inc"))[0]
    raw = bytearray(file.read_bytes())
    raw[ckpt.HEADER_SIZE + 3] ^= 1
    file.write_bytes(bytes(raw))
    server = EmbeddingStore(100)
    applier = IncrementalApplier(server, tmp_path, 0, 1)
    assert applier.poll() == 0 and len(server) == 0
    assert len(applier.rejected) == 1 and applier.poll() == 0  # not retried


def test_bad_arguments():
    with pytest.raises(ValueError, match="incremental_buffer_size must be positive, got 0"):
        IncrementalDumper(EmbeddingStore(10), "unused", 0, 0)
    with pytest.raises(ValueError, match=r"replica_index 2 is not in \[0, replica_size=2\)"):
        IncrementalApplier(EmbeddingStore(10), "unused", 2, 2)


def test_packets_older_than_the_retention_are_deleted_and_forgotten(tmp_path):
    """PERSIA kept every packet (a packet per incremental_buffer_size changed rows, until the disk
    filled), and the inference side remembered and listed every name for ever."""
    store, dumper = _trainer(0, 1, tmp_path, buffer_size=10**6)
    dumper.retention_s = 3600.0
    server = EmbeddingStore(10_000, 2)
    applier = IncrementalApplier(server, tmp_path, 0, 1)
    try:
        signs = np.arange(50, dtype=np.uint64)
        store.lookup(signs, 4, True)
        store.update(signs, np.ones((50, 4), np.float32))
        dumper.flush()
        [first] = complete_packets(tmp_path)
        assert applier.poll() == 50
        # as if written two hours ago (the name carries the time), and another replica's old one
        old = first.with_name("inc_20200101000000_000000_000001")
        first.rename(old)
        others = tmp_path / "s1" / "inc_20200101000000_000000_000001"
        others.mkdir(parents=True)
        assert applier.poll() == 50  # the renamed packet is new to it: applied again, harmlessly
        store.update(signs, np.ones((50, 4), np.float32))
        dumper.flush()  # writes a packet, then deletes its own older than an hour
        remaining = list((tmp_path / "s0").iterdir())
        assert len(remaining) == 1 and remaining[0].name != old.name and not old.exists()
        assert others.exists() and dumper.packets_deleted == 1  # another replica's are its own to delete
        applier.poll()
        assert len(applier.applied) == 1 and applier.packets_applied == 3  # the deleted one forgotten, still counted
    finally:
        dumper.close()
    assert packet_time("inc_20200101000000_000001_000007") == pytest.approx(1577836800.000001)
    assert packet_time("dim_4_part_0.inc") is None and packet_time("inc_2020_x_1") is None
