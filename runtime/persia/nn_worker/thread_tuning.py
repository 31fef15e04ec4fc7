"""Choosing the NN worker's torch thread count by measuring training (``--nn-threads auto``): pure
decisions, and ``ThreadTuner``, which runs them with the clock and the thread setter it is given.

More intra-op threads are not always faster. Every parallel region of a step ends in a barrier;
with ``OMP_WAIT_POLICY=PASSIVE`` (what lets the other roles share the cores) each barrier puts a
thread to sleep and the next region wakes it, and on some machines a wake-up across cores costs
100+ µs: a small dense model (MLP 400, batch 256: ~90 regions per step) then steps faster on one
thread than on two, while a large one (FFNN 4096-...: a few long GEMMs) steps 1.4x faster on two.
Which holds depends on the model, the batch and the machine, so the NN worker measures it.

The measurement runs inside training: after ``start_step`` steps, blocks of ``block_steps`` steps
run at each candidate count in mirrored order (A B B A ...), so a steady drift of the step time
(the staleness ramp, a neighbour's load) weighs on every candidate alike; each block's time per
step is a sample, and the candidate with the lowest median wins. A smaller count wins ties within
``tie_margin``: it leaves CPU to the other roles.

A block's sample is the mean of its steps' times without the steps far slower than the block's
median (``outlier_factor``): the time between two steps also holds whatever the training script
does there, such as an evaluation or a checkpoint, and one such gap must not make the count that
happened to run it look slow.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TuningPlan:
    """What to measure. ``candidates[0]`` is the count training starts and calibrates with."""

    candidates: tuple[int, ...]
    start_step: int = 10  # first steps allocate, build caches and run the synchronous warm-up
    calibration_steps: int = 5
    # a block's least length; one slow step cannot decide it (``outlier_factor`` leaves it out), and
    # a short run still finishes measuring: 0.3 s blocks kept a 157-step MLP 400 run (10 ms steps)
    # measuring to its end, half of it at the slower count
    min_block_s: float = 0.1
    min_block_steps: int = 3
    rounds: int = 2  # each candidate runs 2 * rounds blocks
    tie_margin: float = 0.03
    # after a round, stop early when one count won every block by this much: a short run of a
    # large model should not spend a second round on a count 35% slower
    decisive_margin: float = 0.15
    # a count whose first block is this much slower than the start count's first block is dropped
    # at once: the FFNN at 1 thread (37% slower) costs 3 steps of its measurement, not 6
    clear_loss_margin: float = 0.25
    # ... if that block lasted this long. A 0.1 s block of 10 ms steps at the faster count once ran
    # 25% slow (12.1 against 9.7 ms, a latency run's), so short blocks wait for their round; a large
    # model's blocks (3 steps of 0.2 s) are long anyway, and there each further block costs most
    clear_loss_min_block_s: float = 0.3
    # measure again this many steps after a choice (None: never); each time costs about 2% of the
    # steps, half of them at the other count
    remeasure_steps: int | None = 5000
    # a step this many times the block's median is not training time (an evaluation, a checkpoint
    # between steps) and is left out of the block's sample
    outlier_factor: float = 3.0

    def __post_init__(self):
        if not self.candidates or any(c < 1 for c in self.candidates):
            raise ValueError(f"thread candidates must be >= 1, got {self.candidates}")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"thread candidates must be distinct, got {self.candidates}")

    @property
    def tunes(self) -> bool:
        return len(self.candidates) > 1


def candidates_for(max_threads: int) -> tuple[int, ...]:
    """The counts worth comparing up to ``max_threads`` (the start first): all of it, half of it,
    one thread. Counts in between rarely win by more than the measurement's noise."""
    if max_threads < 1:
        raise ValueError(f"max threads must be >= 1, got {max_threads}")
    out: list[int] = []
    for c in (max_threads, max_threads // 2, 1):
        if c >= 1 and c not in out:
            out.append(c)
    return tuple(out)


def block_steps(step_s: float, plan: TuningPlan) -> int:
    """Steps per block: at least ``min_block_steps`` and ``min_block_s`` of training."""
    if step_s <= 0 or not math.isfinite(step_s):
        return plan.min_block_steps
    return max(plan.min_block_steps, math.ceil(plan.min_block_s / step_s))


def block_order(plan: TuningPlan) -> list[int]:
    """Candidate per block, mirrored: A B C C B A, ``rounds`` times."""
    forward = list(plan.candidates)
    return (forward + forward[::-1]) * plan.rounds


def block_sample(step_times: list[float], plan: TuningPlan) -> float:
    """A block's seconds per step: the mean over its steps, leaving out those over
    ``outlier_factor`` times the block's median (what the script did between two steps)."""
    if not step_times:
        raise ValueError("a block needs at least one step")
    limit = statistics.median(step_times) * plan.outlier_factor
    kept = [t for t in step_times if t <= limit]
    return sum(kept) / len(kept)


def choose(samples: dict[int, list[float]], plan: TuningPlan) -> int:
    """The count with the lowest median seconds per step; a smaller count within ``tie_margin`` of
    the best is preferred."""
    medians = {c: statistics.median(v) for c, v in samples.items() if v}
    if not medians:
        return plan.candidates[0]
    best = min(medians.values())
    return min(c for c, m in medians.items() if m <= best * (1 + plan.tie_margin))


def decisive(samples: dict[int, list[float]], plan: TuningPlan) -> bool:
    """Whether the measurement can stop: the fastest count's slowest block beat every other count's
    fastest block, by ``decisive_margin``."""
    if any(not v for v in samples.values()):
        return False
    best = min(samples, key=lambda c: statistics.median(samples[c]))
    worst_of_best = max(samples[best])
    return all(min(v) >= worst_of_best * (1 + plan.decisive_margin) for c, v in samples.items() if c != best)


def clearly_slower(first_s: float, start_first_s: float, steps: int, plan: TuningPlan) -> bool:
    """Whether a count whose first block took ``first_s`` a step (``steps`` steps) lost clearly
    to the start count's first block (``start_first_s`` a step): by ``clear_loss_margin``, in a
    block at least ``clear_loss_min_block_s`` long."""
    return (first_s * steps >= plan.clear_loss_min_block_s
            and first_s >= start_first_s * (1 + plan.clear_loss_margin))


def describe(samples: dict[int, list[float]], chosen: int) -> str:
    """The log line's figures: each candidate's median ms per step and block count."""
    parts = []
    for c in sorted(samples):
        v = samples[c]
        if v:
            parts.append(f"{c} thread{'s' if c > 1 else ''} {1000 * statistics.median(v):.1f} ms/step ({len(v)} blocks)")
    return f"torch threads: {chosen} (median step time: {', '.join(parts)})"


class ThreadTuner:
    """Runs a ``TuningPlan`` along training: ``step_done()`` after every step, and again every
    ``remeasure_steps`` steps from the count chosen last (what is fastest can change in a long run:
    another job on the node, another phase of the data).

    ``set_threads`` applies a count (``torch.set_num_threads``); ``clock`` gives seconds. With
    several ranks ``agree(values)`` returns the element-wise maximum over ranks (an all-reduce),
    so every rank runs the same blocks and takes the same count: their steps wait for each other.
    """

    def __init__(self, plan: TuningPlan, set_threads, clock, agree=None, log=None):
        self.plan = plan
        self._set = set_threads
        self._clock = clock
        self._agree = agree
        self._log = log
        self.steps = 0
        self.measurements = 0  # finished
        self.samples: dict[int, list[float]] = {c: [] for c in plan.candidates}
        self.chosen: int | None = None if plan.tunes else plan.candidates[0]
        self.block: int | None = None
        self._phase = "wait"  # of the measurement running (chosen is None): wait, calibrate, blocks
        self._held = False
        self._dropped: set[int] = set()  # clearly slower counts of this measurement
        self._decided_at = 0
        self._order = block_order(plan)
        self._index = 0  # the block running
        self._mark_step = 0  # the step count when calibration or the running block started
        self._last = 0.0  # when the last step ended
        self._times: list[float] = []  # the running calibration's or block's step times

    @property
    def measuring(self) -> bool:
        return self.chosen is None

    def step_done(self) -> None:
        self.steps += 1
        p = self.plan
        if self.chosen is not None:
            if (not self._held and p.tunes and p.remeasure_steps
                    and self.steps - self._decided_at >= p.remeasure_steps):
                self._measure_again()
            return
        if self._phase == "wait":
            if self.steps >= p.start_step:
                self._start_calibration()
            return
        now = self._clock()
        self._times.append(now - self._last)
        self._last = now
        if self._phase == "calibrate":
            if self.steps - self._mark_step < p.calibration_steps:
                return
            step_s = block_sample(self._times, p)
            self.block = int(self._agreed([block_steps(step_s, p)])[0])
            self._phase = "blocks"
            self._begin(0, now)
            return
        if self.steps - self._mark_step < self.block:
            return
        count = self._order[self._index]
        self.samples[count].append(block_sample(self._times, p))
        done = self._index + 1
        if self._clearly_slower(count):  # none of its later blocks; the start count alone left: decided
            self._dropped.add(count)
            self._order = self._order[:done] + [c for c in self._order[done:] if c != count]
        round_done = done % (2 * len(p.candidates)) == 0
        alone = len(p.candidates) - len(self._dropped) == 1
        if done < len(self._order) and not alone and not (round_done and self._everywhere(decisive(self.samples, p))):
            self._begin(done, now)
            return
        self._decide()

    def hold(self, reason: str) -> None:
        """Stop measuring, now and later, and keep the count training started with (a reproducible
        stream: the thread count changes how torch sums, and a timing-driven choice would differ
        per run). A count already chosen stays."""
        self._held = True
        if self.chosen is not None:
            return
        self.chosen = self.plan.candidates[0]
        self._set(self.chosen)
        if self._log is not None:
            self._log(f"torch threads: {self.chosen}, not measured ({reason})")

    def _measure_again(self) -> None:
        """A new measurement that starts (and calibrates) at the count chosen last."""
        chosen = self.chosen
        self.plan = replace(self.plan, candidates=(chosen, *(c for c in self.plan.candidates if c != chosen)))
        self.samples = {c: [] for c in self.plan.candidates}
        self._dropped = set()
        self._order = block_order(self.plan)
        self.chosen = None
        self._start_calibration()

    def _start_calibration(self) -> None:
        self._phase, self._mark_step = "calibrate", self.steps
        self._last, self._times = self._clock(), []

    def _begin(self, index: int, now: float) -> None:
        self._index, self._mark_step, self._last, self._times = index, self.steps, now, []
        self._set(self._order[index])

    def _decide(self) -> None:
        cands = self.plan.candidates
        medians = self._agreed([statistics.median(self.samples[c]) for c in cands])
        # the agreed medians decide, so every rank picks the same count
        self.chosen = choose({c: [m] for c, m in zip(cands, medians)}, self.plan)
        self._decided_at = self.steps
        self.measurements += 1
        self._set(self.chosen)
        if self._log is not None:
            self._log(describe(self.samples, self.chosen))

    def _clearly_slower(self, count: int) -> bool:
        """``count``'s first block, ``clear_loss_min_block_s`` long or more, lost to the start
        count's first block by ``clear_loss_margin``, on every rank."""
        start = self.plan.candidates[0]
        if count == start or len(self.samples[count]) != 1 or not self.samples[start]:
            return False
        first = self.samples[count][0]
        return self._everywhere(clearly_slower(first, self.samples[start][0], self.block, self.plan))

    def _everywhere(self, flag: bool) -> bool:
        """``flag`` holds on every rank (the maximum of 0 where it holds, 1 where not)."""
        return self._agreed([0.0 if flag else 1.0])[0] == 0.0

    def _agreed(self, values: list[float]) -> list[float]:
        return list(values) if self._agree is None else [float(v) for v in self._agree(list(values))]
