"""Checkpoint/resume decisions as pure functions: settings (config, env, arguments), which
directories are published, retention, the resume choice, when a checkpoint is due, loader
positions and how a restarted data loader skips exactly the trained batches, also when the NN
world size changed between runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persia.config import load_global_config_from_dict
from persia.data_loader.resume import StreamPosition, position_from_info
from persia.nn_worker import checkpoint_plan as plan


def ckpt_config(**keys):
    return load_global_config_from_dict({"common_config": {"checkpointing_config": keys}}).common_config.checkpointing_config


def test_config_keys_then_env_then_arguments():
    cfg = ckpt_config(checkpoint_dir="/c", interval_steps=100, keep=5)
    s = plan.settings_from(cfg, {})
    assert (s.checkpoint_dir, s.interval_steps, s.interval_seconds, s.keep, s.resume) == ("/c", 100, None, 5, "auto")
    s = plan.settings_from(cfg, {plan.ENV_DIR: "/e", plan.ENV_STEPS: "", plan.ENV_SECONDS: "2.5", plan.ENV_RESUME: "never"})
    assert (s.checkpoint_dir, s.interval_steps, s.interval_seconds, s.resume) == ("/e", None, 2.5, "never")
    s = plan.settings_from(cfg, {plan.ENV_STEPS: "7"}, interval_steps=3, checkpoint_dir=None)
    assert (s.checkpoint_dir, s.interval_steps) == ("/c", 3)  # None arguments leave the value alone
    assert plan.settings_from(None, {}).periodic is False
    assert plan.settings_from(None, {plan.ENV_DIR: "/d"}).periodic is False  # a dir alone: resume only
    assert plan.settings_from(None, {plan.ENV_DIR: "/d", plan.ENV_STEPS: "1"}).periodic is True


@pytest.mark.parametrize("env, message", [
    ({plan.ENV_STEPS: "ten"}, "PERSIA_CHECKPOINT_INTERVAL_STEPS='ten': expected a positive int"),
    ({plan.ENV_STEPS: "0"}, "PERSIA_CHECKPOINT_INTERVAL_STEPS='0'"),
    ({plan.ENV_SECONDS: "-1"}, "PERSIA_CHECKPOINT_INTERVAL_SECONDS='-1'"),
    ({plan.ENV_KEEP: "0"}, "PERSIA_CHECKPOINT_KEEP='0'"),
    ({plan.ENV_DIR: "hdfs://x/y"}, "only local/mounted paths"),
])
def test_bad_env_values_name_the_variable_and_value(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan.settings_from(None, env)


def test_bad_config_values_are_refused():
    for keys in ({"interval_steps": 0}, {"interval_seconds": 0}, {"keep": 0}, {"resume": ""}, {"interval": 5}):
        with pytest.raises(ValueError):
            ckpt_config(**keys)


def test_only_marked_well_named_directories_are_published():
    entries = [("ckpt-000000000010", True), ("ckpt-000000000020", False), (".tmp-ckpt-000000000030", True),
               ("ckpt-5", True), ("notes", False), ("ckpt-000000000002", True)]
    assert plan.complete_checkpoints(entries) == [(2, "ckpt-000000000002"), (10, "ckpt-000000000010")]
    assert plan.checkpoint_name(42) == "ckpt-000000000042" and plan.step_of("ckpt-000000000042") == 42
    with pytest.raises(ValueError):
        plan.checkpoint_name(-1)


def test_retention_and_resume_choice():
    complete = [(1, "a"), (5, "c"), (3, "b")]
    assert plan.to_delete(complete, 2) == ["a"]
    assert plan.to_delete(complete, 3) == []
    assert plan.resume_choice("auto", complete) == ("dir", "c")
    assert plan.resume_choice("auto", []) is None
    assert plan.resume_choice("never", complete) is None
    assert plan.resume_choice("/some/ckpt", []) == ("path", "/some/ckpt")


def test_a_restart_resumes_from_its_own_run_whatever_resume_says():
    """``never`` and a path say where a job starts; its restarts continue from the newest
    checkpoint the run wrote (they started over: everything since was lost)."""
    complete = [(1, "a"), (5, "c"), (3, "b")]
    for resume in ("never", "/warm/start", "auto"):
        assert plan.resume_choice(resume, complete, own={"a", "b"}) == ("dir", "b")
    assert plan.resume_choice("never", complete, own=()) is None  # this run wrote none yet
    assert plan.resume_choice("/warm/start", complete, own=set()) == ("path", "/warm/start")


def test_due_by_steps_or_seconds():
    both = plan.CheckpointSettings(checkpoint_dir="/d", interval_steps=10, interval_seconds=60.0)
    assert not plan.is_due(both, 9, 0, 59.0)
    assert plan.is_due(both, 10, 0, 0.0) and plan.is_due(both, 1, 0, 60.0)
    assert not plan.is_due(both, 5, 5, 1000.0)  # nothing trained since the last one
    # aligned to multiples: after a resume (or a final checkpoint) at 13, the next one is at 20
    assert not plan.is_due(both, 19, 13, 1.0) and plan.is_due(both, 20, 13, 1.0)
    assert not plan.is_due(plan.CheckpointSettings(interval_steps=1), 5, 0, 5.0)  # no directory


def test_positions_merge_per_loader_and_rank():
    merged = plan.merge_positions([{0: 3, 1: 2}, {0: 4, 1: 0}])
    assert merged == {"0": {"0": 3, "1": 4}, "1": {"0": 2}}
    assert plan.positions_for_rank(merged, 1) == {0: 4, 1: 0}


def test_a_loader_skips_exactly_the_batches_each_rank_trained():
    # loader 0 of 1, 2 NN ranks: batch k goes to rank k % 2. Rank 0 trained 3 (k=0,2,4), rank 1
    # trained 2 (k=1,3): k=5 was sent to rank 1 but not trained (staleness), so it is sent again.
    position, warning = position_from_info({"step": 2, "world_size": 2, "loaders": {"0": {"0": 3, "1": 2}}}, 0, 2)
    assert warning is None and position.total == 5
    sent = [k for k in range(10) if not position.skip(k)]
    assert sent == [5, 6, 7, 8, 9]
    assert position.remaining == 0


def test_positions_are_mapped_onto_another_world_size():
    # written by 2 ranks (rank 0 trained k=0,2,4; rank 1 k=1,3), resumed with 4: the same 5 skipped
    position, note = position_from_info({"world_size": 2, "path": "/c", "loaders": {"0": {"0": 3, "1": 2}}}, 0, 4)
    assert "written with 2 NN ranks, this job has 4" in note and "skips the 5 batches" in note
    assert [k for k in range(10) if not position.skip(k)] == [5, 6, 7, 8, 9]
    assert position_from_info(None, 0, 1) == (None, None)
    fresh, note = position_from_info({"world_size": 1, "loaders": {}}, 3, 1)
    assert fresh.total == 0 and not fresh.skip(0) and note is None
    assert isinstance(fresh, StreamPosition)


def test_a_run_with_another_world_size_is_kept_as_an_earlier_run():
    progress = {"step": 7, "world_size": 2, "loaders": {"0": {"0": 7, "1": 7}}, "earlier": []}
    # the same world size: the run goes on, each rank's counts continue
    assert plan.continue_positions(progress, 2, 1) == ([], {0: 7})
    # another: that run is kept whole and this one counts from zero
    earlier, mine = plan.continue_positions(progress, 3, 0)
    assert earlier == [{"world_size": 2, "loaders": {"0": {"0": 7, "1": 7}}}] and mine == {}
    # a checkpoint written by dump_checkpoint (no positions): nothing to keep
    assert plan.continue_positions({"step": 0, "world_size": None, "loaders": {}}, 2, 0) == ([], {})


def _replay(runs, num_loaders: int, batches_per_loader: int) -> None:
    """Several runs of a job, each with its own NN world size, each rank training a prefix of what
    it was sent per loader (``cut``), then a restart from that run's checkpoint: no batch is sent
    after it was trained, and with the last run training everything, every batch is trained."""
    trained: set[tuple[int, int]] = set()
    progress = None
    for world, cuts in runs:
        if progress is None:
            earlier, counts = [], [{} for _ in range(world)]
        else:
            continued = [plan.continue_positions(progress, world, r) for r in range(world)]
            earlier, counts = continued[0][0], [dict(c) for _, c in continued]
        info = None if progress is None else {**progress, "path": "/c"}
        for loader in range(num_loaders):
            position, _ = position_from_info(info, loader, world)
            sent: dict[int, list[int]] = {r: [] for r in range(world)}
            for k in range(batches_per_loader):
                b = k * num_loaders + loader
                if position is not None and position.skip(b):
                    assert (loader, b) in trained, f"batch {b} of loader {loader} skipped but never trained"
                    continue
                assert (loader, b) not in trained, f"batch {b} of loader {loader} sent again after training"
                sent[b % world].append(b)
            for r in range(world):
                n = len(sent[r]) if cuts is None else min(cuts[(r + loader) % len(cuts)], len(sent[r]))
                trained |= {(loader, b) for b in sent[r][:n]}
                counts[r][loader] = counts[r].get(loader, 0) + n
        progress = {"step": 0, "world_size": world, "loaders": plan.merge_positions(counts), "earlier": earlier}
    assert len(trained) == num_loaders * batches_per_loader


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.lists(st.integers(0, 12), min_size=1, max_size=4)), max_size=5),
       st.integers(1, 3), st.integers(0, 40))
def test_resumes_across_world_size_changes_train_every_batch_exactly_once(runs, num_loaders, batches):
    _replay([*runs, (3, None)], num_loaders, batches)


def test_a_malformed_earlier_run_is_refused_naming_it(tmp_path):
    from persia.nn_worker.periodic import read_progress

    (tmp_path / plan.PROGRESS).write_text('{"step": 3, "world_size": 1, "loaders": {}, "earlier": [{"world_size": 0}]}')
    with pytest.raises(ValueError, match=r"progress.json: malformed progress file: earlier run \{'world_size': 0\}"):
        read_progress(tmp_path)


OUTCOMES = ["trained", "non_finite_loss", "lost_id_features", "uneven_tail", "abandoned"]


def _consumer_cut(outcomes: list[str], cut: int, uncounted: frozenset[str] = frozenset()) -> tuple[int, set[int]]:
    """One loader, one rank: the training loop consumes ``cut`` batches in arrival order with the
    given outcomes (then the checkpoint); returns the position recorded and the batches whose send
    is spent (trained, skipped, lost, dropped as the uneven tail: never to be trained from a
    resend). ``uncounted``: outcomes left out of the position, as the bugs below did."""
    position, spent = 0, set()
    for k, outcome in enumerate(outcomes[:cut]):
        if outcome == "abandoned":
            break  # the loop stopped: nothing after it was consumed either
        spent.add(k)
        if plan.advances_position(outcome) and outcome not in uncounted:
            position += 1
    return position, spent


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(OUTCOMES[:4]), max_size=30), st.integers(0, 30))
def test_a_consumed_batch_moves_its_loaders_position_whatever_became_of_it(outcomes, cut):
    """After a resume the loader sends exactly the batches the loop had not consumed: none that
    was trained, skipped or lost is sent again (a lost batch stays lost, as in an undisturbed run)."""
    n, spent = _consumer_cut(outcomes, cut)
    position, _ = position_from_info({"step": 1, "world_size": 1, "loaders": {"0": {"0": n}} if n else {}}, 0, 1)
    resent = [k for k in range(len(outcomes)) if not position.skip(k)]
    assert resent == [k for k in range(len(outcomes)) if k not in spent]


def test_the_outcomes_that_move_a_position():
    assert all(plan.advances_position(o) for o in ("trained", "lost_id_features", "non_finite_loss",
                                                   "non_finite_dense_grad", "non_finite_embedding_grad",
                                                   "amp_overflow", "uneven_tail"))
    assert not any(plan.advances_position(o) for o in ("abandoned", "evaluated"))
    # the bug this rule fixes: a lost batch left out of the count made the resumed loader skip one
    # batch too few, sending batch 2 (already trained) again
    n, _ = _consumer_cut(["trained", "lost_id_features", "trained"], 3, uncounted=frozenset({"lost_id_features"}))
    position, _ = position_from_info({"step": 2, "world_size": 1, "loaders": {"0": {"0": n}}}, 0, 1)
    assert [k for k in range(4) if not position.skip(k)] == [2, 3]


def test_the_uneven_tail_moves_the_position_so_the_next_epoch_resumes_exactly():
    """A DDP rank drops the last two batches of epoch 1 (the other rank had none left); epoch 2's
    batches follow them in the loader's order. Left out of the count, the tail made a resumed
    loader skip two batches too few and send epoch 2's last trained batches, 7 and 8, again."""
    outcomes = ["trained"] * 3 + ["uneven_tail"] * 2 + ["trained"] * 4
    for uncounted, resent in ((frozenset({"uneven_tail"}), [7, 8, 9]), (frozenset(), [9])):
        n, _ = _consumer_cut(outcomes, 9, uncounted=uncounted)
        position, _ = position_from_info({"step": 7, "world_size": 1, "loaders": {"0": {"0": n}}}, 0, 1)
        assert [k for k in range(10) if not position.skip(k)] == resent


