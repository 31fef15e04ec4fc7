"""Which loader processes an NN rank takes batches from (``_RankStream.admit``): after the rank was
restarted alone or the ranks were rescaled, a data loader that streamed on is refused, one that
asked the rank where to start is taken. No servers: the decision alone."""

import logging

from persia.nn_worker.datasets import REORDER_PER_WORKER, _RankStream


def _stream(rank=0, world=1, resume=None, delivered=0) -> _RankStream:
    s = _RankStream(resume=resume)
    s.rank, s.world_size, s.embedding_workers = rank, world, 1
    s.delivered[0] += delivered
    return s


def _msg(batch_id, session="s", loader=0, size=1, world=None):
    msg = {"batch_id": batch_id, "loader": loader, "loader_size": size, "session": session}
    return msg if world is None else {**msg, "world_size": world}


CKPT = {"step": 100, "world_size": 1, "loaders": {"0": {"0": 100}}, "earlier": [], "path": "/c/ckpt-100"}


def test_a_loader_that_resends_from_the_position_is_taken():
    s = _stream(resume=CKPT)
    assert s.admit(_msg(100)) is None
    assert s.admit(_msg(101)) is None


def test_a_loader_that_streamed_on_past_the_restart_is_refused_for_good(caplog):
    s = _stream(resume=CKPT)
    why = s.admit(_msg(100 + REORDER_PER_WORKER + 20))
    assert why is not None and "streamed on past a restart" in why and "restart data loader 0" in why
    assert s.admit(_msg(100, session="s")) == why  # every later batch of that process too
    assert s.admit(_msg(100, session="new")) is None  # its restarted process, from the position


def test_reordering_within_the_slack_is_taken():
    s = _stream(resume=CKPT)
    assert s.admit(_msg(100 + REORDER_PER_WORKER)) is None


def test_without_a_resumed_checkpoint_a_gap_is_only_said(caplog):
    caplog.set_level(logging.WARNING)
    s = _stream(resume=None, delivered=10)
    assert s.admit(_msg(500)) is None
    assert any("resumed no checkpoint" in r.getMessage() for r in caplog.records)


def test_a_batch_of_another_rank_under_this_world_size_is_refused_with_its_process():
    s = _stream(rank=0, world=2, resume=None)
    assert s.admit(_msg(4)) is None  # rank 0's under 2 ranks
    why = s.admit(_msg(5))  # rank 1's: the loader counts one rank
    assert why is not None and "another number of NN ranks" in why
    assert s.admit(_msg(6)) == why


def test_positions_of_an_earlier_world_size_skip_the_gap_check():
    resumed = {**CKPT, "world_size": 2, "loaders": {"0": {"0": 50, "1": 50}}}
    s = _stream(rank=0, world=1, resume=resumed)
    assert s.admit(_msg(900)) is None


def test_an_older_sender_without_a_session_is_not_checked():
    s = _stream(resume=CKPT)
    assert s.admit({"batch_id": 900, "loader": 0, "loader_size": 1}) is None


def test_a_loader_routing_for_more_ranks_than_there_are_is_refused_after_a_scale_down():
    """2 ranks scaled down to 1 while a loader streams on: every id is rank 0's under one rank, so
    the id alone cannot tell (rank 0 took the even ids and the odd ones waited for the departed
    rank 1); the loader's own count of the ranks, on every batch, does."""
    s = _stream(rank=0, world=1, resume=None)
    why = s.admit(_msg(4, world=2))
    assert why is not None and "routed for 2 NN ranks" in why and "restart data loader 0" in why
    assert s.admit(_msg(6, world=2)) == why  # the whole process
    assert s.admit(_msg(7, session="new", world=1)) is None  # its restarted process routes for 1
