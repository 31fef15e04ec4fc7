"""PERSIA's environment contract: ranks of NN workers and replica indices of the other roles."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

PERSIA_LAUNCHER_VERBOSE = os.environ.get("PERSIA_LAUNCHER_VERBOSE", "0") == "1"
PERSIA_SKIP_CHECK_DATA = os.environ.get("PERSIA_SKIP_CHECK_DATA", "0") == "1"


def _int_env(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def get_rank() -> int | None:
    return _int_env("RANK", None)


def get_world_size() -> int | None:
    return _int_env("WORLD_SIZE", None)


def get_local_rank() -> int | None:
    return _int_env("LOCAL_RANK", None)


def get_replica_index() -> int:
    value = _int_env("REPLICA_INDEX", None)
    if value is None:
        log.debug("REPLICA_INDEX not set, using 0")
        return 0
    return value


def get_replica_size() -> int:
    value = _int_env("REPLICA_SIZE", None)
    if value is None:
        log.debug("REPLICA_SIZE not set, using 1")
        return 1
    return value


def check_replica(index: int, size: int, role: str) -> None:
    if size < 1:
        raise ValueError(f"{role}: replica size must be >= 1, got {size}")
    if not 0 <= index < size:
        raise ValueError(f"{role}: replica index {index} out of range for replica size {size}")


def set_env(**kwargs: object) -> None:
    for k, v in kwargs.items():
        os.environ[k] = str(v)


def reload_env() -> None:
    """Kept for PERSIA compatibility: values are read from os.environ on every call."""
