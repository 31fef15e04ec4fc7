import random

from persia.data import BatchReorderer, _reordered


def test_reorder_releases_in_rank_order():
    r = BatchReorderer(rank=1, world_size=2)
    assert r.push(5, "b5") == []
    assert r.push(3, "b3") == []
    assert r.push(1, "b1") == ["b1", "b3", "b5"]
    assert r.push(7, "b7") == ["b7"]


def test_reordered_stream_is_sorted_even_when_ids_are_missing():
    ids = [i for i in range(0, 40, 2)]  # rank 0 of 2
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    shuffled.remove(10)  # a loader ended early: id 10 never comes
    out = [m["batch_id"] for m in _reordered(iter([{"batch_id": i} for i in shuffled]), 0, 2)]
    assert out == sorted(shuffled)
