"""Operator test fixtures (defined in operator_testkit.py, a uniquely named module so
that it cannot clash with other test directories' conftest modules)."""

from operator_testkit import cluster, operator  # noqa: F401
