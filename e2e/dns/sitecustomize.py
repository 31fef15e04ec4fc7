"""Cluster DNS for the process kubelet's Python processes (imported at interpreter start
from PYTHONPATH, as every `sitecustomize` is).

Processes run on 127.0.0.1, so `<service>.<namespace>.svc:<port>` must reach the host
port the kubelet gave the endpoint pod. The kubelet keeps `$E2E_DNS_MAP` (JSON:
{"host:port": [ip, port], "host": ip}) current; `socket.getaddrinfo` answers from it at
connect time, so a name resolves when it is used (like cluster DNS), not only when the
container starts. Names not in the map resolve as usual. Non-Python processes do not get
this; the kubelet rewrites their arguments and config files instead.
"""

import json
import os
import socket

_path = os.environ.get("E2E_DNS_MAP")
_original = socket.getaddrinfo


def _lookup(host, port):
    try:
        with open(_path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return None
    key = f"{host}:{port}"
    if key in table:
        return table[key]
    if host in table:
        return [table[host], port]
    return None


def getaddrinfo(host, port, *args, **kwargs):
    if _path and isinstance(host, str) and host not in ("localhost", "127.0.0.1", "0.0.0.0", ""):
        found = _lookup(host.rstrip("."), port)
        if found is not None:
            host, port = found[0], found[1]
    return _original(host, port, *args, **kwargs)


if _path:
    socket.getaddrinfo = getaddrinfo
