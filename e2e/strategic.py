"""Strategic merge patch for the built-in kinds (what `kubectl apply` sends when it
updates a Deployment, StatefulSet, ConfigMap, …), a pure function.

KMock merges every patch as a JSON merge patch, which replaces lists: `kubectl apply` of
a changed Deployment then sends `containers: [{name: operator, args: [...]}]` and the
container loses its image and command. Here lists of the fields below are merged by
their patchMergeKey (as k8s.io/api declares them), elements can be removed with
`$patch: delete`, `$deleteFromPrimitiveList/<field>` and `$setElementOrder/<field>` are
honoured, and `$retainKeys` is ignored. Other lists are replaced, as the real server does
for lists without a merge strategy.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
    "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath", "imagePullSecrets": "name",
    "ports": "containerPort", "hostAliases": "ip", "ownerReferences": "uid", "conditions": "type",
    "topologySpreadConstraints": "topologyKey",
}  # fmt: skip
PRIMITIVE_MERGE = {"finalizers"}  # lists of scalars merged as sets


def strategic_merge(original: Any, patch: Any) -> Any:
    if not isinstance(patch, dict) or not isinstance(original, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = copy.deepcopy(original)
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            out[field] = [v for v in out.get(field) or [] if v not in value]
            continue
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            out[key] = strategic_merge(out.get(key) if isinstance(out.get(key), dict) else {}, value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, MERGE_KEYS[key], patch.get(f"$setElementOrder/{key}"))
        elif isinstance(value, list) and key in PRIMITIVE_MERGE and isinstance(out.get(key), list):
            out[key] = out[key] + [v for v in value if v not in out[key]]
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(original: list[Any], patch: list[Any], key: str, order: list[Any] | None) -> list[Any]:
    if not all(isinstance(e, dict) and key in e for e in [*original, *patch]):
        return copy.deepcopy(patch)  # not keyed as expected: replace, like an unknown list
    merged = {e[key]: copy.deepcopy(e) for e in original}
    keys = [e[key] for e in original]
    for element in patch:
        k = element[key]
        if element.get("$patch") == "delete":
            merged.pop(k, None)
            continue
        if k in merged:
            merged[k] = strategic_merge(merged[k], element)
        else:
            merged[k] = strategic_merge({}, element)
            keys.append(k)
    if order:
        wanted = [o[key] for o in order if isinstance(o, dict) and key in o]
        keys = [k for k in wanted if k in merged] + [k for k in keys if k not in wanted]
    return [merged[k] for k in keys if k in merged]
