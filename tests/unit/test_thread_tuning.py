"""The NN worker's thread-count tuning: the pure decisions and the tuner on a simulated clock."""

import pytest

from persia.nn_worker.thread_tuning import (
    ThreadTuner,
    TuningPlan,
    block_order,
    block_sample,
    block_steps,
    candidates_for,
    choose,
    clearly_slower,
    decisive,
    describe,
)


def test_candidates_all_half_one():
    assert candidates_for(1) == (1,)
    assert candidates_for(2) == (2, 1)
    assert candidates_for(3) == (3, 1)
    assert candidates_for(8) == (8, 4, 1)
    with pytest.raises(ValueError, match="max threads must be >= 1, got 0"):
        candidates_for(0)


@pytest.mark.parametrize("bad", [(), (0, 1), (2, 2)])
def test_plan_refuses_bad_candidates(bad):
    with pytest.raises(ValueError, match="thread candidates"):
        TuningPlan(candidates=bad)


def test_block_order_is_mirrored():
    assert block_order(TuningPlan((2, 1), rounds=2)) == [2, 1, 1, 2, 2, 1, 1, 2]
    assert block_order(TuningPlan((8, 4, 1), rounds=1)) == [8, 4, 1, 1, 4, 8]


def test_block_steps_cover_the_minimum_time():
    plan = TuningPlan((2, 1), min_block_s=0.3, min_block_steps=3)
    assert block_steps(0.02, plan) == 15
    assert block_steps(0.2, plan) == 3
    assert block_steps(0.0, plan) == 3
    assert block_steps(float("nan"), plan) == 3


def test_choose_prefers_fewer_threads_within_the_margin():
    plan = TuningPlan((2, 1), tie_margin=0.03)
    assert choose({2: [0.020, 0.021], 1: [0.0205, 0.0206]}, plan) == 1  # within 3%
    assert choose({2: [0.010, 0.010], 1: [0.016, 0.016]}, plan) == 2
    assert choose({2: [], 1: []}, plan) == 2  # nothing measured: stay where training started
    assert describe({2: [0.010], 1: [0.016, 0.018]}, 2) == (
        "torch threads: 2 (median step time: 1 thread 17.0 ms/step (2 blocks), 2 threads 10.0 ms/step (1 blocks))")


def test_a_block_sample_leaves_out_what_ran_between_two_steps():
    plan = TuningPlan((2, 1), outlier_factor=3.0)
    assert block_sample([0.02, 0.02, 0.02], plan) == pytest.approx(0.02)
    assert block_sample([0.02, 0.021, 1.5, 0.019], plan) == pytest.approx(0.02)  # an evaluation
    assert block_sample([0.02, 0.05, 0.02], plan) == pytest.approx(0.03)  # 2.5x the median: a slow step, kept
    with pytest.raises(ValueError, match="at least one step"):
        block_sample([], plan)


class Sim:
    """A training loop whose step time depends on the thread count (and optionally drifts);
    ``pauses`` adds seconds before a step (an evaluation the script runs between two steps)."""

    def __init__(self, per_threads: dict[int, float], drift_per_step: float = 0.0, start: int = 2,
                 pauses: dict[int, float] | None = None):
        self.per_threads, self.drift = per_threads, drift_per_step
        self.threads, self.now, self.step = start, 0.0, 0
        self.pauses = pauses or {}
        self.applied: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.applied.append(n)

    def run(self, tuner: ThreadTuner, steps: int) -> None:
        for _ in range(steps):
            self.now += self.pauses.get(self.step, 0.0)
            self.now += self.per_threads[self.threads] + self.drift * self.step
            self.step += 1
            tuner.step_done()


def _tuner(sim: Sim, plan: TuningPlan, **kw) -> ThreadTuner:
    return ThreadTuner(plan, sim.set_threads, lambda: sim.now, **kw)


def test_tuner_picks_one_thread_where_it_steps_faster():
    sim = Sim({2: 0.021, 1: 0.019})  # 10% apart: not decisive after one round, so two rounds
    lines = []
    plan = TuningPlan((2, 1), start_step=10, calibration_steps=5, min_block_s=0.3, rounds=2)
    tuner = _tuner(sim, plan, log=lines.append)
    sim.run(tuner, 14)
    assert tuner.measuring and sim.applied == []  # nothing changes before calibration ends
    sim.run(tuner, 1)
    assert tuner.block == 15  # 0.3 s of 21 ms steps
    sim.run(tuner, 8 * 15)
    assert not tuner.measuring and tuner.chosen == 1
    assert sim.applied == [2, 1, 1, 2, 2, 1, 1, 2, 1]  # the blocks, then the choice
    assert tuner.samples[1] == pytest.approx([0.019] * 4) and tuner.samples[2] == pytest.approx([0.021] * 4)
    assert lines == ["torch threads: 1 (median step time: 1 thread 19.0 ms/step (4 blocks), "
                     "2 threads 21.0 ms/step (4 blocks))"]
    sim.run(tuner, 50)
    assert sim.applied[-1] == 1 and len(sim.applied) == 9  # decided once


