"""The one-line result contract between a training script and the benchmark runner:
the trainer prints ``PERSIA_RESULT {json}`` as its last result line."""

from __future__ import annotations

import json
import math
from typing import Any

RESULT_PREFIX = "PERSIA_RESULT "


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def format_result_line(result: dict[str, Any]) -> str:
    return RESULT_PREFIX + json.dumps(_finite(result), sort_keys=True)


def parse_result_line(output: str) -> dict[str, Any]:
    """The JSON of the last ``PERSIA_RESULT`` line in ``output`` (log prefixes before it allowed)."""
    for line in reversed(output.splitlines()):
        at = line.find(RESULT_PREFIX)
        if at >= 0:
            payload = line[at + len(RESULT_PREFIX) :]
            try:
                result = json.loads(payload)
            except json.JSONDecodeError as e:
                raise ValueError(f"malformed {RESULT_PREFIX.strip()} line: {payload[:200]!r} ({e})") from None
            if not isinstance(result, dict):
                raise ValueError(f"{RESULT_PREFIX.strip()} payload must be a JSON object, got {payload[:200]!r}")
            return result
    raise ValueError(f"no {RESULT_PREFIX.strip()} line in output")
