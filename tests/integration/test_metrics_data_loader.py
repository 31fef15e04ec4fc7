"""The data loader's metrics (docs/metrics.md, role ``data_loader``) on a real training path: what
it sent, what failed and why, and nothing left held or in flight after its ``DataCtx``. Real NATS,
real gRPC servers on loopback, real torch; the counters are read in-process (the /metrics export of
a real job: tests/serving/test_online.py, tests/integration/test_metrics_launcher.py)."""

from __future__ import annotations

import pytest

from persia.data_loader import ctx as loader_ctx
from persia.metrics import Metrics
from tests.integration.test_batch_integrity import train_through_failed_sends
from tests.integration.test_concurrent_legs import hold_forward
from tests.integration.test_training_path import make_batch

pytestmark = pytest.mark.integration


def recorded_metrics(monkeypatch) -> list[Metrics]:
    """Every ``Metrics`` the data loader's contexts make from now on."""
    made: list[Metrics] = []

    class Recorded(Metrics):
        def __init__(self, role: str, replica: int):
            super().__init__(role, replica)
            made.append(self)

    monkeypatch.setattr(loader_ctx, "Metrics", Recorded)
    return made


def test_a_dense_leg_that_fails_is_counted_by_its_reason(persia_env, monkeypatch):
    made = recorded_metrics(monkeypatch)
    batches = [make_batch(i) for i in range(4)]
    batches[1].meta = b"x" * (65 * 1024 * 1024)  # over NATS max_payload: the dense leg fails
    seen, errors, _ = train_through_failed_sends(batches)
    assert seen == [0, 2, 3] and len(errors) == 1
    [m] = made
    assert (m.role, m.replica, m.job) == ("data_loader", 0, persia_env)
    assert m.get("data_loader_batches_sent") == 3
    assert m.get("data_loader_batches_failed", feat="send_dense") == 1
    assert m.get("data_loader_batches_failed", feat="lost_id_features") == 0
    # each send timed, the failed one too (batch 1 too large to share a message goes alone)
    assert m.get("data_loader_send_time_cost_sec_count") >= 3
    assert m.get("data_loader_send_time_cost_sec_sum") > 0
    assert m.get("data_loader_batches_held") == 0 and m.get("data_loader_sends_in_flight") == 0


def test_an_id_leg_lost_after_the_nn_rank_got_the_batch_is_counted_as_lost(persia_env, monkeypatch):
    made = recorded_metrics(monkeypatch)
    hold_forward(monkeypatch, batch_id=1, then_fail=True)
    seen, errors, _ = train_through_failed_sends([make_batch(i) for i in range(4)], lookup_wait_sec=600)
    assert seen == [0, 2, 3] and len(errors) == 1
    [m] = made
    # the NN rank has all four (batch 1 in its count as failed), so all four are sent
    assert m.get("data_loader_batches_sent") == 4
    assert m.get("data_loader_batches_failed", feat="lost_id_features") == 1
    assert m.get("data_loader_batches_failed", feat="send_dense") == 0
    assert m.get("data_loader_batches_held") == 0 and m.get("data_loader_sends_in_flight") == 0
