"""``persia.env.switch_on``: the one parser of the runtime's on/off environment switches
(``PERSIA_FLUSH_DENORMAL``, ``PERSIA_MALLOC_TUNING``, ``PERSIA_REPLAY_OWN_UPDATES``)."""

from __future__ import annotations

import pytest

from persia.env import int_in_range, switch_on


@pytest.mark.parametrize("raw", ["1", "on", "TRUE", " yes "])
def test_on_values(raw):
    assert switch_on("X", {"X": raw}, default=False) is True


@pytest.mark.parametrize("raw", ["0", "Off", "false", "no"])
def test_off_values(raw):
    assert switch_on("X", {"X": raw}, default=True) is False


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(default):
    assert switch_on("X", {}, default=default) is default
    assert switch_on("X", {"X": "  "}, default=default) is default


def test_anything_else_is_refused_naming_the_variable_and_value():
    with pytest.raises(ValueError, match=r"X must be 1/on or 0/off, got 'sometimes'"):
        switch_on("X", {"X": "sometimes"})


def test_int_in_range_names_the_range_and_the_value():
    assert int_in_range("N", "3", 1, 8) == 3
    for raw in ("0", "9", "two"):
        with pytest.raises(ValueError, match=rf"N must be an integer from 1 to 8 or 'auto', got '{raw}'"):
            int_in_range("N", raw, 1, 8, also=" or 'auto'")
