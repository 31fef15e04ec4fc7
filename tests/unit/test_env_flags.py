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


@pytest.mark.parametrize("argv, flag, value, allowed", [
    (["embedding-parameter-server", "--port", "70000"], "--port", "70000", "from 0 to 65535"),
    (["embedding-worker", "--ps-port", "-1"], "--ps-port", "-1", "from 0 to 65535"),
    (["serve", "--grpc-port", "-5"], "--grpc-port", "-5", "from -1 to 65535"),  # -1: no gRPC
    (["embedding-worker", "--ps-replica-size", "0"], "--ps-replica-size", "0", ">= 1"),
    (["nn-worker", "t.py", "--nnodes", "0"], "--nnodes", "0", ">= 1"),
    (["nn-worker", "t.py", "--node-rank", "-1"], "--node-rank", "-1", ">= 0"),
    (["data-loader", "d.py", "--replica-size", "0"], "--replica-size", "0", ">= 1"),
    (["local", "--nn-worker", "t.py", "--data-loader", "d.py", "--embedding-config", "e.yml", "--cores", "0"],
     "--cores", "0", ">= 1"),
    (["local", "--nn-worker", "t.py", "--data-loader", "d.py", "--embedding-config", "e.yml", "--max-restarts", "-1"],
     "--max-restarts", "-1", ">= 0"),
    (["local", "--nn-worker", "t.py", "--data-loader", "d.py", "--embedding-config", "e.yml",
      "--nats-max-payload", "0"], "--nats-max-payload", "0", "from 1 to 67108864"),
])
def test_a_value_out_of_range_is_refused_naming_the_flag_the_range_and_the_value(argv, flag, value, allowed, capsys):
    """Before, each was taken: ``--port 70000`` failed later in gRPC, ``--cores 0`` budgeted for
    every core, ``--max-restarts -1`` meant none, ``--nats-max-payload 0`` a traceback."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert f"argument {flag}: must be an integer {allowed}, got '{value}'" in capsys.readouterr().err


def test_a_variable_out_of_range_is_refused_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("PERSIA_PORT", "-4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["embedding-parameter-server"])
    assert "argument --port: must be an integer from 0 to 65535, got '-4' (the flag, or env PERSIA_PORT)" in \
        capsys.readouterr().err
