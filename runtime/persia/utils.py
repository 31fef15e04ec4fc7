"""Small helpers PERSIA users import (setup_seed, find_free_port, yaml) and the result line."""

from __future__ import annotations

import json
import os
import random
import socket
import sys
from typing import Any

import numpy as np
import yaml

RESULT_PREFIX = "PERSIA_RESULT "


def setup_seed(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def load_yaml(path: str) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def dump_yaml(content: Any, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(content, f)


def advertise_host() -> str:
    """The address other roles reach this process on: ``PERSIA_ADVERTISE_HOST``, else the bind
    address when it is one address (``PERSIA_BIND_ADDRESS``), else the hostname's."""
    from persia.security import bind_address

    host = os.environ.get("PERSIA_ADVERTISE_HOST")
    if host:
        return host
    bound = bind_address()
    if bound not in ("0.0.0.0", "::"):
        return bound
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def report_result(**metrics: Any) -> None:
    """Print the run's headline metrics as one machine-readable line (read by the local launcher)."""
    print(RESULT_PREFIX + json.dumps(metrics, sort_keys=True), flush=True)
    sys.stdout.flush()
