"""The suite's own guard against tests that leave environment variables behind."""

from __future__ import annotations

import os

import pytest

from tests.guards import environment_changes, environment_kept


def test_changes_name_every_added_removed_and_altered_variable_and_skip_the_libraries_own():
    before = {"A": "1", "B": "2", "PYTEST_CURRENT_TEST": "x (setup)"}
    after = {"A": "1", "B": "3", "C": "4", "PYTEST_CURRENT_TEST": "x (call)", "TORCHINDUCTOR_CACHE_DIR": "/t"}
    assert environment_changes(before, after) == ["B '2' -> '3'", "C '(unset)' -> '4'"]
    assert environment_changes(after, {"A": "1"}) == ["B '3' -> '(unset)'", "C '4' -> '(unset)'"]
    assert environment_changes(before, dict(before)) == []


def test_a_block_that_leaks_fails_naming_the_variable_and_the_environment_is_put_back(monkeypatch):
    monkeypatch.setenv("PERSIA_GUARD_KEPT", "before")
    monkeypatch.delenv("PERSIA_GUARD_ADDED", raising=False)
    named = r"PERSIA_GUARD_ADDED '\(unset\)' -> '1'.*PERSIA_GUARD_KEPT 'before' -> 'after'"
    with pytest.raises(pytest.fail.Exception, match=named):
        with environment_kept():
            os.environ["PERSIA_GUARD_ADDED"] = "1"
            os.environ["PERSIA_GUARD_KEPT"] = "after"
    assert "PERSIA_GUARD_ADDED" not in os.environ and os.environ["PERSIA_GUARD_KEPT"] == "before"
    with environment_kept():  # a block that leaves it as it found it passes
        os.environ["PERSIA_GUARD_ADDED"] = "1"
        del os.environ["PERSIA_GUARD_ADDED"]
