"""Incremental updates must not fail silently: a packet that cannot be written keeps its rows for
the next one (counted, reported by flush/close), an inference PS whose ``incremental_dir`` is
missing says so (a log line per change, a stats gauge), and a bad poll interval is refused by name."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from persia.config import load_global_config_from_dict
from persia.embedding_ps import AdagradConfig, EmbeddingStore
from persia.embedding_ps import checkpoint as ckpt
from persia.embedding_ps.incremental import (
    POLL_ENV,
    IncrementalApplier,
    IncrementalDumper,
    complete_packets,
    poll_interval_s,
)
from persia.embedding_ps.service import EmbeddingParameterServer

from tests.polling import poll_until

LOGGER = "persia.embedding_ps.incremental"


class _Disk:
    """``checkpoint.write_rows_file`` that fails (disk full) while ``full`` is set."""

    def __init__(self, monkeypatch):
        self.full = False
        self._write = ckpt.write_rows_file
        monkeypatch.setattr(ckpt, "write_rows_file", self)

    def __call__(self, *args, **kwargs):
        if self.full:
            raise OSError(28, "No space left on device")
        return self._write(*args, **kwargs)


def _train(store: EmbeddingStore, signs: np.ndarray, dim: int = 4) -> None:
    store.lookup(signs, dim, True)
    store.update(signs, np.ones((signs.shape[0], dim), np.float32))


def _trainer(directory, buffer_size: int, **kwargs):
    store = EmbeddingStore(10_000)
    store.register_optimizer(AdagradConfig(lr=0.1))
    return store, IncrementalDumper(store, directory, 0, buffer_size, num_workers=2, fsync=False, **kwargs)


def _served(directory, signs: np.ndarray, dim: int = 4) -> EmbeddingStore:
    server = EmbeddingStore(10_000)
    IncrementalApplier(server, directory, 0, 1).poll()
    assert server.contains(signs, dim).all(), "rows of the failed packet never arrived"
    return server


def test_rows_of_a_failed_flush_arrive_in_the_next_packet(tmp_path, monkeypatch):
    disk = _Disk(monkeypatch)
    store, dumper = _trainer(tmp_path, buffer_size=10**6)
    first, later = np.arange(20, dtype=np.uint64), np.arange(100, 105, dtype=np.uint64)
    try:
        _train(store, first)
        disk.full = True
        with pytest.raises(RuntimeError, match="20 changed signs pending: .*No space left on device"):
            dumper.flush()
        assert dumper.write_failures == 1 and dumper.packets_written == 0
        assert complete_packets(tmp_path) == [] and list((tmp_path / "s0").iterdir()) == []  # no half packet
        disk.full = False
        _train(store, later)
        dumper.flush()  # no error: the retry succeeded
        assert dumper.last_error is None and dumper.write_failures == 1
    finally:
        dumper.close()
    assert len(complete_packets(tmp_path)) == 1 and dumper.rows_written == 25
    signs = np.concatenate([first, later])
    np.testing.assert_array_equal(_served(tmp_path, signs).lookup(signs, 4, False), store.lookup(signs, 4, False))


def test_a_failed_buffered_packet_is_retried_by_a_later_one(tmp_path, monkeypatch):
    """No flush at all: the writer thread's own packet fails, and the next one carries its rows."""
    disk = _Disk(monkeypatch)
    store, dumper = _trainer(tmp_path, buffer_size=10)
    first, later = np.arange(15, dtype=np.uint64), np.arange(50, 60, dtype=np.uint64)
    try:
        disk.full = True
        _train(store, first)
        poll_until(lambda: dumper.write_failures == 1, "the buffered packet's write failed")
        disk.full = False
        _train(store, later)
        poll_until(lambda: dumper.packets_written == 1, "a later packet was written")
        assert dumper.rows_written == 25 and dumper.write_failures == 1
    finally:
        dumper.close()
    _served(tmp_path, np.concatenate([first, later]))


def test_close_reports_rows_it_could_not_ship(tmp_path, monkeypatch):
    disk = _Disk(monkeypatch)
    store, dumper = _trainer(tmp_path, buffer_size=10**6)
    _train(store, np.arange(7, dtype=np.uint64))
    disk.full = True
    with pytest.raises(RuntimeError, match="failed at shutdown: 7 changed signs not shipped"):
        dumper.close()
    assert dumper.write_failures == 1 and complete_packets(tmp_path) == []


def test_rows_kept_for_a_retry_are_bounded(tmp_path, monkeypatch, caplog):
    disk = _Disk(monkeypatch)
    store, dumper = _trainer(tmp_path, buffer_size=10**6, max_retained=8)
    try:
        _train(store, np.arange(20, dtype=np.uint64))
        disk.full = True
        with caplog.at_level(logging.ERROR, logger=LOGGER), pytest.raises(RuntimeError, match="8 changed signs"):
            dumper.flush()
        assert dumper.rows_dropped == 12 and "12 changed signs dropped" in caplog.text
        disk.full = False
        dumper.flush()
    finally:
        dumper.close()
    assert dumper.rows_written == 8 and dumper.write_failures == 1


