"""Merge a user's pod-template overlay over the rendered pod template.

Strategic-merge-like and predictable: maps merge key by key, lists of named items
(containers, volumes, env, ...) merge item by item on `name`, any other list or scalar
from the overlay replaces the rendered one, and `null` in the overlay removes a key.
"""

from __future__ import annotations

import copy
from typing import Any

NAMED_LISTS = frozenset(
    {
        "containers",
        "initContainers",
        "ephemeralContainers",
        "volumes",
        "env",
        "volumeMounts",
        "volumeDevices",
        "imagePullSecrets",
        "resourceClaims",
        "ports",
    }
)


def _named(items: Any) -> bool:
    return isinstance(items, list) and all(isinstance(i, dict) and i.get("name") for i in items)


def merge(base: Any, overlay: Any, key: str | None = None) -> Any:
    """Return `base` with `overlay` merged over it; neither argument is modified."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        result = copy.deepcopy(base)
        for k, v in overlay.items():
            if v is None:
                result.pop(k, None)
            elif k in result:
                result[k] = merge(result[k], v, k)
            else:
                result[k] = copy.deepcopy(v)
        return result
    if key in NAMED_LISTS and _named(base) and _named(overlay):
        merged = [copy.deepcopy(i) for i in base]
        index = {item["name"]: n for n, item in enumerate(merged)}
        for item in overlay:
            if item["name"] in index:
                n = index[item["name"]]
                merged[n] = merge(merged[n], item, None)
            else:
                index[item["name"]] = len(merged)
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(overlay)