def test_an_evaluation_inside_a_block_does_not_decide_the_count():
    """Steps 10-14 calibrate, then blocks of 15 steps: 2 1 1 2 ... A 2 s evaluation before step 35,
    in the first 1-thread block (steps 30-44), made that block's mean 0.15 s per step and 2 threads
    the choice."""
    sim = Sim({2: 0.021, 1: 0.019}, pauses={35: 2.0})
    tuner = _tuner(sim, TuningPlan((2, 1), start_step=10, calibration_steps=5, min_block_s=0.3, rounds=2))
    sim.run(tuner, 15 + 8 * 15)
    assert tuner.block == 15 and sim.applied[:2] == [2, 1]  # the evaluation fell in a 1-thread block
    assert tuner.chosen == 1
    assert tuner.samples[1] == pytest.approx([0.019] * 4) and tuner.samples[2] == pytest.approx([0.021] * 4)


def test_an_evaluation_during_calibration_does_not_shorten_the_blocks():
    """Calibrated on a 2 s evaluation, the step looked 0.4 s long and the blocks became 3 steps."""
    sim = Sim({2: 0.021, 1: 0.019}, pauses={12: 2.0})
    tuner = _tuner(sim, TuningPlan((2, 1), start_step=10, calibration_steps=5, min_block_s=0.3, rounds=2))
    sim.run(tuner, 15)
    assert tuner.block == 15  # 0.3 s of 21 ms steps


def test_a_count_clearly_slower_in_its_first_block_is_dropped_at_once():
    """The FFNN's case: one thread 60% slower costs one block at one thread, not a round."""
    sim = Sim({2: 0.180, 1: 0.290})
    tuner = _tuner(sim, TuningPlan((2, 1), start_step=3, calibration_steps=2, rounds=3))
    sim.run(tuner, 3 + 2 + 2 * 3)
    assert tuner.block == 3 and tuner.chosen == 2
    assert sim.applied == [2, 1, 2]


def test_one_short_block_does_not_drop_a_count():
    """A 157-step MLP 400 run (10 ms steps, 0.1 s blocks): one thread's first block ran 25% slower
    than two threads' (12.1 against 9.7 ms), and the rule that drops a count after one block chose
    two threads, where one thread is the faster in every other run. A block that short waits for
    its round."""
    plan = TuningPlan((2, 1))
    assert block_steps(0.0097, plan) == 11
    assert not clearly_slower(0.0122, 0.0097, 11, plan)  # 0.13 s: too short to decide alone
    assert clearly_slower(0.0122, 0.0097, 30, plan)  # the same loss over 0.36 s
    assert clearly_slower(0.290, 0.180, 3, plan)  # the FFNN: 3 steps, 0.87 s
    assert not clearly_slower(0.200, 0.180, 3, plan)  # 11%: not by the margin
    assert not clearly_slower(0.080, 0.180, 3, plan)  # faster

    burst = {26 + i: 0.0035 for i in range(11)}  # the first one-thread block (steps 26-36): +3.5 ms a step
    sim = Sim({2: 0.0097, 1: 0.0090}, pauses=burst)
    tuner = _tuner(sim, TuningPlan((2, 1), start_step=10, calibration_steps=5, rounds=2))
    sim.run(tuner, 15)
    assert tuner.block == 11
    sim.run(tuner, 8 * 11)
    assert tuner.samples[1][0] > tuner.samples[2][0] * 1.25  # it did lose its first block clearly...
    assert tuner.chosen == 1 and len(tuner.samples[1]) == 4  # ...and was measured on, and won


def test_one_decisive_round_is_enough():
    sim = Sim({2: 0.180, 1: 0.216})  # 20%: not clearly slower at once, decisive after a round
    tuner = _tuner(sim, TuningPlan((2, 1), start_step=3, calibration_steps=2, rounds=3))
    sim.run(tuner, 3 + 2 + 4 * 3)
    assert tuner.chosen == 2 and sim.applied == [2, 1, 1, 2, 2]  # one round of four blocks, not three


def test_only_the_start_count_is_kept_by_dropping():
    """A faster count is never dropped, nor the start count: 1 thread 40% faster goes on measuring."""
    sim = Sim({2: 0.280, 1: 0.200})
    tuner = _tuner(sim, TuningPlan((2, 1), start_step=1, calibration_steps=1, rounds=1, decisive_margin=1.0))
    sim.run(tuner, 2 + 4 * 3)
    assert tuner.chosen == 1 and sim.applied == [2, 1, 1, 2, 1]


def test_decisive_needs_every_block_of_the_winner_ahead_by_the_margin():
    plan = TuningPlan((2, 1), decisive_margin=0.15)
    assert decisive({2: [0.180, 0.185], 1: [0.290, 0.300]}, plan)
    assert not decisive({2: [0.180, 0.260], 1: [0.290, 0.300]}, plan)  # one slow block of the winner
    assert not decisive({2: [0.019, 0.019], 1: [0.021, 0.021]}, plan)  # 10% apart
    assert not decisive({2: [0.180], 1: []}, plan)


