"""Incremental packets on an inference PS when reading them fails for a while (an NFS hiccup:
EIO, ESTALE): the packet is read again at the next polls, and no later packet overtakes it. Real
packets written by a training store's ``IncrementalDumper``; the I/O error is injected."""

from __future__ import annotations

import errno

import numpy as np
from persia.embedding_ps import AdagradConfig, EmbeddingStore
from persia.embedding_ps import checkpoint as ckpt
from persia.embedding_ps import incremental as inc
from persia.embedding_ps.incremental import (
    IncrementalApplier,
    IncrementalDumper,
    read_failure,
)


def _packets(directory) -> tuple[np.ndarray, np.ndarray]:
    """Two packets: signs 0..9 with weights after one step, then the same signs after a second."""
    store = EmbeddingStore(10_000)
    store.register_optimizer(AdagradConfig(lr=0.1))
    dumper = IncrementalDumper(store, directory, 0, 10**6, num_workers=1, fsync=False)
    signs = np.arange(10, dtype=np.uint64)
    try:
        store.lookup(signs, 4, True)
        store.update(signs, np.ones((10, 4), np.float32))
        dumper.flush()
        store.update(signs, np.ones((10, 4), np.float32))
        dumper.flush()
    finally:
        dumper.close()
    return signs, store.lookup(signs, 4, False)


class _Flaky:
    """``checkpoint.read_rows_file`` failing with ``err`` ``times`` times."""

    def __init__(self, monkeypatch, err: OSError, times: int):
        self.err, self.left, self._read = err, times, ckpt.read_rows_file
        monkeypatch.setattr(ckpt, "read_rows_file", self)

    def __call__(self, *args, **kwargs):
        if self.left > 0:
            self.left -= 1
            raise self.err
        return self._read(*args, **kwargs)


def test_read_failure_decisions():
    eio = OSError(errno.EIO, "Input/output error", "/x")
    assert read_failure(eio, 1) == "retry" and read_failure(eio, inc.READ_ATTEMPTS) == "reject"
    assert read_failure(FileNotFoundError(errno.ENOENT, "gone", "/x"), 1) == "reject"  # deleted by retention
    assert read_failure(ckpt.CheckpointError("/x: bad CRC"), 1) == "reject"
    try:  # an unreadable done marker: read_manifest's CheckpointError over the I/O error
        try:
            raise eio
        except OSError:
            raise ckpt.CheckpointError("/x: unreadable done marker") from None
    except ckpt.CheckpointError as wrapped:
        assert read_failure(wrapped, 1) == "retry"


def test_an_io_error_reading_a_packet_is_retried_and_no_later_packet_overtakes_it(tmp_path, monkeypatch):
    """Before: rejected at the first failure and never read again; the later packet applied, and
    the first packet's rows (here superseded, in general rows that did not change again) never
    reached the served model."""
    signs, final = _packets(tmp_path)
    flaky = _Flaky(monkeypatch, OSError(errno.EIO, "Input/output error"), times=1)
    served = EmbeddingStore(10_000)
    applier = IncrementalApplier(served, tmp_path, 0, 1)
    assert applier.poll() == 0  # the first packet failed: nothing later is applied before it
    assert applier.packets_rejected == 0 and not served.contains(signs, 4).any()
    assert applier.poll() == 20 and applier.packets_applied == 2 and flaky.left == 0
    np.testing.assert_array_equal(served.lookup(signs, 4, False), final)  # the newest rows win


def test_an_io_error_that_persists_rejects_the_packet_after_a_few_polls(tmp_path, monkeypatch, caplog):
    signs, final = _packets(tmp_path)
    _Flaky(monkeypatch, OSError(errno.ESTALE, "Stale file handle"), times=inc.READ_ATTEMPTS)
    served = EmbeddingStore(10_000)
    applier = IncrementalApplier(served, tmp_path, 0, 1)
    for _ in range(inc.READ_ATTEMPTS - 1):
        assert applier.poll() == 0
    assert applier.poll() == 10  # rejected at the last attempt; the later packet applies
    assert applier.packets_rejected == 1 and "Stale file handle" in caplog.text
    np.testing.assert_array_equal(served.lookup(signs, 4, False), final)
    assert applier.poll() == 0 and not applier.read_attempts
