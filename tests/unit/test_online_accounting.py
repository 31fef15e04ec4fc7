"""The NN worker's batch account (persia.nn_worker.accounting) under online training: data-loader
processes restarted for weeks keep it bounded and balanced."""

from __future__ import annotations

from persia.nn_worker import accounting
from persia.nn_worker.accounting import BatchAccount


def _arrive(acc: BatchAccount, loader: int, session: str, n: int) -> None:
    for _ in range(n):
        acc.received_from(loader, session)


def _sizes(acc: BatchAccount) -> int:
    return max(len(acc.received_by), len(acc.announced_by), len(acc.failed_sends_by), len(acc.ended),
               sum(len(s) for s in getattr(acc, "sessions_of", {}).values()))


def test_a_loader_restarted_thousands_of_times_keeps_the_account_bounded_and_balanced():
    """Online training for weeks: every loader process (killed, restarted in place, or ending its
    stream) left four entries keyed by its session for the life of the NN rank. After 5,000
    processes of each of two loaders the account holds a bounded number and still balances."""
    acc = BatchAccount()
    killed = 0
    for p in range(5000):
        for loader in (0, 1):
            session = f"s{loader}-{p}"
            _arrive(acc, loader, session, 3)
            acc.announced(loader, session, 2, final=False, failed_sends={"send_dense": 1})
            if p % 2:  # ended its stream with its last batch announced
                acc.announced(loader, session, 1, final=True, failed_sends={"send_dense": 1})
            else:  # killed with one batch unannounced
                killed += 1
    acc.add("trained", 2 * 5000 * 3)
    assert _sizes(acc) <= 2 * accounting.RETAINED_PROCESSES, _sizes(acc)
    assert acc.unaccounted() == 0
    assert acc.as_result()["batches_unannounced"] == killed
    assert acc.failed_sends == {"send_dense": 2 * 5000}


def test_a_late_message_of_a_retired_process_still_counts_exactly():
    """A process retired (superseded by RETAINED_PROCESSES newer ones) whose batch or end
    message arrives after that adjusts the totals as if it had never been retired."""
    acc = BatchAccount()
    _arrive(acc, 0, "old", 2)
    for p in range(accounting.RETAINED_PROCESSES):
        _arrive(acc, 0, f"new{p}", 1)
        acc.announced(0, f"new{p}", 1, final=True, failed_sends={})
    assert (0, "old") not in acc.received_by  # retired
    assert acc.unannounced() == {(0, accounting.RETIRED): 2}
    _arrive(acc, 0, "old", 1)
    assert acc.unannounced() == {(0, accounting.RETIRED): 3}
    acc.announced(0, "old", 3, final=True, failed_sends={"send_dense": 1})  # it did end after all
    acc.add("trained", 3 + accounting.RETAINED_PROCESSES)
    assert acc.unannounced() == {} and acc.unaccounted() == 0
    assert acc.failed_sends == {"send_dense": 1}
