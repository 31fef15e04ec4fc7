"""PERSIA's environment contract: ranks of NN workers and replica indices of the other roles."""

from __future__ import annotations

import argparse
import logging
import os

from persia.errors import PersiaValidationError

log = logging.getLogger(__name__)

PERSIA_LAUNCHER_VERBOSE = os.environ.get("PERSIA_LAUNCHER_VERBOSE", "0") == "1"


def skip_check_data(environ=None) -> bool:
    """``PERSIA_SKIP_CHECK_DATA`` (1/on/true/yes or 0/off/false/no, default off): skip the checks of
    the data a loader builds (``persia.data_loader.batch``). Read at every call, so a test or a
    launcher can flip it; another value is refused naming the variable."""
    return switch_on("PERSIA_SKIP_CHECK_DATA", os.environ if environ is None else environ, default=False)


def __getattr__(name: str):
    # PERSIA's module constant, read now rather than once at import (the same answer as
    # ``skip_check_data()``, which the data checks use)
    if name == "PERSIA_SKIP_CHECK_DATA":
        return skip_check_data()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _int_env(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def env_flag(name: str, convert, what: str, default, environ=None) -> dict:
    """``add_argument`` keywords for a flag whose default comes from environment variable ``name``
    (unset or empty: ``default``). The default stays text, which argparse converts with ``type``
    only when that role's parser runs: a bad value of the model server's variable cannot stop a
    PS. A bad value's error names the flag and the variable: ``argument --port: invalid integer
    (the flag, or env PERSIA_PORT) value: '80a'``."""
    environ = os.environ if environ is None else environ

    def parse(text: str):
        try:
            return convert(text)
        except argparse.ArgumentTypeError as exc:  # a range check's message: say where the value came from
            raise argparse.ArgumentTypeError(f"{exc} (the flag, or env {name})") from None

    parse.__name__ = f"{what} (the flag, or env {name})"
    raw = environ.get(name)
    return {"type": parse, "default": str(default) if raw is None or raw == "" else raw}


def switch_on(name: str, environ, default: bool = True) -> bool:
    """Environment variable ``name`` as an on/off switch: 1/on/true/yes or 0/off/false/no (any
    case), ``default`` when unset or empty; a ValueError names the variable and any other value."""
    raw = environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"environment variable {name} must be 1/on or 0/off, got {environ[name]!r}")


def int_in_range(name: str, raw: str, low: int, high: int, also: str = "") -> int:
    """``raw`` (the value of environment variable ``name``) as an int from ``low`` to ``high``; a
    ValueError names the variable, the range (and ``also``, what else it may be) and the value."""
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ValueError(f"environment variable {name} must be an integer from {low} to {high}{also}, got {raw!r}")
    return value


def int_arg(low: int, high: int | None = None):
    """An argparse ``type``: an integer from ``low`` to ``high`` (no bound when None); any other
    text is refused with the range and the value (``--port 70000`` was taken, and failed later)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            allowed = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {text!r}")
        return value

    return convert


PORT = int_arg(0, 65535)
"""A TCP port flag: 0 (a free one) to 65535."""


def number_in_range(raw: str, low: float, high: float) -> float | None:
    """``raw`` as a float from ``low`` to ``high``, or None where it is not one (text, NaN, a value
    out of range): the check an environment variable and a command-line flag share."""
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if low <= value <= high else None


def float_in_range(name: str, raw: str, low: float, high: float, unit: str) -> float:
    """``raw`` (the value of environment variable ``name``) as a number of ``unit`` from ``low`` to
    ``high`` (NaN is not); a PersiaValidationError (a ValueError) names the variable, the range and
    the value."""
    value = number_in_range(raw, low, high)
    if value is None:
        raise PersiaValidationError(
            f"environment variable {name} must be a number of {unit} from {low:g} to {high:g}, got {raw!r}")
    return value


DEFAULT_GRACE_S = 30.0
MAX_GRACE_S = 86_400.0


def grace_period_s(environ=None) -> float:
    """``PERSIA_GRACE_PERIOD_SECONDS`` (default 30, 0 to a day): how long a stopping process may
    take before it is killed (an NN worker's SIGTERM watchdog, a launcher stopping its children)."""
    environ = os.environ if environ is None else environ
    raw = environ.get("PERSIA_GRACE_PERIOD_SECONDS", "").strip()
    return float_in_range("PERSIA_GRACE_PERIOD_SECONDS", raw, 0, MAX_GRACE_S, "seconds") if raw else DEFAULT_GRACE_S


def get_rank() -> int | None:
    return _int_env("RANK", None)


def get_world_size() -> int | None:
    return _int_env("WORLD_SIZE", None)


def get_local_rank() -> int | None:
    return _int_env("LOCAL_RANK", None)


def get_replica_index() -> int | None:
    """``REPLICA_INDEX``; PERSIA's answer when it is unset: ``None`` in a process that has a
    ``RANK`` (an NN worker, whose index is its rank), else 0."""
    value = _int_env("REPLICA_INDEX", None)
    if value is None:
        if get_rank() is not None:
            return None
        log.debug("REPLICA_INDEX not set, using 0")
        return 0
    return value


def get_replica_size() -> int | None:
    """``REPLICA_SIZE``; when unset: ``None`` with a ``RANK`` (as in PERSIA), else 1."""
    value = _int_env("REPLICA_SIZE", None)
    if value is None:
        if get_rank() is not None:
            return None
        log.debug("REPLICA_SIZE not set, using 1")
        return 1
    return value


def check_replica(index: int, size: int, role: str) -> None:
    """A ValueError that is also an AssertionError, as PERSIA's ``assert`` checks were."""
    if size < 1:
        raise PersiaValidationError(f"{role}: replica size must be >= 1, got {size}")
    if not 0 <= index < size:
        raise PersiaValidationError(f"{role}: replica index {index} out of range for replica size {size}")


# PERSIA's keyword names for set_env and the variables every getter here reads.
ENV_NAMES = {
    "rank": "RANK",
    "world_size": "WORLD_SIZE",
    "local_rank": "LOCAL_RANK",
    "replica_index": "REPLICA_INDEX",
    "replica_size": "REPLICA_SIZE",
}


def set_env(**kwargs: object) -> None:
    """PERSIA's ``set_env(rank=0, world_size=2, ...)``: sets the upper-case variables the getters
    read (``None`` unsets one). Unknown names and non-integers are refused before anything is set."""
    updates: dict[str, str | None] = {}
    for key, value in kwargs.items():
        name = ENV_NAMES.get(key.lower())
        if name is None:
            raise ValueError(f"set_env: unknown name {key!r}; expected one of {', '.join(ENV_NAMES)}")
        if value is None:
            updates[name] = None
            continue
        try:
            number = int(str(value))
        except ValueError:
            raise ValueError(f"set_env: {key} must be an integer, got {value!r}") from None
        if number < 0:
            raise ValueError(f"set_env: {key} must be >= 0, got {number}")
        updates[name] = str(number)
    for name, value in updates.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def reload_env() -> None:
    """Kept for PERSIA compatibility: values are read from os.environ on every call."""
