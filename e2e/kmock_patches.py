"""Upstream-able fixes to KMock 0.8 itself, applied on import (a monkeypatch, kept apart
from the harness so that each can be proposed upstream as it stands).

1. `kmock._internal.parsing.parse_path("/api/v1/namespaces")` raises ValueError: it takes
   "namespaces" for the start of a namespaced path and unpacks an empty remainder. The
   request then fails with a 500 before any handler runs, so creating or listing
   Namespaces (cluster-scoped) crashes the emulator. Fix: parse it as the `namespaces`
   resource (`/api/v1/namespaces/<name>` parses already).

The other gaps kubectl hits (issue 10: lists without `kind`, core discovery reporting
`groupVersion: "/v1"`, CRDs created through the API never discoverable, no Tables,
watch streams sent as `application/octet-stream`, short names and categories copied
onto subresources, the plural reported as `singularName`, `generateName` ignored, no
OpenAPI, no uid/resourceVersion) are not patched into KMock: `e2e.apiserver.ApiServer`
serves those paths itself. Each would be a small change in `kmock/_internal/k8s.py`
(`_serve_version`, `_serve_list`, `_serve_watch`, `_handle`) for an upstream proposal.
"""

from __future__ import annotations

from kmock._internal import parsing

_original_parse_path = parsing.parse_path


def parse_path(path: str) -> parsing.ParsedPath:
    try:
        return _original_parse_path(path)
    except ValueError:
        segs = [s for s in path.strip("/").split("/") if s]
        group, version = ("", segs[1]) if segs[0] == "api" else (segs[1], segs[2])
        return parsing.ParsedPath(group, version, "namespaces")


if getattr(parsing.parse_path, "__module__", "") != __name__:
    parsing.parse_path = parse_path
