"""persia-launcher keeps PERSIA's flags and env-var fallbacks."""

import os
import subprocess
import sys

import pytest

from persia.launcher import build_parser


def test_env_fallbacks(monkeypatch):
    monkeypatch.setenv("PERSIA_NN_WORKER_ENTRY", "/w/train.py")
    monkeypatch.setenv("PERSIA_DATALOADER_ENTRY", "/w/loader.py")
    monkeypatch.setenv("PERSIA_EMBEDDING_CONFIG", "/c/emb.yml")
    monkeypatch.setenv("PERSIA_GLOBAL_CONFIG", "/c/glob.yml")
    monkeypatch.setenv("REPLICA_INDEX", "3")
    monkeypatch.setenv("REPLICA_SIZE", "4")
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    p = build_parser()
    nn = p.parse_args(["nn-worker"])
    assert (nn.filepath, nn.nproc_per_node, nn.node_rank, nn.nnodes) == ("/w/train.py", 2, 3, 4)
    dl = p.parse_args(["data-loader"])
    assert (dl.filepath, dl.replica_index, dl.replica_size) == ("/w/loader.py", 3, 4)
    ps = p.parse_args(["embedding-parameter-server"])
    assert (ps.port, ps.embedding_config, ps.global_config, ps.replica_index) == (8888, "/c/emb.yml", "/c/glob.yml", 3)
    ew = p.parse_args(["embedding-worker", "--port", "9000", "--replica-index", "1"])
    assert (ew.port, ew.replica_index, ew.replica_size) == (9000, 1, 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["data-loader", "/nonexistent/loader.py"], "FILEPATH '/nonexistent/loader.py' does not exist"),
        (["embedding-worker", "--replica-index", "2", "--replica-size", "2"],
         "replica index 2 out of range for replica size 2"),
        (["nn-worker"], "FILEPATH is required (or set PERSIA_NN_WORKER_ENTRY)"),
    ],
)
def test_bad_invocations_say_what_is_wrong(argv, message):
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "persia.launcher", *argv], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr


SUPERVISE = r"""
import subprocess, sys, time
from persia.launcher import _supervise
stubborn = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"],
    stdout=subprocess.PIPE, text=True)
stubborn.stdout.readline()  # its SIGTERM is ignored from here on
failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
t0 = time.monotonic()
code = _supervise([stubborn, failing], ["rank 0", "rank 1"])
print(code, stubborn.returncode, round(time.monotonic() - t0, 1))
"""


def test_a_child_that_ignores_sigterm_is_killed_at_the_grace_period():
    """One child fails, another never exits on SIGTERM (an NN rank stuck on its way out after its
    peer died): the launcher kills it at the grace period and exits as the failed child did."""
    env = dict(os.environ, PERSIA_GRACE_PERIOD_SECONDS="1")
    proc = subprocess.run([sys.executable, "-c", SUPERVISE], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code, stubborn, seconds = proc.stdout.split()
    assert (int(code), int(stubborn)) == (3, -9)  # the failure's code; SIGKILL for the stubborn one
    assert float(seconds) < 30, seconds
    assert "persia-launcher: rank 1 " in proc.stderr and "stopping the others" in proc.stderr


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "86401"])
def test_a_bad_grace_period_is_refused_naming_the_variable_and_the_value(raw):
    from persia.env import grace_period_s

    with pytest.raises(ValueError, match=f"PERSIA_GRACE_PERIOD_SECONDS must be a number of seconds from 0 to 86400, "
                                         f"got '{raw}'"):
        grace_period_s({"PERSIA_GRACE_PERIOD_SECONDS": raw})


@pytest.mark.parametrize("raw, expected", [(None, 30.0), ("", 30.0), ("0", 0.0), ("2.5", 2.5)])
def test_the_grace_period_comes_from_the_environment(raw, expected):
    from persia.env import grace_period_s

    assert grace_period_s({} if raw is None else {"PERSIA_GRACE_PERIOD_SECONDS": raw}) == expected


_LOCAL_REQUIRED = ("--nn-worker", "train.py", "--data-loader", "load.py", "--embedding-config", "e.yml")


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "86401", "inf"])
def test_a_bad_grace_period_flag_is_refused_naming_the_flag_and_the_value(raw, capsys):
    from persia.launcher import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["local", *_LOCAL_REQUIRED, "--grace-period", raw])
    assert f"argument --grace-period: must be a number of seconds from 0 to 86400, got '{raw}'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["adult income", "a.b", "jobs>", "*", ""])
def test_a_job_name_that_cannot_be_a_nats_subject_token_is_refused_naming_it(name, capsys, monkeypatch):
    """It failed every role at its first NATS subject (``nats: invalid subject``), after the
    job's restarts; the flag and the variable are refused at once, named with the value."""
    from persia.bus import job_name
    from persia.launcher import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["local", *_LOCAL_REQUIRED, "--job-name", name])
    assert "argument --job-name: --job-name must be a non-empty name without spaces" in capsys.readouterr().err
    monkeypatch.setenv("PERSIA_JOB_NAME", name)
    with pytest.raises(ValueError, match=f"PERSIA_JOB_NAME must be .* got {name!r}"):
        job_name()
    monkeypatch.setenv("PERSIA_JOB_NAME", "ctr-8x8_v2")
    assert job_name() == "ctr-8x8_v2"


