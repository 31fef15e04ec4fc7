"""Online training never ends: what a TrainCtx keeps per periodic checkpoint stays bounded."""

from persia.nn_worker import checkpoint_plan as plan
from persia.nn_worker.periodic import CHECKPOINT_TIMES_KEPT, PeriodicCheckpointing


def test_the_checkpoint_durations_kept_are_bounded():
    """``checkpoint_seconds`` held one float per checkpoint for the life of the context: a
    checkpoint every 100 steps at 36 batches/s is 31,000 a day."""
    ctx = PeriodicCheckpointing.__new__(PeriodicCheckpointing)
    ctx._init_checkpointing(plan.CheckpointSettings())
    for i in range(CHECKPOINT_TIMES_KEPT * 3):
        ctx.checkpoint_seconds.append(float(i))
    assert len(ctx.checkpoint_seconds) == CHECKPOINT_TIMES_KEPT
    assert ctx.checkpoint_seconds[-1] == CHECKPOINT_TIMES_KEPT * 3 - 1  # the latest are the ones kept
