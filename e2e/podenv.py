"""What a container's process gets: its argv and env with everything the kubelet resolves
(pure functions, tested without processes).

- env in order, `$(VAR)` expanded against the variables defined before it (`$$` escapes),
  `valueFrom` (fieldRef: the downward API; resourceFieldRef; configMapKeyRef; secretKeyRef)
  and `envFrom`, then `$(VAR)` in command and args against the final env;
- the loopback mapping: every process runs on 127.0.0.1, so each pod gets its own host
  port for each of its containerPorts (stable per pod name, so a restarted StatefulSet
  pod keeps them). `Rewriter` rewrites text the process reads (args, env values, mounted
  ConfigMap files): `<service DNS name>:<port>` and `<pod>.<subdomain>…:<port>` become
  `127.0.0.1:<host port of the endpoint pod>`, `0.0.0.0|127.0.0.1|localhost:<containerPort>`
  and a bare `<containerPort>` argument or env value become the pod's own host port, and
  image paths and volume mountPaths become host directories.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

POD_IP = "127.0.0.1"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class ConfigError(Exception):
    """CreateContainerConfigError: a referenced ConfigMap, Secret or key is missing."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: unknown references stay as written, `$$` is `$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    m = _FIELD_KEY.match(path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"), "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"), "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": POD_IP, "status.hostIP": POD_IP, "status.podIPs": POD_IP, "status.hostIPs": POD_IP,
    }  # fmt: skip
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef.fieldPath {path!r}")
    return "" if simple[path] is None else str(simple[path])


def _quantity(value: str, divisor: str = "1") -> str:
    """resourceFieldRef: cpu rounds up to whole units of the divisor, memory to bytes."""
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}

    def num(q: str) -> float:
        for u in sorted(units, key=len, reverse=True):
            if q.endswith(u):
                return float(q[: -len(u)]) * units[u]
        return float(q)

    import math

    return str(math.ceil(num(value) / num(divisor)))


def _lookup(kind: str, objects: Mapping[str, Mapping[str, Any]], ref: Mapping[str, Any]) -> dict[str, str] | None:
    obj = objects.get(ref.get("name", ""))
    if obj is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{kind} "{ref.get("name")}" not found')
    data = dict(obj.get("data") or {})
    if kind == "secret":
        data = {k: base64.b64decode(v).decode() for k, v in data.items()}
        data.update(obj.get("stringData") or {})
    return data


def resolve_env(pod: Mapping[str, Any], container: Mapping[str, Any], configmaps: Mapping[str, Mapping[str, Any]],
                secrets: Mapping[str, Mapping[str, Any]], base: Mapping[str, str] | None = None) -> dict[str, str]:  # fmt: skip
    """The container's environment as the kubelet builds it (base first, then envFrom, then env)."""
    env: dict[str, str] = dict(base or {})
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if "configMapRef" in src:
            data = _lookup("configmap", configmaps, src["configMapRef"]) or {}
        elif "secretRef" in src:
            data = _lookup("secret", secrets, src["secretRef"]) or {}
        else:
            data = {}
        env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            env[name] = expand(str(var["value"]), env)
            continue
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            env[name] = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            resource = ref["resource"]  # limits.cpu, requests.memory, ...
            kind, res = resource.split(".", 1)
            value = ((container.get("resources") or {}).get(kind) or {}).get(res)
            env[name] = _quantity(str(value), str(ref.get("divisor", "1"))) if value is not None else "0"
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind, ref = ("configmap", source["configMapKeyRef"]) if "configMapKeyRef" in source else ("secret", source["secretKeyRef"])
            data = _lookup(kind, configmaps if kind == "configmap" else secrets, ref)
            if data is None:
                continue
            if ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'couldn\'t find key {ref["key"]} in {kind} {ref.get("name")}')
            env[name] = data[ref["key"]]
        else:
            env[name] = ""
    return env


def argv(container: Mapping[str, Any], entrypoint: list[str], env: Mapping[str, str]) -> list[str]:
    """command (or the image's entrypoint) + args, with `$(VAR)` expanded."""
    command = list(container.get("command") or entrypoint)
    return [expand(str(a), env) for a in [*command, *(container.get("args") or [])]]


_HOSTPORT = re.compile(r"(?<![\w.-])([a-z0-9](?:[-a-z0-9.]*[a-z0-9])?):(\d{1,5})(?!\d)")
_FLAG_NUM = re.compile(r"^(--?[\w-]+=)(\d{1,5})$")


@dataclass
class Rewriter:
    """Rewrites what a process reads so that it lives on 127.0.0.1 beside the others.

    dns: host name -> (service or pod port -> host port); own: this pod's containerPort
    -> host port; paths: image or mount path -> host directory."""

    dns: dict[str, dict[int, int]] = field(default_factory=dict)
    own: dict[int, int] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def text(self, text: str) -> str:
        def hostport(m: re.Match[str]) -> str:
            host, port = m.group(1), int(m.group(2))
            if host in self.dns and port in self.dns[host]:
                return f"{POD_IP}:{self.dns[host][port]}"
            if host in ("0.0.0.0", "127.0.0.1", "localhost") and port in self.own:
                return f"{host}:{self.own[port]}"
            return m.group(0)

        text = _HOSTPORT.sub(hostport, text)
        if self.paths:  # one pass: a host directory put in is never rewritten again (/tmp mounts)
            alternatives = "|".join(re.escape(p) for p in sorted(self.paths, key=len, reverse=True))
            pattern = rf"(?<![\w.-])({alternatives})(?=/|$|[\s\"',;:=])"
            text = re.sub(pattern, lambda m: self.paths[m.group(1)], text)
        return text

    def value(self, value: str) -> str:
        """An argument or env value: a bare containerPort is this pod's host port."""
        if value.isdigit() and int(value) in self.own:
            return str(self.own[int(value)])
        m = _FLAG_NUM.match(value)
        if m and int(m.group(2)) in self.own:
            return m.group(1) + str(self.own[int(m.group(2))])
        return self.text(value)


def dns_names(name: str, namespace: str, own_namespace: str) -> list[str]:
    """The names a Service (or `<host>.<subdomain>`) is reachable by from `own_namespace`."""
    names = [f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]
    return ([name] if namespace == own_namespace else []) + names


def named_port(pod: Mapping[str, Any], target: int | str) -> int | None:
    """A Service targetPort (number or container port name) as the pod's containerPort."""
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


def mentions(text: str, names: list[str]) -> bool:
    return any(re.search(rf"(?<![\w.-]){re.escape(n)}:\d", text) for n in names)


PortFor = Callable[[str, str, int], int]  # (namespace, pod name, containerPort) -> host port
