"""Server-side `Table` responses (meta.k8s.io/v1), what `kubectl get` prints (pure).

KMock answers lists with plain JSON, so `kubectl get pj` shows no printer columns. This
renders a CRD's additionalPrinterColumns (the simple JSONPath subset CRDs allow) and a
few columns of the built-in kinds the scenarios look at (pods, StatefulSets, Jobs); other
kinds get NAME and AGE. The real server's built-in printers have more columns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

_FILTER = re.compile(r'^\?\(@\.([\w.]+)\s*==\s*["\']([^"\']*)["\']\)$')
_TOKEN = re.compile(r"\.([\w-]+)|\[([^\]]+)\]")


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Evaluate `.a.b[0].c[?(@.type=="X")].d` (the subset CRD printer columns use)."""
    nodes = [obj]
    for m in _TOKEN.finditer(path.strip()):
        key, bracket = m.group(1), m.group(2)
        nxt: list[Any] = []
        for node in nodes:
            if key is not None:
                if isinstance(node, Mapping) and key in node:
                    nxt.append(node[key])
            elif bracket.strip().lstrip("-").isdigit():
                if isinstance(node, list):
                    i = int(bracket)
                    if -len(node) <= i < len(node):
                        nxt.append(node[i])
            elif bracket == "*":
                nxt.extend(node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else [])
            else:
                f = _FILTER.match(bracket.strip())
                if f is None:
                    raise ValueError(f"unsupported JSONPath element [{bracket}] in {path!r}")
                field, value = f.group(1), f.group(2)
                for item in node if isinstance(node, list) else []:
                    got = jsonpath(item, "." + field)
                    if got and str(got[0]) == value:
                        nxt.append(item)
        nodes = nxt
    return nodes


def parse_time(text: str) -> datetime | None:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except (TypeError, ValueError):
        try:
            return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
        except ValueError:
            return None


def human_duration(seconds: float) -> str:
    """Like k8s.io/apimachinery's duration.HumanDuration (short form)."""
    s = int(max(seconds, 0))
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = m // 60
    if h < 48:
        return f"{h}h"
    return f"{h // 24}d"


def age(obj: Mapping[str, Any], now: datetime | None = None) -> str:
    created = parse_time((obj.get("metadata") or {}).get("creationTimestamp", ""))
    if created is None:
        return "<unknown>"
    return human_duration(((now or datetime.now(UTC)) - created).total_seconds())


def _cell(type_: str, values: list[Any], now: datetime | None) -> Any:
    if not values:
        return None
    value = values[0]
    if type_ == "date":
        t = parse_time(str(value))
        return human_duration(((now or datetime.now(UTC)) - t).total_seconds()) if t else str(value)
    if type_ in ("integer", "number", "boolean"):
        return value
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _columns(defs: list[tuple[str, str, int, str]]) -> list[dict[str, Any]]:
    return [
        {"name": n, "type": t, "format": "name" if n == "Name" else "", "description": d, "priority": p}
        for n, t, p, d in defs
    ]


def _pod_row(pod: Mapping[str, Any], now: datetime | None) -> list[Any]:
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    containers = (pod.get("spec") or {}).get("containers") or []
    ready = sum(1 for cs in statuses if cs.get("ready"))
    restarts = sum(int(cs.get("restartCount") or 0) for cs in statuses)
    shown = status.get("reason") or status.get("phase", "Pending")
    for cs in statuses:
        state = cs.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            shown = state["waiting"]["reason"]
        elif (state.get("terminated") or {}).get("reason") and status.get("phase") != "Succeeded":
            shown = state["terminated"]["reason"]
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        shown = "Terminating"
    return [f"{ready}/{len(containers)}", shown, restarts, age(pod, now), status.get("podIP", "<none>"),
            (pod.get("spec") or {}).get("nodeName", "<none>")]  # fmt: skip


BUILTIN: dict[str, tuple[list[tuple[str, str, int, str]], Any]] = {
    "Pod": (
        [("Ready", "string", 0, ""), ("Status", "string", 0, ""), ("Restarts", "integer", 0, ""),
         ("Age", "string", 0, ""), ("IP", "string", 1, ""), ("Node", "string", 1, "")],
        _pod_row,
    ),
    "StatefulSet": (
        [("Ready", "string", 0, ""), ("Age", "string", 0, "")],
        lambda o, now: [f"{(o.get('status') or {}).get('readyReplicas', 0)}/{(o.get('spec') or {}).get('replicas', 1)}",
                        age(o, now)],
    ),
    "Deployment": (
        [("Ready", "string", 0, ""), ("Age", "string", 0, "")],
        lambda o, now: [f"{(o.get('status') or {}).get('readyReplicas', 0)}/{(o.get('spec') or {}).get('replicas', 1)}",
                        age(o, now)],
    ),
    "Job": (
        [("Status", "string", 0, ""), ("Completions", "string", 0, ""), ("Age", "string", 0, "")],
        lambda o, now: [_job_status(o),
                        f"{(o.get('status') or {}).get('succeeded', 0)}/{(o.get('spec') or {}).get('completions', 1)}",
                        age(o, now)],
    ),
    "Event": (
        [("Last Seen", "string", 0, ""), ("Type", "string", 0, ""), ("Reason", "string", 0, ""),
         ("Object", "string", 0, ""), ("Message", "string", 0, "")],
        lambda o, now: [_since(o.get("lastTimestamp") or o.get("eventTime") or (o.get("metadata") or {}).get("creationTimestamp"), now),
                        o.get("type", ""), o.get("reason", ""),
                        f"{(o.get('involvedObject') or {}).get('kind', '').lower()}/{(o.get('involvedObject') or {}).get('name', '')}",
                        o.get("message", "")],
    ),
}  # fmt: skip


def _since(stamp: str | None, now: datetime | None) -> str:
    t = parse_time(stamp or "")
    return human_duration(((now or datetime.now(UTC)) - t).total_seconds()) if t else "<unknown>"


def _job_status(job: Mapping[str, Any]) -> str:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return cond["type"]
    return "Running"


def table(kind: str, objects: list[Mapping[str, Any]], printer_columns: list[Mapping[str, Any]] | None,
          resource_version: str, include_object: bool = True, now: datetime | None = None) -> dict[str, Any]:  # fmt: skip
    """A meta.k8s.io/v1 Table of `objects` (printer_columns: a CRD version's additionalPrinterColumns)."""
    if printer_columns is not None:
        defs = [("Name", "string", 0, "Name must be unique within a namespace")]
        defs += [(c["name"], c.get("type", "string"), int(c.get("priority", 0)), c.get("description", ""))
                 for c in printer_columns]  # fmt: skip

        def row(o: Mapping[str, Any], now: datetime | None) -> list[Any]:
            return [_cell(c.get("type", "string"), jsonpath(o, c["jsonPath"]), now) for c in printer_columns]
    elif kind in BUILTIN:
        extra, row = BUILTIN[kind]
        defs = [("Name", "string", 0, ""), *extra]
    else:
        defs = [("Name", "string", 0, ""), ("Age", "string", 0, "")]

        def row(o: Mapping[str, Any], now: datetime | None) -> list[Any]:
            return [age(o, now)]

    rows = []
    for obj in objects:
        r: dict[str, Any] = {"cells": [(obj.get("metadata") or {}).get("name"), *row(obj, now)]}
        if include_object:
            r["object"] = dict(obj)
        rows.append(r)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": _columns(defs),
        "rows": rows,
    }
