"""Flags whose defaults come from environment variables (``persia.env.env_flag``): a bad value
fails only the role whose parser reads it, with an error naming the flag and the variable. The
defaults were converted with a bare ``int()`` while the parser of every role was built, so a bad
``PERSIA_SERVE_MAX_LATENCY_MS`` stopped the PS too, with ``could not convert string to float``."""

from __future__ import annotations

import pytest

from persia.launcher import build_parser


def test_a_bad_serving_variable_does_not_stop_another_role(monkeypatch):
    monkeypatch.setenv("PERSIA_SERVE_MAX_LATENCY_MS", "5ms")
    monkeypatch.setenv("PERSIA_PORT", "7000")
    args = build_parser().parse_args(["embedding-parameter-server"])
    assert args.port == 7000 and isinstance(args.port, int)


def test_a_bad_value_names_the_flag_and_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("PERSIA_SERVE_MAX_LATENCY_MS", "5ms")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert ("argument --max-latency-ms: invalid number (the flag, or env PERSIA_SERVE_MAX_LATENCY_MS) value: '5ms'"
            in capsys.readouterr().err)


def test_the_flag_wins_over_a_bad_variable(monkeypatch):
    monkeypatch.setenv("REPLICA_INDEX", "two")
    args = build_parser().parse_args(["data-loader", "loader.py", "--replica-index", "2"])
    assert args.replica_index == 2


def test_an_empty_variable_is_unset(monkeypatch):
    monkeypatch.setenv("REPLICA_INDEX", "")
    monkeypatch.setenv("PERSIA_MAX_RESTARTS", "")
    assert build_parser().parse_args(["nn-worker", "train.py"]).node_rank == 0
    args = build_parser().parse_args(["local", "--nn-worker", "t.py", "--data-loader", "d.py", "--embedding-config", "e.yml"])
    assert args.max_restarts == 3