def test_mirrored_blocks_cancel_a_steady_drift():
    """Equal counts under a step time that grows every step: mirrored order measures them alike
    (a tie, so the smaller count); in A B A B order the later blocks would look slower."""
    sim = Sim({2: 0.020, 1: 0.020}, drift_per_step=0.0005)
    tuner = _tuner(sim, TuningPlan((2, 1), start_step=1, calibration_steps=1, min_block_s=0.1, rounds=2,
                                   tie_margin=1e-9))
    sim.run(tuner, 2 + 8 * 5)
    assert tuner.chosen == 1
    m1, m2 = (sorted(tuner.samples[c]) for c in (1, 2))
    assert (m1[1] + m1[2]) == pytest.approx(m2[1] + m2[2])


def test_ranks_agree_on_blocks_and_choice():
    """``agree`` is the all-reduce (max): the other rank's slower calibration sets the block, and
    its medians (2 threads faster there) decide for both."""
    sim = Sim({2: 0.021, 1: 0.018})
    calls = []

    def agree(values):
        calls.append(list(values))
        if len(calls) == 1:
            other = [20]  # the block length
        elif len(values) == 1:
            other = [1.0]  # a flag (count clearly slower): "not here"
        else:
            other = [0.015, 0.030]  # medians for (2, 1)
        return [max(a, b) for a, b in zip(values, other)]

    tuner = _tuner(sim, TuningPlan((2, 1), start_step=1, calibration_steps=1, min_block_s=0.1, rounds=1), agree=agree)
    sim.run(tuner, 2 + 4 * 20)
    assert tuner.block == 20 and tuner.chosen == 2 and sim.applied[-1] == 2


def test_one_candidate_never_measures():
    sim = Sim({1: 0.01}, start=1)
    tuner = _tuner(sim, TuningPlan((1,)))
    sim.run(tuner, 100)
    assert tuner.chosen == 1 and sim.applied == []


def test_hold_keeps_the_start_count_and_ends_the_measurement():
    sim = Sim({2: 0.021, 1: 0.019})
    lines = []
    tuner = _tuner(sim, TuningPlan((2, 1), start_step=1, calibration_steps=1, min_block_s=0.0, min_block_steps=1),
                   log=lines.append)
    sim.run(tuner, 4)  # measuring: the second block (1 thread) is running
    assert tuner.measuring and sim.threads == 1
    tuner.hold("reproducible mode")
    assert tuner.chosen == 2 and sim.threads == 2 and lines == ["torch threads: 2, not measured (reproducible mode)"]
    sim.run(tuner, 50)
    tuner.hold("again")
    assert sim.applied[-1] == 2 and len(lines) == 1


def test_a_long_run_measures_again_from_the_count_chosen_last():
    """The machine changes mid-run (two threads become the faster): the next measurement, which
    starts and calibrates at the count chosen last, follows it."""
    sim = Sim({2: 0.021, 1: 0.015})
    lines = []
    plan = TuningPlan((2, 1), start_step=2, calibration_steps=2, min_block_s=0.0, min_block_steps=2, rounds=1,
                      remeasure_steps=100)
    tuner = _tuner(sim, plan, log=lines.append)
    sim.run(tuner, 2 + 2 + 4 * 2)
    assert tuner.chosen == 1 and tuner.measurements == 1 and sim.applied == [2, 1, 1, 2, 1]
    sim.per_threads = {2: 0.010, 1: 0.015}
    sim.run(tuner, 99)
    assert not tuner.measuring and len(sim.applied) == 5  # not yet: 100 steps after the choice
    sim.run(tuner, 1)
    assert tuner.measuring and tuner.plan.candidates == (1, 2) and sim.threads == 1  # calibrates at 1
    sim.run(tuner, 2 + 4 * 2)
    assert tuner.chosen == 2 and tuner.measurements == 2
    assert sim.applied[5:] == [1, 2, 2, 1, 2]
    assert len(lines) == 2 and lines[1].startswith("torch threads: 2 ")


def test_no_measurement_again_when_held_or_switched_off():
    for plan_kw, hold in (({"remeasure_steps": 10}, True), ({"remeasure_steps": None}, False)):
        sim = Sim({2: 0.021, 1: 0.015})
        plan = TuningPlan((2, 1), start_step=1, calibration_steps=1, min_block_s=0.0, min_block_steps=1, rounds=1,
                          **plan_kw)
        tuner = _tuner(sim, plan)
        sim.run(tuner, 1 + 1 + 4)
        assert tuner.chosen == 1
        if hold:
            tuner.hold("reproducible mode")  # after a choice: the choice stays, and no more measuring
        sim.run(tuner, 200)
        assert tuner.measurements == 1 and tuner.chosen == 1 and sim.applied == [2, 1, 1, 2, 1]