def test_a_resume_with_another_number_of_data_loaders_is_refused_naming_both_and_the_checkpoint():
    from persia.data_loader.resume import loader_count_error

    info = {"step": 20, "world_size": 2, "loader_size": 1, "path": "/c/ckpt-20",
            "loaders": {"0": {"0": 20, "1": 20}}}
    assert loader_count_error(info, 1) is None
    why = loader_count_error(info, 2)
    assert "checkpoint /c/ckpt-20 was written with 1 data loaders, this job has 2" in why
    assert "Run 1 data loaders to resume it" in why
    assert "written with 3 data loaders, this job has 2" in loader_count_error({**info, "loader_size": 3}, 2)
    # positions only in an earlier run (another NN world size) still bind the loaders' count
    earlier = {**info, "loaders": {}, "earlier": [{"world_size": 1, "loaders": {"0": {"0": 5}}}]}
    assert "this job has 2" in loader_count_error(earlier, 2)
    # nothing trained (a fresh job, an explicit checkpoint without positions): any number starts at 0
    assert loader_count_error(None, 3) is None
    assert loader_count_error({**info, "loaders": {"0": {"0": 0}}}, 3) is None
    assert loader_count_error({"step": 0, "world_size": None, "loaders": {}, "path": "/x"}, 3) is None
    # written before the count was recorded: refused as far as the positions tell
    old = {"step": 9, "world_size": 1, "path": "/c/ckpt-9", "loaders": {"0": {"0": 4}, "2": {"0": 5}}}
    assert "has positions for data loader 2, this job has 2" in loader_count_error(old, 2)
    assert loader_count_error(old, 3) is None


