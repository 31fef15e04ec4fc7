"""The NN worker's numbering of its own updates (persia.nn_worker.own_updates): which seqs a lookup
may have missed, what is kept to replay them, and when replay applies."""

from __future__ import annotations

import numpy as np
import pytest

from persia import messages as M
from persia.embedding_ps.optimizers import AdagradConfig, apply_step
from persia.nn_worker.own_updates import ENV_REPLAY, OwnUpdates, replay_setting


def _reply_tables(signs, rows):
    return [{"dim": rows.shape[1], "rows": rows, "signs": signs}]


def _slots(n_rows):
    return [{"name": "s", "dim": 4, "index": np.arange(n_rows, dtype=np.int32),
             "offsets": np.array([0, n_rows], np.int32), "sqrt_scaling": False}]


def test_since_is_the_oldest_update_not_yet_acknowledged():
    own = OwnUpdates(AdagradConfig(), 0.0, source=7)
    assert own.since() == 1  # nothing sent: every later update is at or above 1
    signs = np.array([3, 5], np.uint64)
    seqs = [own.sent(_reply_tables(signs, np.zeros((2, 4), np.float32)), _slots(2),
                     [np.ones((2, 4), np.float32)], 1.0, []) for _ in range(3)]
    assert seqs == [1, 2, 3] and own.since() == 1
    own.acked(2)
    assert own.since() == 1  # 1 is still on its way
    own.acked(1)
    assert own.since() == 3
    own.acked(3)
    assert own.since() == 4
    assert own.query(4) == {"source": 7, "since": 4}


def test_updates_of_lookups_without_replay_are_numbered_but_not_kept():
    """Synchronous training (staleness 1) asks for no replay, so no correction ever forgets its
    updates: keeping them grew the history by a record a step for the life of the job."""
    own = OwnUpdates(AdagradConfig(), 0.0, source=7)
    no_signs = [{"dim": 4, "rows": np.zeros((2, 4), np.float32)}]
    seqs = [own.sent(no_signs, _slots(2), [np.ones((2, 4), np.float32)], 1.0, []) for _ in range(1000)]
    assert seqs == list(range(1, 1001)) and len(own.history) == 0
    own.sent(_reply_tables(np.array([3, 5], np.uint64), np.zeros((2, 4), np.float32)), _slots(2),
             [np.ones((2, 4), np.float32)], 1.0, [])
    assert [u.seq for u in own.history.since(1)] == [1001]  # a replayable one is kept


def test_correct_replays_the_missed_updates_and_forgets_what_no_later_batch_needs():
    cfg = AdagradConfig(lr=0.5)
    own = OwnUpdates(cfg, 0.0, source=7)
    signs = np.array([3, 5, 8], np.uint64)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    state = np.full((3, 4), 0.01, np.float32)
    g = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    own.sent(_reply_tables(signs, rows), _slots(3), [g], 1.0, [])  # seq 1
    own.sent(_reply_tables(signs, rows), _slots(3), [g * 2], 1.0, [])  # seq 2
    tables = [{"dim": 4, "rows": rows}]

    def reply(since):  # a lookup reply's replay part (correct replaces its state and notes what it replayed)
        return {"source": 7, "since": since, "tables": [{"signs": signs, "state": state, "replica": np.zeros(3, np.uint16),
                                                         "absent": np.zeros(0, np.int32),
                                                         "applied": [np.array([1], np.int64)]}]}

    replay = reply(1)
    fixed = own.correct(tables, replay)
    assert fixed.replayed == 3  # seq 1 was applied when read: only seq 2 replayed
    assert fixed.touched[0].tolist() == [0, 1, 2]
    w, s = rows.copy(), state.copy()
    apply_step(cfg, w, s, g * 2)
    np.testing.assert_array_equal(tables[0]["rows"], w)
    assert own.correct([{"dim": 4, "rows": rows}], reply(2)).replayed == 3  # still kept for since 2
    with pytest.raises(ValueError, match="forgotten"):  # since 2 was trained: below it is gone
        own.correct([{"dim": 4, "rows": rows}], reply(1))


