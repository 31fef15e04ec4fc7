"""OperatorConfig: the lease timings must keep two replicas from being active at once,
and a rejected value is named with its field, its env variable and the value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from persia_operator.config import OperatorConfig, lease_timing_problem


def test_defaults_and_the_boundary_are_accepted():
    config = OperatorConfig()
    assert (config.lease_duration, config.renew_period, config.retry_period) == (15, 5, 2)
    assert OperatorConfig(lease_duration=15, renew_period=10).renew_period == 10  # exactly 2/3
    assert OperatorConfig(lease_duration=1, renew_period=0.2).lease_duration == 1  # the leader tests' timings


@pytest.mark.parametrize("lease, renew", [(15, 15), (15, 20), (15, 10.5), (3, 2.5)])
def test_renewing_later_than_the_step_down_deadline_is_rejected(lease, renew):
    env = {"PERSIA_OPERATOR_LEASE_DURATION": str(lease), "PERSIA_OPERATOR_RENEW_PERIOD": str(renew)}
    with pytest.raises(ValidationError) as info:
        OperatorConfig.from_env(env)
    text = str(info.value)
    for part in ("renew_period", "PERSIA_OPERATOR_RENEW_PERIOD", f"{renew:g}",
                 "lease_duration", "PERSIA_OPERATOR_LEASE_DURATION", f"{lease:g}"):  # fmt: skip
        assert part in text


def test_a_lease_shorter_than_a_whole_second_is_rejected():
    # leaseDurationSeconds is an integer: 0.5 would be written as a lease no one holds.
    with pytest.raises(ValidationError) as info:
        OperatorConfig.from_env({"PERSIA_OPERATOR_LEASE_DURATION": "0.5", "PERSIA_OPERATOR_RENEW_PERIOD": "0.1"})
    assert "lease_duration" in str(info.value) and "0.5" in str(info.value)


def test_retry_period_only_paces_a_standby():
    assert OperatorConfig(retry_period=60).retry_period == 60  # slow failover, never two leaders


def test_lease_timing_problem():
    assert lease_timing_problem(15, 5) is None
    assert lease_timing_problem(15, 10) is None
    problem = lease_timing_problem(15, 12)
    assert problem is not None and "<= 10" in problem
