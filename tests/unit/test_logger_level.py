"""``LOG_LEVEL``: a level name or PERSIA's Rust ``env_logger`` filter; what is not understood is
said in the log, where it used to become INFO without a word."""

from __future__ import annotations

import logging
import subprocess
import sys

from persia.logger import parse_log_level


def test_level_names_in_any_case_and_rusts_names():
    assert parse_log_level("debug") == (logging.DEBUG, {}, [])
    assert parse_log_level("WARN") == (logging.WARNING, {}, [])
    assert parse_log_level("trace")[0] == logging.DEBUG
    assert parse_log_level("off")[0] > logging.CRITICAL


def test_env_logger_directives_set_the_root_and_single_loggers():
    root, loggers, problems = parse_log_level("persia::nn_worker=debug, warn ,grpc=error")
    assert (root, problems) == (logging.WARNING, [])
    assert loggers == {"persia.nn_worker": logging.DEBUG, "grpc": logging.ERROR}


def test_directives_not_understood_are_returned():
    assert parse_log_level("verbose") == (logging.INFO, {}, ["verbose"])
    assert parse_log_level("persia=loud,=debug,error") == (logging.ERROR, {}, ["persia=loud", "=debug"])


def test_a_role_warns_about_a_level_it_does_not_understand():
    code = ("import logging; from persia.logger import setup_logging; setup_logging('nn-worker-0'); "
            "logging.getLogger('persia.x').info('an info line'); logging.getLogger('other').info('hidden')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"LOG_LEVEL": "verbose,error,persia=debug", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "LOG_LEVEL='verbose,error,persia=debug': ignored 'verbose'" in out.stderr
    assert "an info line" in out.stderr  # persia=debug
    assert "hidden" not in out.stderr  # error for the rest


def test_the_warning_shows_under_a_root_level_above_warning():
    code = "from persia.logger import setup_logging; setup_logging('ps-0')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"LOG_LEVEL": "error,persia=loud", "PATH": "/usr/bin:/bin"})
    assert "LOG_LEVEL='error,persia=loud': ignored 'persia=loud'" in out.stderr