def test_changes_pending_while_no_packet_is_written_stay_bounded(tmp_path, caplog):
    """While no packet is written (a write that hangs; here the buffer is never reached), every
    update's signs were kept, copies included, until memory ran out: they are deduplicated in
    place, and past max_retained distinct signs the rest are dropped, logged and counted."""
    store, dumper = _trainer(tmp_path, buffer_size=10**6, max_retained=8, attach=False)
    try:
        for _ in range(100):  # the same 5 rows updated again and again
            dumper.record(np.arange(5, dtype=np.uint64), 4)
        assert dumper._pending_count <= 2 * 8 and dumper.rows_dropped == 0
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            for i in range(10):
                dumper.record(np.arange(100 + 10 * i, 110 + 10 * i, dtype=np.uint64), 4)
        assert dumper._pending_count <= 2 * 8 and dumper.rows_dropped > 0 and "changed signs dropped" in caplog.text
    finally:
        dumper.close()


def test_a_missing_incremental_dir_is_logged_once_per_change(tmp_path, caplog):
    directory = tmp_path / "typo"
    applier = IncrementalApplier(EmbeddingStore(10), directory, 0, 1)

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]

    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            assert applier.poll() == 0
        assert applier.dir_missing
        [message] = errors()  # not one per poll
        assert str(directory) in message and "embedding_parameter_server_config.incremental_dir" in message
        directory.mkdir()
        applier.poll()
        assert not applier.dir_missing and len(errors()) == 1
        assert any("exists now" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        directory.rmdir()
        applier.poll()
        applier.poll()
        assert applier.dir_missing and len(errors()) == 2  # gone again: said again, once


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "10s", "1e9"])
def test_a_bad_poll_interval_is_refused_by_name(raw):
    with pytest.raises(ValueError, match=rf"{POLL_ENV} must be a number of seconds from 0.01 to 86400, got '{raw}'"):
        poll_interval_s({POLL_ENV: raw})


def test_poll_interval_default_and_value():
    assert poll_interval_s({}) == 10.0 and poll_interval_s({POLL_ENV: " "}) == 10.0
    assert poll_interval_s({POLL_ENV: "0.5"}) == 0.5
    for interval in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive number of seconds"):
            IncrementalApplier(EmbeddingStore(10), "unused", 0, 1).start(interval)


def _config(tmp_path, job_type: str) -> dict:
    return {"common_config": {"job_type": job_type},
            "embedding_parameter_server_config": {"enable_incremental_update": True, "incremental_buffer_size": 10**6,
                                                  "incremental_dir": str(tmp_path / "inc")}}


def test_inference_ps_refuses_a_bad_poll_interval_before_serving(tmp_path, monkeypatch):
    monkeypatch.setenv(POLL_ENV, "0")
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match=POLL_ENV):
        EmbeddingParameterServer(load_global_config_from_dict(_config(tmp_path, "Infer")), 0, 1, port=0)
    assert "ps-incremental-apply" not in {t.name for t in threading.enumerate()} - before


def test_inference_ps_stats_say_whether_incremental_dir_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv(POLL_ENV, "0.05")
    ps = EmbeddingParameterServer(load_global_config_from_dict(_config(tmp_path, "Infer")), 0, 1, port=0)
    try:
        poll_until(lambda: ps.stats()["incremental_dir_missing"] == 1, "incremental_dir_missing became 1")
        (tmp_path / "inc").mkdir()
        poll_until(lambda: ps.stats()["incremental_dir_missing"] == 0, "incremental_dir_missing went back to 0")
    finally:
        ps.stop()


def test_training_ps_stats_count_failed_writes_and_stop_reports_lost_rows(tmp_path, monkeypatch):
    disk = _Disk(monkeypatch)
    ps = EmbeddingParameterServer(load_global_config_from_dict(_config(tmp_path, "Train")), 0, 1, port=0)
    ps.configure({})
    ps.register_optimizer({"type": "Adagrad", "lr": 0.1})
    assert ps.stats()["incremental_write_failures"] == 0 and ps.stats()["incremental_rows_dropped"] == 0
    _train(ps.store, np.arange(3, dtype=np.uint64))
    disk.full = True
    with pytest.raises(RuntimeError, match="failed at shutdown: 3 changed signs not shipped"):
        ps.stop()
    assert ps.stats()["incremental_write_failures"] == 1