def test_a_lookup_made_under_an_earlier_source_is_not_corrected():
    own = OwnUpdates(AdagradConfig(), 0.0, source=7)
    signs = np.array([3], np.uint64)
    own.sent(_reply_tables(signs, np.zeros((1, 4), np.float32)), _slots(1), [np.ones((1, 4), np.float32)], 1.0, [])
    fresh = own.renewed()  # the PS rows were cleared or loaded
    assert fresh.source != own.source and fresh.since() == 1 and len(fresh.history) == 0
    rows = np.zeros((1, 4), np.float32)
    replay = {"source": 7, "since": 1, "tables": [{"signs": signs, "state": np.full((1, 4), 0.01, np.float32),
                                                   "replica": np.zeros(1, np.uint16), "absent": np.zeros(0, np.int32),
                                                   "applied": [np.zeros(0, np.int64)]}]}
    tables = [{"dim": 4, "rows": rows}]
    assert fresh.correct(tables, replay) == (0, [None]) and tables[0]["rows"] is rows
    assert fresh.correct_ahead(tables, replay) == 0 and tables[0]["rows"] is rows and "through" not in replay


def test_the_replay_setting_comes_from_the_argument_then_the_environment_and_is_on_by_default():
    assert replay_setting(None, {}) is True
    assert replay_setting(None, {ENV_REPLAY: "0"}) is False
    assert replay_setting(True, {ENV_REPLAY: "0"}) is True
    with pytest.raises(ValueError, match=rf"{ENV_REPLAY}.*'maybe'"):
        replay_setting(None, {ENV_REPLAY: "maybe"})
    with pytest.raises(ValueError, match="replay_own_updates.*'yes'"):
        replay_setting("yes", {})


def test_an_update_seq_needs_its_source():
    with pytest.raises(ValueError, match="'seq'.*'source'"):
        M.WorkerUpdate.model_validate({"ref": 1, "grads": [], "seq": 3})
    assert M.WorkerUpdate.model_validate({"ref": 1, "grads": [], "seq": 3, "source": 9}).seq == 3
    step = M.WorkerStep.model_validate({"ref": 2, "replay": {"source": 9, "since": 1}})
    assert step.replay.since == 1


def test_one_call_carries_the_updates_of_one_source():
    from persia.embedding_worker.service import EmbeddingWorker

    t = [{"dim": 4}]
    assert EmbeddingWorker._tagged(t, [{"seq": 1, "source": 5}, {"seq": 2, "source": 5}]) == \
        {"tables": t, "source": 5, "seqs": [1, 2]}
    assert EmbeddingWorker._tagged(t, [{"ref": 1}]) == {"tables": t}  # untagged: as before replay
    assert EmbeddingWorker._tagged([], [{"seq": 1, "source": 5}]) is None  # nothing for that replica
    with pytest.raises(ValueError, match="'updates'.*one 'source'"):
        EmbeddingWorker._tagged(t, [{"seq": 1, "source": 5}, {"seq": 2, "source": 6}])


def _replay_reply(signs, state, applied):
    return {"source": 7, "since": 1, "tables": [{"signs": signs, "state": state, "replica": np.zeros(signs.size, np.uint16),
                                                 "absent": np.zeros(0, np.int32), "applied": [applied]}]}


def _looked_up_table(seed: int):
    """``(signs, rows, state, send)``: a looked-up table of 25 of 39 signs (dim 4), and
    ``send(own, k)``, which has ``own`` send k updates of 15 random signs each: the same updates,
    in the same order, for every context."""
    rng = np.random.default_rng(seed)
    universe = np.arange(1, 40, dtype=np.uint64)
    signs = np.sort(rng.choice(universe, 25, replace=False))
    rows = rng.standard_normal((25, 4)).astype(np.float32)
    state = np.full((25, 4), 0.01, np.float32)
    streams: dict[int, np.random.Generator] = {}

    def send(own, k):
        r = streams.setdefault(id(own), np.random.default_rng(seed + 100))
        for _ in range(k):
            us = np.sort(r.choice(universe, 15, replace=False))
            own.sent(_reply_tables(us, np.zeros((15, 4), np.float32)), _slots(15),
                     [r.standard_normal((15, 4)).astype(np.float32)], 1.0, [])

    return signs, rows, state, send