def test_a_malformed_loader_count_is_refused_naming_it(tmp_path):
    from persia.nn_worker.periodic import read_progress

    (tmp_path / plan.PROGRESS).write_text('{"step": 3, "world_size": 1, "loaders": {}, "loader_size": 0}')
    with pytest.raises(ValueError, match="loader_size 0"):
        read_progress(tmp_path)


def test_a_loader_restarted_in_place_skips_what_every_rank_already_has():
    """Two NN ranks train on while loader 0's process is killed and restarted: the checkpoint the
    job resumed from had rank 0 at 3 and rank 1 at 2 of its batches; since then rank 0 acknowledged
    4 more and rank 1 3 more (some trained, some still in flight: they are that rank's). The new
    process replays its stream and sends only what neither rank has."""
    from persia.data_loader.resume import live_resume

    resume = {"step": 2, "world_size": 2, "loader_size": 1, "path": "/c/ckpt-2", "earlier": [],
              "loaders": {"0": {"0": 3, "1": 2}}}
    answers = [{"rank": 0, "world_size": 2, "earlier": [], "loaders": {"0": 7}},
               {"rank": 1, "world_size": 2, "earlier": [], "loaders": {"0": 5}}]
    live = live_resume(resume, answers, 2)
    assert live["loaders"] == {"0": {"0": 7, "1": 5}} and live["path"] == "/c/ckpt-2"
    position, _ = position_from_info(live, 0, 2)
    # rank 0 has batches 0, 2, .., 12 (7), rank 1 has 1, 3, .., 9 (5): 11 and 13 on are sent again
    assert [k for k in range(16) if not position.skip(k)] == [11, 13, 14, 15]
    # a fresh job, nothing delivered yet: no position at all, as before
    empty = [{"rank": r, "world_size": 2, "earlier": [], "loaders": {}} for r in (0, 1)]
    assert live_resume(None, empty, 2) is None
    # after a resume onto another world size, the earlier run is replayed first
    earlier = [{"world_size": 1, "loaders": {"0": {"0": 4}}}]
    answers = [{"rank": 0, "world_size": 2, "earlier": earlier, "loaders": {"0": 1}},
               {"rank": 1, "world_size": 2, "earlier": earlier, "loaders": {}}]
    position, _ = position_from_info(live_resume({**resume, "world_size": 1}, answers, 2), 0, 2)
    assert [k for k in range(8) if not position.skip(k)] == [5, 6, 7]  # 0-3 (earlier run), 4 (rank 0)
    with pytest.raises(ValueError, match="rank 2"):
        live_resume(resume, [{"rank": 2, "world_size": 2, "loaders": {}}], 2)
