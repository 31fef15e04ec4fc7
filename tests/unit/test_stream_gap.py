"""Where a batch stands in its loader's stream to its rank (persia.nn_worker.checkpoint_plan:
``batch_ordinal``, ``stream_gap``), the decision behind an NN rank refusing a data loader process
that streamed on past the rank's restart (tests/integration/test_online_nn_restart.py)."""

import pytest
from persia.nn_worker.checkpoint_plan import batch_ordinal, stream_gap


@pytest.mark.parametrize("loader_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_the_ordinal_counts_the_loaders_batches_to_the_same_rank(loader_size, world_size):
    for loader in range(loader_size):
        seen: dict[int, int] = {}
        for counter in range(200):
            batch_id = counter * loader_size + loader
            rank = batch_id % world_size
            seen[rank] = seen.get(rank, 0) + 1
            assert batch_ordinal(batch_id, loader, loader_size, world_size) == seen[rank], (batch_id, loader)


def test_a_loader_that_asked_the_rank_continues_without_a_gap_one_that_streamed_on_leaves_one():
    # one loader, one rank: the checkpoint has 100 batches, the rank took 0 since
    assert stream_gap(100, 0, 1, 1, position=100, delivered=0) == 0  # the loader resent from there
    assert stream_gap(136, 0, 1, 1, position=100, delivered=0) == 36  # 100-135 went to the dead process
    assert stream_gap(98, 0, 1, 1, position=100, delivered=0) == -2  # resends batches 98, 99, which the rank has
    # two loaders, two ranks: loader 1's batches 1, 3, 5, ... all go to rank 1
    assert stream_gap(2 * 10 + 1, 1, 2, 2, position=8, delivered=2) == 0


def test_a_batch_of_another_loader_is_refused_by_the_function():
    with pytest.raises(ValueError):
        batch_ordinal(5, 0, 2, 1)