def test_the_lookup_threads_part_and_the_training_threads_part_equal_one_correction_bit_for_bit():
    """correct_ahead replays what was sent when the reply came in; correct, later, only what was
    sent since. Together they step every row as one correction at training time does."""
    cfg = AdagradConfig(lr=0.3)
    signs, rows, state, send = _looked_up_table(5)
    whole, split = OwnUpdates(cfg, 0.0, source=7), OwnUpdates(cfg, 0.0, source=7)
    for own in (whole, split):
        send(own, 3)  # seqs 1-3 sent before the reply; the PS had applied seq 2 when it read
    applied = np.array([2], np.int64)
    t_split = [{"dim": 4, "rows": rows}]
    r_split = _replay_reply(signs, state, applied)
    ahead = split.correct_ahead(t_split, r_split)
    assert ahead > 0 and r_split["through"] == 3 and r_split["ahead"] == ahead
    ours = t_split[0]["rows"], r_split["tables"][0]["state"]  # the lookup thread's own copies
    assert ours[0] is not rows and ours[1] is not state and ours[0].flags.writeable
    for own in (whole, split):
        send(own, 2)  # seqs 4-5: sent after the reply came in, before the batch is trained
    t_whole = [{"dim": 4, "rows": rows}]
    fixed_whole = whole.correct(t_whole, _replay_reply(signs, state, applied))
    fixed_split = split.correct(t_split, r_split)
    assert fixed_split.replayed > 0 and ahead + fixed_split.replayed == fixed_whole.replayed
    # the training thread's part stepped those copies in place: nothing copied on its thread
    assert t_split[0]["rows"] is ours[0] and r_split["tables"][0]["state"] is ours[1]
    np.testing.assert_array_equal(t_split[0]["rows"], t_whole[0]["rows"])
    # the late part touched only rows of seqs 4-5, and every row it changed
    late_rows = set()
    for u in split.history.since(4):
        late_rows |= set(np.flatnonzero(np.isin(signs, u.tables[4][0])).tolist())
    assert set(fixed_split.touched[0].tolist()) == late_rows
    assert split.corrected_batches == 1 and split.replayed_row_steps == fixed_whole.replayed
    # the batch's second forward (prepare_features again): nothing is stepped twice
    again = split.correct(t_split, r_split)
    assert again.replayed == 0 and again.touched == [None]
    np.testing.assert_array_equal(t_split[0]["rows"], t_whole[0]["rows"])


def test_the_next_batch_correctors_part_sits_between_the_other_two_and_forgets_nothing():
    """correct_next (the corrector thread, after updates 4-5 were sent) picks up where the lookup
    thread stopped, and the training thread's part replays only update 6: together, bit for bit,
    one correction at training time. correct_next keeps the history an earlier batch may need."""
    cfg = AdagradConfig(lr=0.3)
    signs, rows, state, send = _looked_up_table(9)
    whole, split = OwnUpdates(cfg, 0.0, source=7), OwnUpdates(cfg, 0.0, source=7)
    applied = np.array([2], np.int64)
    t_split, r_split = [{"dim": 4, "rows": rows}], _replay_reply(signs, state, applied)
    for own in (whole, split):
        send(own, 3)
    ahead = split.correct_ahead(t_split, r_split)
    for own in (whole, split):
        send(own, 2)
    nxt = split.correct_next(t_split, r_split)
    assert nxt.replayed > 0 and r_split["through"] == 5 and r_split["ahead"] == ahead + nxt.replayed
    assert len(split.history) == 5  # nothing forgotten: only the training thread's part forgets
    assert split.correct_next(t_split, r_split).replayed == 0  # nothing new sent: nothing stepped twice
    for own in (whole, split):
        send(own, 1)
    t_whole, r_whole = [{"dim": 4, "rows": rows}], _replay_reply(signs, state, applied)
    fixed_whole = whole.correct(t_whole, r_whole)
    fixed_split = split.correct(t_split, r_split)
    assert fixed_split.replayed > 0 and ahead + nxt.replayed + fixed_split.replayed == fixed_whole.replayed
    np.testing.assert_array_equal(t_split[0]["rows"], t_whole[0]["rows"])
    np.testing.assert_array_equal(r_split["tables"][0]["state"], r_whole["tables"][0]["state"])
    assert split.replayed_next_row_steps == nxt.replayed and split.replayed_ahead_row_steps == ahead
    assert split.corrected_batches == 1 and split.replayed_row_steps == fixed_whole.replayed
