"""Guards the suite wraps around every test (``tests/conftest.py``), so that state one test leaves
behind fails that test, naming it, instead of a later test far from the cause."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import pytest

# set by the libraries themselves: pytest (the running test), torch (its compile cache, at first use)
SET_BY_LIBRARIES = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


def changed_variables(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Pure: the variables that differ, sorted by name; the libraries' own left out."""
    return sorted(k for k in before.keys() | after.keys()
                  if k not in SET_BY_LIBRARIES and before.get(k) != after.get(k))


def environment_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Pure: ``NAME 'old' -> 'new'`` for every changed variable (``'(unset)'`` when absent)."""
    return [f"{k} {before.get(k, '(unset)')!r} -> {after.get(k, '(unset)')!r}"
            for k in changed_variables(before, after)]


@contextmanager
def environment_kept() -> Iterator[None]:
    """Fail if the block leaves ``os.environ`` changed; put it back first, so that what runs next
    runs clean."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changes = environment_changes(before, after)
    if not changes:
        return
    for k in changed_variables(before, after):
        if k in before:
            os.environ[k] = before[k]
        else:
            del os.environ[k]
    pytest.fail("this test changed os.environ and left it so: " + ", ".join(changes)
                + " (use monkeypatch.setenv / delenv)", pytrace=False)
