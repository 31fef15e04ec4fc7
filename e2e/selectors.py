"""Label and field selectors as the API server parses them (pure functions).

KMock ignores `labelSelector` and `fieldSelector`; kopf's watches, `kubectl get -l`,
`kubectl wait` (metadata.name=) and `kubectl describe` (involvedObject.*) need them.
Field selectors here accept any dotted path, where the real API server allows only a
per-resource list of fields (it would reject what this accepts).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Matcher = Callable[[Mapping[str, Any]], bool]

_SET_RE = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses (`a in (x,y),b=c`)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(text: str | None) -> Matcher:
    """`a=b,c!=d,e,!f,g in (h,i),j notin (k)` -> a predicate over a labels dict.

    Raises ValueError naming the requirement it cannot parse."""
    checks: list[Matcher] = []
    for req in _split_top(text or ""):
        m = _SET_RE.match(req)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif "!=" in req:
            key, value = (s.strip() for s in req.split("!=", 1))
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "==" in req or "=" in req:
            key, value = (s.strip() for s in re.split(r"==?", req, maxsplit=1))
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif req.startswith("!"):
            checks.append(lambda labels, k=req[1:].strip(): k not in labels)
        elif re.fullmatch(r"[\w./-]+", req):
            checks.append(lambda labels, k=req: k in labels)
        else:
            raise ValueError(f"labelSelector: cannot parse requirement {req!r}")
    return lambda labels: all(check(labels) for check in checks)


def field_value(obj: Mapping[str, Any], path: str) -> str:
    node: Any = obj
    for key in path.split("."):
        if not isinstance(node, Mapping):
            return ""
        node = node.get(key)
    return "" if node is None else str(node)


def parse_field_selector(text: str | None) -> Callable[[Mapping[str, Any]], bool]:
    """`metadata.name=x,status.phase!=Running` -> a predicate over a whole object."""
    checks: list[Callable[[Mapping[str, Any]], bool]] = []
    for req in _split_top(text or ""):
        if "!=" in req:
            path, value = (s.strip() for s in req.split("!=", 1))
            checks.append(lambda obj, p=path, v=value: field_value(obj, p) != v)
        elif "=" in req:
            path, value = (s.strip() for s in re.split(r"==?", req, maxsplit=1))
            checks.append(lambda obj, p=path, v=value: field_value(obj, p) == v)
        else:
            raise ValueError(f"fieldSelector: cannot parse requirement {req!r}")
    return lambda obj: all(check(obj) for check in checks)


def selector_from_match(selector: Mapping[str, Any] | None) -> Matcher:
    """A workload's `spec.selector` (matchLabels + matchExpressions) as a predicate."""
    selector = selector or {}
    wanted = dict(selector.get("matchLabels") or {})
    exprs = list(selector.get("matchExpressions") or [])

    def match(labels: Mapping[str, Any]) -> bool:
        if any(labels.get(k) != v for k, v in wanted.items()):
            return False
        for e in exprs:
            key, op, values = e["key"], e["operator"], set(e.get("values") or ())
            if op == "In" and labels.get(key) not in values:
                return False
            if op == "NotIn" and labels.get(key) in values:
                return False
            if op == "Exists" and key not in labels:
                return False
            if op == "DoesNotExist" and key in labels:
                return False
        return True

    return match