def test_a_packet_a_killed_writer_left_half_written_is_removed_once_it_is_old(tmp_path, monkeypatch):
    """A PS SIGKILLed mid-packet leaves a directory without its done marker, which no reader
    applies; its replica's next writer removes it, at its start or after a packet of its own, once
    it is older than INCOMPLETE_GRACE_S (never one still being written). Complete packets stay,
    and so does another replica's."""
    import datetime as dt
    import time

    from persia.embedding_ps import incremental
    from persia.embedding_ps.incremental import INC_DONE_MARKER, INCOMPLETE_GRACE_S, abandoned_packet

    def packet(replica: int, age_s: float, complete: bool):
        t = dt.datetime.fromtimestamp(time.time() - age_s, dt.timezone.utc)
        d = tmp_path / f"s{replica}" / f"inc_{t:%Y%m%d%H%M%S}_{t.microsecond:06d}_000001"
        d.mkdir(parents=True)
        (d / "dim_4_part_0.inc").write_bytes(b"half")
        if complete:
            (d / INC_DONE_MARKER).write_text("{}")
        return d

    old_half, new_half = packet(0, 2 * INCOMPLETE_GRACE_S, False), packet(0, 5, False)
    old_done, other_half = packet(0, 2 * INCOMPLETE_GRACE_S, True), packet(1, 2 * INCOMPLETE_GRACE_S, False)
    store, dumper = _trainer(tmp_path, buffer_size=2)
    try:
        assert dumper.incomplete_removed == 1
        assert not old_half.exists() and new_half.exists() and old_done.exists() and other_half.exists()
        # the young one, once old enough, goes after the writer's next packet
        monkeypatch.setattr(incremental, "INCOMPLETE_GRACE_S", 1.0)
        _train(store, np.arange(1, 4, dtype=np.uint64))
        dumper.flush()
        assert dumper.packets_written == 1 and dumper.incomplete_removed == 2 and not new_half.exists()
        assert old_done.exists() and other_half.exists()
        now = time.time()
        grace = INCOMPLETE_GRACE_S  # as imported: 600 s
        assert not abandoned_packet(now - 5, False, now, grace) and abandoned_packet(now - 5, False, now, 1)
        assert not abandoned_packet(now - 10 * grace, True, now, grace)
        assert not abandoned_packet(None, False, now, grace)
    finally:
        dumper.close()


def _two_packets(directory):
    """A packet with rows of dims 3 and 4 (signs 0..9), then a later one (signs 100..109, dim 4);
    returns them, oldest first."""
    store, dumper = _trainer(directory, buffer_size=10**6)
    first, later = np.arange(10, dtype=np.uint64), np.arange(100, 110, dtype=np.uint64)
    try:
        _train(store, first, dim=3)
        _train(store, first, dim=4)
        dumper.flush()
        _train(store, later)
        dumper.flush()
    finally:
        dumper.close()
    packets = complete_packets(directory)
    assert len(packets) == 2
    return packets, first, later


def _edit_manifest(packet, edit) -> None:
    import json

    from persia.embedding_ps.incremental import INC_DONE_MARKER

    manifest = json.loads((packet / INC_DONE_MARKER).read_text())
    edit(manifest)
    (packet / INC_DONE_MARKER).write_text(json.dumps(manifest))


def _applies_later_packets_only(directory, caplog, reason: str, first, later):
    served = EmbeddingStore(10_000, 2)
    applier = IncrementalApplier(served, directory, 0, 1)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert applier.poll() == 10  # the later packet's rows; the bad one is rejected, not raised
        assert applier.poll() == 0  # and not retried
    assert (applier.packets_applied, applier.packets_rejected) == (1, 1)
    assert served.contains(later, 4).all()
    # validated whole before any row was written: none of the bad packet's dims is half applied
    assert not served.contains(first, 3).any() and not served.contains(first, 4).any()
    assert any("rejected" in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text


def test_a_packet_listing_a_file_twice_is_rejected_and_later_packets_still_apply(tmp_path, caplog):
    """A manifest listing a file twice (duplicate signs: store.upsert raised ValueError, which
    poll did not catch) stopped every later packet for ever, after applying its first dim."""
    (bad, _), first, later = _two_packets(tmp_path)

    def twice(manifest):  # dim 3 first, then dim 4 listed twice
        files = sorted(manifest["files"], key=lambda e: e["dim"])
        manifest["files"] = files + [e for e in files if e["dim"] == 4]

    _edit_manifest(bad, twice)
    _applies_later_packets_only(tmp_path, caplog, "lists dim_4_part_0.inc twice", first, later)


def test_a_packet_whose_files_overlap_is_rejected_before_any_dim_is_applied(tmp_path, caplog):
    import shutil

    (bad, _), first, later = _two_packets(tmp_path)

    def overlap(manifest):  # the dim-4 file again under another name: every sign twice
        files = sorted(manifest["files"], key=lambda e: e["dim"])
        shutil.copy(bad / files[-1]["file"], bad / "dim_4_part_9.inc")
        manifest["files"] = files + [dict(files[-1], file="dim_4_part_9.inc")]

    _edit_manifest(bad, overlap)
    _applies_later_packets_only(tmp_path, caplog, "rows of dim 4 list a sign twice", first, later)


def test_any_failure_of_a_packet_rejects_it_alone(tmp_path, caplog):
    """Not only CheckpointError/OSError: a manifest field of the wrong type raised out of poll."""
    (bad, _), first, later = _two_packets(tmp_path)
    _edit_manifest(bad, lambda m: m.update(created_unix="yesterday"))
    _applies_later_packets_only(tmp_path, caplog, "created_unix is not a number", first, later)
