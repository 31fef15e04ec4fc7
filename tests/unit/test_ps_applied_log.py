"""The PS's record of applied tagged updates (persia.embedding_ps.applied.AppliedLog): seqs per
source as ranges against a plain set, the pruning horizon and its error, the LRU of sources,
versions, and the schema of the new PS message fields."""

from __future__ import annotations

import numpy as np
import pytest

from persia import messages as M
from persia.embedding_ps.applied import MAX_SOURCES, WINDOW, AppliedLog, horizon


def test_ranges_answer_like_a_set_of_seqs_in_any_order_with_repeats():
    rng = np.random.default_rng(5)
    log = AppliedLog()
    seen: set[int] = set()
    for _ in range(300):
        batch = rng.integers(1, 400, rng.integers(0, 6)).tolist()  # out of order, gaps, repeats
        log.record(7, batch)
        seen.update(batch)
        since = int(rng.integers(0, 420))
        got, _ = log.query(7, since)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, sorted(s for s in seen if s >= since))
    assert len(log._sources[7].starts) < 400  # ranges merged, not one entry per seq


def test_the_usual_contiguous_source_is_one_range():
    log = AppliedLog()
    for s in range(1, 5001):
        log.record(3, [s])
    assert list(log._sources[3].starts) == [1] and list(log._sources[3].ends) == [5001]
    np.testing.assert_array_equal(log.query(3, 4998)[0], [4998, 4999, 5000])
    assert log.query(3, 5001)[0].shape == (0,)


def test_an_unknown_source_has_applied_nothing():
    log = AppliedLog()
    log.record(1, [1, 2])
    seqs, version = log.query(2, 0)
    assert seqs.shape == (0,) and seqs.dtype == np.int64 and version == 0


def test_seqs_below_the_horizon_are_pruned_and_a_query_for_them_names_field_value_and_horizon():
    log = AppliedLog()
    top = WINDOW + 1000
    log.record(9, range(1, top + 1))
    low = horizon(top)
    assert low == top - WINDOW + 1 == 1001
    assert log._sources[9].starts[0] == low  # memory stays bounded
    got, _ = log.query(9, low)
    assert got.shape == (WINDOW,) and got[0] == low and got[-1] == top
    with pytest.raises(ValueError) as err:
        log.query(9, low - 1)
    text = str(err.value)
    assert "'applied.since' is 1000" in text and "from 1001" in text and "source 9" in text
    with pytest.raises(ValueError, match="'applied.since' is 5 "):
        log.check(9, 5)
    log.check(9, low)  # at the horizon: fine
    log.record(9, [3])  # a seq already below the horizon is not kept
    assert log.query(9, low)[0][0] == low


def test_nothing_is_pruned_while_the_source_stays_within_the_window():
    log = AppliedLog()
    log.record(4, range(1, WINDOW + 1))  # seqs start at 1: all of them still fit the window
    got = log.query(4, 1)[0]
    assert got.shape == (WINDOW,) and got[0] == 1


def test_the_least_recently_used_source_is_dropped_beyond_the_limit():
    log = AppliedLog()
    for source in range(1, MAX_SOURCES + 1):
        log.record(source, [1])
    log.query(1, 0)  # a query counts as a use: source 2 is now the oldest
    log.record(MAX_SOURCES + 1, [1])
    assert len(log) == MAX_SOURCES
    np.testing.assert_array_equal(log.query(1, 0)[0], [1])
    np.testing.assert_array_equal(log.query(MAX_SOURCES + 1, 0)[0], [1])
    # dropped: asking whether seq 1 was applied would read "no", and the NN worker would replay
    # it twice; refused, naming the field. Above what it had recorded, nothing is applied yet.
    with pytest.raises(ValueError, match=r"field 'applied.since' is 1 .*forgot which seqs below 2 .*source 2"):
        log.query(2, 1)
    with pytest.raises(ValueError, match="forgot"):
        log.check(2, 0)
    assert log.query(2, 2)[0].shape == (0,)


def test_a_dropped_source_that_records_again_keeps_its_floor_and_clear_forgets_it():
    log = AppliedLog(max_sources=2)
    log.record(1, [1, 2, 3])
    log.record(2, [1])
    log.record(3, [1])  # drops source 1
    log.record(4, [])  # drops source 2; source 4 never records a seq
    log.record(5, [])  # drops source 3
    assert log.query(4, 0)[0].shape == (0,)
    log.record(6, [])  # drops source 5, which had nothing to forget
    assert list(log._dropped) == [1, 2, 3]
    log.record(1, [4, 5])  # back (source 4 dropped): only what it records from now on is known
    np.testing.assert_array_equal(log.query(1, 4)[0], [4, 5])
    with pytest.raises(ValueError, match="forgot which seqs below 4"):
        log.query(1, 3)
    log.clear()  # the rows were replaced: every source starts over
    assert log.query(1, 0)[0].shape == (0,) and log.query(2, 0)[0].shape == (0,)


def test_the_dropped_sources_remembered_are_bounded():
    log = AppliedLog(max_sources=1, max_dropped=3)
    for source in range(1, 7):
        log.record(source, [1])
    assert len(log._dropped) == 3 and list(log._dropped) == [3, 4, 5]


def test_versions_change_with_every_record_and_clear_forgets():
    log = AppliedLog()
    assert log.version(5) == 0
    log.record(5, [1])
    v1 = log.version(5)
    log.record(6, [1])
    assert log.version(5) == v1  # another source's record leaves it alone
    log.record(5, [])
    assert log.version(5) > v1
    log.clear()
    assert log.version(5) == 0 and log.query(5, 0)[0].shape == (0,)


def _update(**extra) -> dict:
    return {"tables": [{"dim": 2, "signs": np.array([1], np.uint64), "grads": np.zeros((1, 2), np.float32)}], **extra}


def test_the_update_schema_takes_a_source_and_seqs_and_refuses_seqs_without_a_source():
    M.validate(M.PsUpdate, _update())
    M.validate(M.PsUpdate, _update(source=12, seqs=[3, 4]))
    M.validate(M.PsUpdate, _update(source=12))
    with pytest.raises(M.MessageError) as err:
        M.validate(M.PsUpdate, _update(seqs=[3, 4]))
    assert "'seqs'" in str(err.value) and "'source'" in str(err.value)
    with pytest.raises(M.MessageError, match="seqs"):
        M.validate(M.PsUpdate, _update(source=1, seqs=list(range(M.MAX_CARRIED_UPDATES + 1))))
    with pytest.raises(M.MessageError, match="source"):
        M.validate(M.PsUpdate, _update(source=-1))


def test_the_lookup_schema_takes_state_and_an_applied_query():
    table = {"dim": 2, "signs": np.array([1], np.uint64)}
    M.validate(M.PsLookup, {"train": True, "tables": [table], "state": True, "applied": {"source": 3, "since": 0}})
    for bad, field in (({"source": 3}, "since"), ({"source": 3, "since": -1}, "since"),
                       ({"source": 3, "since": 1, "x": 1}, "x")):
        with pytest.raises(M.MessageError, match=field):
            M.validate(M.PsLookup, {"train": True, "tables": [table], "applied": bad})
    with pytest.raises(M.MessageError, match="state"):
        M.validate(M.PsLookup, {"train": True, "tables": [table], "state": "yes"})
    step = {"update": _update(source=3, seqs=[1]), "lookup": {"train": True, "tables": [table], "state": True}}
    M.validate(M.PsStep, step)
