"""The local supervisor's decisions, as a table: what each exit means for the job."""

import pytest

from persia.bus import redact_url
from persia.supervisor import Action, decide, describe_exit, signal_of


@pytest.mark.parametrize("code, signum, text", [
    (0, None, "exit code 0"),
    (3, None, "exit code 3"),
    (-9, 9, "killed by SIGKILL"),
    (-15, 15, "killed by SIGTERM"),
    (137, 9, "exit code 137 (SIGKILL)"),
    (128, None, "exit code 128"),
])
def test_describe_exit(code, signum, text):
    assert signal_of(code) == signum
    assert describe_exit(code) == text


@pytest.mark.parametrize("role, kind, code, restarts, action, words", [
    ("nn", "nn", 0, 0, Action.SUCCEED, ""),
    ("dl-0", "dl", 0, 0, Action.CONTINUE, ""),
    ("dl-0", "dl", 1, 0, Action.FAIL, "dl-0 exit code 1: not restarted"),
    ("nn", "nn", 2, 0, Action.FAIL, "not restarted"),
    ("nn", "nn", 137, 0, Action.RESTART_JOB, "nn exit code 137 (SIGKILL); restarting the job (1/3)"),
    ("dl-1", "dl", -9, 2, Action.RESTART_JOB, "restarting the job (3/3)"),
    ("dl-1", "dl", -9, 3, Action.FAIL, "no restarts left (3 of --max-restarts 3 used)"),
    ("ps-0", "ps", 0, 0, Action.RESTART_JOB, "server ps-0 exited (exit code 0)"),  # servers never end
    ("ew-1", "ew", 1, 0, Action.RESTART_JOB, "server ew-1 exited (exit code 1)"),
    ("ps-0", "ps", -9, 3, Action.FAIL, "server ps-0 exited (killed by SIGKILL); no restarts left"),
])
def test_decide(role, kind, code, restarts, action, words):
    d = decide(role, kind, code, restarts=restarts, max_restarts=3)
    assert d.action is action
    assert words in d.reason


@pytest.mark.parametrize("url, shown", [
    ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ("nats://user:s3cret@host:4222", "nats://***@host:4222"),
    ("nats://tok@a:1,nats://b:2", "nats://***@a:1,nats://b:2"),
    ("host:4222", "host:4222"),
])
def test_credentials_never_shown(url, shown):
    assert redact_url(url) == shown
