"""The NN worker's batch balance (persia.nn_worker.accounting), per data-loader process: what the
loaders announced, what arrived from a process that never ended its stream, what ended how."""

from __future__ import annotations

import logging

from persia.nn_worker import accounting
from persia.nn_worker.accounting import BatchAccount


def _arrive(acc: BatchAccount, loader: int, session: str, n: int) -> None:
    for _ in range(n):
        acc.received_from(loader, session)


def test_announced_batches_all_finished_balance():
    acc = BatchAccount()
    _arrive(acc, 0, "a", 3)
    _arrive(acc, 1, "b", 2)
    acc.announced(0, "a", 3, final=False, failed_sends={})
    acc.announced(1, "b", 2, final=False, failed_sends={})
    acc.announced(0, "a", 0, final=True, failed_sends={})
    acc.add("trained", 4)
    acc.fail("non_finite_loss")
    assert acc.unannounced() == {} and acc.unaccounted() == 0
    assert acc.as_result()["batches_unannounced"] == 0


def test_a_loader_process_killed_mid_epoch_stands_in_with_what_arrived_from_it():
    """Process "a" announced epoch 0 (2 batches), then 3 more arrived and it died (the last one
    between its legs: lost); "a2", its replacement, announced and ended. Nothing is unaccounted."""
    acc = BatchAccount()
    _arrive(acc, 0, "a", 2)
    acc.announced(0, "a", 2, final=False, failed_sends={})
    _arrive(acc, 0, "a", 3)
    _arrive(acc, 0, "a2", 4)
    acc.announced(0, "a2", 4, final=False, failed_sends={})
    acc.announced(0, "a2", 0, final=True, failed_sends={})
    acc.add("trained", 8)
    acc.fail("lost_id_features")
    assert acc.unannounced() == {(0, "a"): 3}
    assert acc.unaccounted() == 0
    assert acc.as_result()["batches_sent"] == 6 and acc.as_result()["batches_unannounced"] == 3


def test_a_process_that_ended_its_stream_is_held_to_its_own_count():
    """More arrived than an ended process announced: a real imbalance, still reported."""
    acc = BatchAccount()
    _arrive(acc, 0, "a", 3)
    acc.announced(0, "a", 2, final=True, failed_sends={})
    acc.add("trained", 3)
    assert acc.unannounced() == {} and acc.unaccounted() == -1


def test_a_live_loader_that_has_not_ended_its_stream_yet_adds_nothing():
    """Per-epoch training can end before a loader's final message: its epochs were announced."""
    acc = BatchAccount()
    _arrive(acc, 0, "a", 5)
    acc.announced(0, "a", 5, final=False, failed_sends={})
    acc.add("trained", 5)
    assert acc.unannounced() == {} and acc.unaccounted() == 0


def test_an_end_message_without_a_session_stands_for_all_of_its_loaders_batches():
    """An older data loader's end messages carry no session while its batches do."""
    acc = BatchAccount()
    _arrive(acc, 0, "a", 3)
    acc.announced(0, None, 3, final=True, failed_sends={})
    acc.add("trained", 3)
    assert acc.unannounced() == {} and acc.unaccounted() == 0


def test_failed_sends_are_kept_per_process_and_reset_forgets_them():
    acc = BatchAccount()
    acc.announced(0, "a", 0, final=False, failed_sends={"send_dense": 1})
    acc.announced(0, "a2", 0, final=False, failed_sends={"send_dense": 2})  # the restarted process's own
    acc.announced(0, "a2", 0, final=True, failed_sends={"send_dense": 3})  # replaces its earlier report
    assert acc.failed_sends == {"send_dense": 4}
    assert acc.as_result()["batches_failed"] == {"loader_send_dense": 4}
    acc.__init__()  # what accounting.reset() does
    acc.announced(0, "b", 0, final=True, failed_sends={})
    assert acc.failed_sends == {} and acc.received_by == {} and acc.ended == {(0, "b")}


def test_the_summary_names_the_process_and_warns_only_for_a_real_imbalance(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="persia.nn_worker.accounting")
    acc = BatchAccount()
    monkeypatch.setattr(accounting, "ACCOUNT", acc)
    _arrive(acc, 0, "dead", 2)
    acc.add("trained", 1)
    acc.fail("lost_id_features")
    accounting.log_summary(0, complete=True)
    (rec,) = caplog.records
    assert rec.levelno == logging.INFO and "2 from data loader 0 process dead" in rec.getMessage()
    assert "every acknowledged batch accounted for" in rec.getMessage()
    caplog.clear()
    acc.add("trained", 1)  # one more finished than acknowledged
    accounting.log_summary(0, complete=True)
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING and "-1 acknowledged batches NOT accounted for" in rec.getMessage()


def test_a_rank_whose_loaders_sent_nothing_says_it_trained_nothing(caplog):
    """Before, such a rank logged "every acknowledged batch accounted for" and the job was reported
    done as if it had trained (an empty file or glob on the loaders' side)."""
    acc = BatchAccount()
    acc.announced(0, "a", 0, final=True, failed_sends={})
    acc.announced(1, "b", 0, final=True, failed_sends={})
    assert accounting.nothing_trained(acc) == (
        "every data loader ended its stream without sending a batch (loaders [0, 1]): nothing was trained; "
        "check what their datasets yield")
    _arrive(acc, 0, "a", 1)  # one batch arrived: that is not "nothing"
    assert accounting.nothing_trained(acc) is None
    assert accounting.nothing_trained(BatchAccount()) is None  # no loader ended a stream (a context not streaming)


def test_the_summary_warns_when_nothing_was_trained(monkeypatch, caplog):
    acc = BatchAccount()
    acc.announced(0, "a", 0, final=True, failed_sends={})
    monkeypatch.setattr(accounting, "ACCOUNT", acc)
    caplog.set_level(logging.INFO, logger=accounting.log.name)
    accounting.log_summary(0, complete=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["NN rank 0: every data loader ended its stream without sending a batch (loaders [0]): "
                        "nothing was trained; check what their datasets yield"]