@pytest.mark.parametrize("env, message", [
    ({"PERSIA_METRICS_PORT": "abc"}, "PERSIA_METRICS_PORT must be an integer from 0 to 65535, got 'abc'"),
    ({"PERSIA_METRICS_PORT": "70000"}, "PERSIA_METRICS_PORT must be an integer from 0 to 65535, got '70000'"),
    ({"PERSIA_METRICS_PORT": "9090", "PERSIA_METRICS_PORT_OFFSET": "x"}, "PERSIA_METRICS_PORT_OFFSET must be"),
    ({"PERSIA_METRICS_PORT": "65535", "LOCAL_RANK": "1"}, "= 65536 is over 65535"),
])
def test_a_bad_metrics_port_is_refused_by_the_launcher_before_any_role_starts(env, message, capsys, monkeypatch):
    """It failed every role at its start with int()'s "invalid literal", the job restarted three
    times and failed naming a server, not the variable."""
    from persia.launcher import build_parser
    from persia.local import run_local

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "adult-income")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args([
        "local", "--nn-worker", os.path.join(example, "train.py"), "--data-loader", os.path.join(example, "data_loader.py"),
        "--embedding-config", os.path.join(example, "config", "embedding_config.yml")])
    assert run_local(args) == 2
    assert message in capsys.readouterr().err


def test_a_bad_grace_period_variable_fails_only_local_mode_and_without_a_traceback(monkeypatch, capsys):
    """It was read when the parser was built: every subcommand, a PS's too, died with a traceback."""
    from persia.launcher import build_parser
    from persia.local import run_local

    monkeypatch.setenv("PERSIA_GRACE_PERIOD_SECONDS", "abc")
    assert build_parser().parse_args(["embedding-parameter-server"]).role == "embedding-parameter-server"
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "adult-income")
    args = build_parser().parse_args([
        "local", "--nn-worker", os.path.join(example, "train.py"), "--data-loader", os.path.join(example, "data_loader.py"),
        "--embedding-config", os.path.join(example, "config", "embedding_config.yml")])
    assert run_local(args) == 2
    assert "PERSIA_GRACE_PERIOD_SECONDS must be a number of seconds from 0 to 86400, got 'abc'" in capsys.readouterr().err


def test_the_grace_period_flag_takes_seconds():
    from persia.launcher import build_parser

    assert build_parser().parse_args(["local", *_LOCAL_REQUIRED, "--grace-period", "2.5"]).grace_period == 2.5



FORWARDED = r"""
import os, signal, subprocess, sys, threading, time
from persia.launcher import _supervise
stubborn = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"],
    stdout=subprocess.PIPE, text=True)
stubborn.stdout.readline()  # its SIGTERM is ignored from here on (a rank stuck in C code, a gloo wait)

def terminate_once_supervised():  # a real SIGTERM, once _supervise's handler is in place
    end = time.monotonic() + 20
    while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and time.monotonic() < end:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=terminate_once_supervised, daemon=True).start()
t0 = time.monotonic()
code = _supervise([stubborn], ["rank 0"])
print(code, stubborn.returncode, round(time.monotonic() - t0, 1))
"""


def test_a_forwarded_sigterm_kills_a_rank_that_ignores_it_at_the_grace_period():
    """SIGTERM to the nn launcher is forwarded to its ranks; one that never acts on it is SIGKILLed
    at the grace period and the launcher exits 143 (before: it waited for the rank for ever)."""
    env = dict(os.environ, PERSIA_GRACE_PERIOD_SECONDS="1")
    proc = subprocess.run([sys.executable, "-c", FORWARDED], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code, stubborn, seconds = proc.stdout.split()
    assert (int(code), int(stubborn)) == (143, -9)
    assert float(seconds) < 20, seconds
    assert "rank 0 still running 1s after SIGTERM: killing it" in proc.stderr


@pytest.mark.parametrize("exits, first", [
    ([], None),
    ([(0, 0), (1, 0)], None),
    ([(1, -9), (0, 1)], (1, -9)),  # rank 1 SIGKILLed, then rank 0 fails on the broken connection
    ([(0, 0), (1, 3)], (1, 3)),
    ([(0, 1), (1, -9)], (0, 1)),
])
def test_the_first_child_to_fail_is_the_one_reported(exits, first):
    from persia.launcher import first_failure

    assert first_failure(exits) == first



def test_local_mode_refuses_a_broken_config_before_any_role_starts(tmp_path):
    """A mistake in embedding_config.yml failed every server at its start, and each exit restarted
    the whole job: --max-restarts incarnations and as many tracebacks before the job failed."""
    for name in ("train.py", "loader.py"):
        (tmp_path / name).write_text("raise SystemExit('must not run')\n")
    (tmp_path / "emb.yml").write_text("slots_config:\n  user: {dim: -4}\n")
    proc = subprocess.run([sys.executable, "-m", "persia.launcher", "local", "--nn-worker", str(tmp_path / "train.py"),
                           "--data-loader", str(tmp_path / "loader.py"), "--embedding-config",
                           str(tmp_path / "emb.yml")],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": os.environ["PATH"]})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("persia-launcher local: ") and "emb.yml" in proc.stderr and "dim" in proc.stderr
    assert "nats-server" not in proc.stdout and "restarting" not in proc.stdout  # nothing was started
