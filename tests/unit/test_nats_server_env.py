"""The environment a local nats-server gets: one Go processor unless the operator names a count.

The decision is pure (``server_environ``); the last test starts a real nats-server and reads the
environment its process really has from ``/proc``."""

from __future__ import annotations

from pathlib import Path

import pytest

from persia.nats_server import DEFAULT_GO_MAX_PROCS, NatsServer, server_environ


def test_one_go_processor_by_default():
    env = server_environ({"PATH": "/bin"}, DEFAULT_GO_MAX_PROCS)
    assert env == {"PATH": "/bin", "GOMAXPROCS": "1"}


def test_an_operator_count_wins():
    assert server_environ({"GOMAXPROCS": "4"}, 1)["GOMAXPROCS"] == "4"


def test_empty_value_counts_as_unset():
    assert server_environ({"GOMAXPROCS": ""}, 2)["GOMAXPROCS"] == "2"


def test_none_leaves_go_its_default():
    assert "GOMAXPROCS" not in server_environ({"PATH": "/bin"}, None)


def test_the_callers_environment_is_not_changed():
    mine = {"PATH": "/bin"}
    server_environ(mine, 1)
    assert mine == {"PATH": "/bin"}


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bad_count_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"go_max_procs must be >= 1 or None, got {bad}"):
        NatsServer(go_max_procs=bad)


def _process_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_the_started_server_runs_with_it(monkeypatch):
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with NatsServer() as server:
        assert _process_environ(server.process.pid).get("GOMAXPROCS") == "1"
    monkeypatch.setenv("GOMAXPROCS", "3")
    with NatsServer() as server:
        assert _process_environ(server.process.pid).get("GOMAXPROCS") == "3"


def test_the_pure_decision_refuses_a_bad_count_too():
    with pytest.raises(ValueError, match=r"go_max_procs must be >= 1 or None, got 0"):
        server_environ({}, 0)
