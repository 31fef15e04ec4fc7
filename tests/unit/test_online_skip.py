"""A data loader's skip on resume (persia.data_loader.resume.StreamPosition) after many rescales:
once every trained batch is skipped, the rest of an endless stream costs no walk over the runs."""

from persia.data_loader.resume import StreamPosition


def test_after_the_trained_batches_no_run_is_walked_again():
    # 200 earlier runs (an online job rescaled 200 times), each with a few trained batches
    runs = [(1 + i % 3, {0: 1}) for i in range(200)]
    position = StreamPosition(runs)
    skipped = [b for b in range(1000) if position.skip(b)]
    assert len(skipped) == position.total == 200 and position.remaining == 0
    before = [dict(sent) for _, _, sent in position._runs]
    assert not any(position.skip(b) for b in range(1000, 5000))
    # before, every later batch id went through all 200 runs, counting it in each
    assert [dict(sent) for _, _, sent in position._runs] == before
