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
    replay = {"source": 7, "since": 1, "tables": [{"signs": signs, "state": state, "replica": np.zeros(3, np.uint16),
                                                   "absent": np.zeros(0, np.int32),
                                                   "applied": [np.array([1], np.int64)]}]}
    assert own.correct(tables, replay) == 3  # seq 1 was applied when read: only seq 2 replayed
    w, s = rows.copy(), state.copy()
    apply_step(cfg, w, s, g * 2)
    np.testing.assert_array_equal(tables[0]["rows"], w)
    assert own.correct([{"dim": 4, "rows": rows}], {**replay, "since": 2}) == 3  # still kept for since 2
    with pytest.raises(ValueError, match="forgotten"):  # since 2 was trained: below it is gone
        own.correct([{"dim": 4, "rows": rows}], replay)


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
    assert fresh.correct(tables, replay) == 0 and tables[0]["rows"] is rows


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
