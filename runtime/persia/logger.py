"""Logging with the role and replica in every line, level from ``LOG_LEVEL`` (PERSIA's variable)."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"


def setup_logging(role: str, level: str | None = None) -> None:
    level_name = (level or os.environ.get("LOG_LEVEL", "info")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(role=role), "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level_name, logging.INFO))
    for noisy in ("nats", "grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(max(root.level, logging.WARNING))


def get_default_logger(name: str | None = None) -> logging.Logger:
    return logging.getLogger(name or "persia")


get_logger = get_default_logger
