"""Logging with the role and replica in every line, level from ``LOG_LEVEL`` (PERSIA's variable),
plus PERSIA's logger helpers (``setLogger``, ``get_default_logger``, ``levelFilter``) for users'
scripts."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"
FILE_LOG_FORMAT = "%(asctime)s %(levelname)-8s [%(filename)s:%(lineno)d] %(message)s"
DEFAULT_LOGGER_NAME = "log"
_default_logger: logging.Logger | None = None


_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL,
           "off": logging.CRITICAL + 10}


def parse_log_level(text: str) -> tuple[int, dict[str, int], list[str]]:
    """``LOG_LEVEL`` (pure): a level name, or PERSIA's Rust ``env_logger`` filter, directives
    separated by commas, each ``level`` (everything) or ``target=level`` (one logger; ``::`` read
    as ``.``). Returns the root level, the per-logger levels, and the directives not understood
    (reported, not silently read as INFO)."""
    root, loggers, problems = logging.INFO, {}, []
    for directive in filter(None, (d.strip() for d in text.split(","))):
        target, _, name = directive.rpartition("=")
        level = _LEVELS.get(name.strip().lower())
        if level is None or (target == "" and "=" in directive):
            problems.append(directive)
        elif target:
            loggers[target.strip().replace("::", ".")] = level
        else:
            root = level
    return root, loggers, problems


def setup_logging(role: str, level: str | None = None) -> None:
    text = level or os.environ.get("LOG_LEVEL", "info")
    root_level, loggers, problems = parse_log_level(text)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(role=role), "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(root_level)
    for noisy in ("nats", "grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(max(root.level, logging.WARNING))
    for name, lvl in loggers.items():
        logging.getLogger(name).setLevel(lvl)
    if problems:  # at the root's level if it is above WARNING: a level that hid this would hide the mistake
        logging.getLogger(__name__).log(
            max(logging.WARNING, min(root_level, logging.CRITICAL)),
            "LOG_LEVEL=%r: ignored %s (levels: %s; or target=level, comma-separated)",
            text, ", ".join(repr(p) for p in problems), ", ".join(_LEVELS))


class levelFilter(logging.Filter):  # noqa: N801 - PERSIA's name
    """Keeps records strictly above ``level`` (PERSIA's error-redirect filter)."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > self.level


def setLogger(  # noqa: N802 - PERSIA's name
    name: str,
    log_level: int = logging.DEBUG,
    log_filename: str = "train.log",
    enable_file_logger: bool = False,
    err_redirect_filepath: str = "error.log",
    enable_err_redirect: bool = False,
    err_redirect_level: int = logging.INFO,
) -> logging.Logger:
    """PERSIA's ``setLogger``: a named logger with optional file and error-redirect handlers.

    Unlike PERSIA it adds no console handler of its own (records reach the role's stderr handler
    through the root logger, with the role in every line) and it does not stack handlers when
    called twice for one name."""
    logger = logging.getLogger(name)
    logger.setLevel(log_level)
    wanted = []
    if enable_file_logger:
        wanted.append((os.path.abspath(log_filename), None))
    if enable_err_redirect:
        wanted.append((os.path.abspath(err_redirect_filepath), err_redirect_level))
    have = {getattr(h, "baseFilename", None) for h in logger.handlers}
    for path, min_level in wanted:
        if path in have:
            continue
        handler = logging.FileHandler(path, mode="a")
        handler.setFormatter(logging.Formatter(FILE_LOG_FORMAT))
        if min_level is not None:
            handler.addFilter(levelFilter(min_level))
        logger.addHandler(handler)
    return logger


def set_default_logger(name: str | None = None, **kwargs) -> logging.Logger:
    global _default_logger
    if _default_logger is None:
        _default_logger = setLogger(name or DEFAULT_LOGGER_NAME, **kwargs)
    return _default_logger


def get_default_logger(name: str | None = None, **kwargs) -> logging.Logger:
    """PERSIA's ``get_default_logger(name=None, **setLogger_kwargs)``: the named logger; the
    keyword arguments configure it as ``setLogger`` does."""
    if kwargs:
        return setLogger(name or DEFAULT_LOGGER_NAME, **kwargs)
    return logging.getLogger(name or "persia")


get_logger = get_default_logger
