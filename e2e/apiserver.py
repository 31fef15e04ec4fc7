"""A Kubernetes API that real kubectl 1.32 and kopf accept, built on KMock 0.8.

KMock (the kopf author's emulator) gives the HTTP server, request parsing (resource,
namespace, name, subresource, action) and the versioned object store (`objects`, with
every version kept for assertions). Unmodified, kubectl fails against it (issue 10 lists
how); `ApiServer` serves the Kubernetes paths itself on top of KMock's store:

- discovery with `groupVersion: v1` for the core group, plurals, singular names, short
  names and categories on the main resource only, and resources of CRDs created through
  the API (a CRD becomes discoverable and listable when it is created);
- lists with `kind`/`apiVersion`, `metadata.resourceVersion`, label and field selectors;
- Table responses (CRD additionalPrinterColumns, see tables.py) for `kubectl get`;
- watches as `application/json` event streams, resumed from a resourceVersion, with
  `timeoutSeconds`, Table events for `kubectl get -w`;
- uid, resourceVersion (one global counter), generation (bumped on spec changes),
  creationTimestamp, `generateName`, cluster-scoped objects (Namespaces);
- PATCH (merge, strategic merge by patchMergeKey, see strategic.py, JSON patch), PUT (with optimistic
  concurrency on resourceVersion), the status subresource (status writes only there),
  finalizers and deletionTimestamp, graceful pod deletion (the kubelet finalizes),
  owner-reference garbage collection (background; orphan honoured);
- OpenAPI v3 documents that declare the `fieldValidation` parameter, so that
  `kubectl apply` validates "server-side" instead of needing `--validate=false`;
- `pods/<name>/log` from the process kubelet's log files.

What a real API server does that this does not: authentication, authorization (RBAC
objects are stored, never enforced), admission (no defaulting, no schema or CEL
validation of CRs, no quota), server-side apply, strategic merge beyond the common
merge keys (strategic.py), foreground deletion (treated as background), namespace deletion
cascade, field-selector restrictions, watch bookmarks, protobuf, aggregated discovery.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import dicts as kmock_dicts
from kmock._internal import rendering

from . import kmock_patches  # noqa: F401  (KMock 0.8 crashes on /api/v1/namespaces without it)

from .strategic import strategic_merge
from .selectors import parse_field_selector, parse_label_selector
from .tables import table

SERVER_VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-e2e-harness", "platform": "linux/amd64"}


@dataclass
class ResourceType:
    """One served resource (a discovery entry)."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    singular: str = ""
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    subresources: set[str] = field(default_factory=set)
    printer_columns: list[dict[str, Any]] | None = None  # CRDs only

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    def discovery(self) -> list[dict[str, Any]]:
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        entries = [{
            "name": self.plural, "singularName": self.singular or self.kind.lower(), "namespaced": self.namespaced,
            "kind": self.kind, "verbs": verbs, "shortNames": self.short_names, "categories": self.categories,
        }]  # fmt: skip
        for sub in sorted(self.subresources):
            sub_kind, sub_verbs = (("Pod", ["get"]) if sub == "log" else (self.kind, ["get", "patch", "update"]))
            entries.append({"name": f"{self.plural}/{sub}", "singularName": "", "namespaced": self.namespaced,
                            "kind": sub_kind, "verbs": sub_verbs})  # fmt: skip
        return entries


def _core(plural: str, kind: str, namespaced: bool = True, short: tuple[str, ...] = (), subs: tuple[str, ...] = (),
          group: str = "", cats: tuple[str, ...] = ()) -> ResourceType:  # fmt: skip
    return ResourceType(group, "v1", plural, kind, namespaced, kind.lower(), list(short), list(cats), set(subs))


BUILTIN_TYPES = [
    _core("namespaces", "Namespace", False, ("ns",), ("status",)),
    _core("pods", "Pod", True, ("po",), ("status", "log"), cats=("all",)),
    _core("services", "Service", True, ("svc",), ("status",), cats=("all",)),
    _core("configmaps", "ConfigMap", True, ("cm",)),
    _core("secrets", "Secret"),
    _core("events", "Event", True, ("ev",)),
    _core("serviceaccounts", "ServiceAccount", True, ("sa",)),
    _core("persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",), ("status",)),
    _core("statefulsets", "StatefulSet", True, ("sts",), ("status",), group="apps", cats=("all",)),
    _core("deployments", "Deployment", True, ("deploy",), ("status",), group="apps", cats=("all",)),
    _core("jobs", "Job", True, (), ("status",), group="batch", cats=("all",)),
    _core("customresourcedefinitions", "CustomResourceDefinition", False, ("crd", "crds"), ("status",),
          group="apiextensions.k8s.io"),
    _core("clusterroles", "ClusterRole", False, group="rbac.authorization.k8s.io"),
    _core("clusterrolebindings", "ClusterRoleBinding", False, group="rbac.authorization.k8s.io"),
    _core("roles", "Role", True, group="rbac.authorization.k8s.io"),
    _core("rolebindings", "RoleBinding", True, group="rbac.authorization.k8s.io"),
    _core("leases", "Lease", True, group="coordination.k8s.io"),
    _core("poddisruptionbudgets", "PodDisruptionBudget", True, ("pdb",), ("status",), group="policy"),
]


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "details": self.details, "code": self.code}  # fmt: skip


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _wants_table(request: rendering.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")


class ApiServer(kmock.KubernetesEmulator):
    """KMock's emulator with the Kubernetes paths served as kubectl and kopf expect.

    All state changes go through `create`/`update`/`delete`/`mutate` (also used
    in-process by the kubelet), which stamp metadata and publish watch events."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.types: dict[tuple[str, str, str], ResourceType] = {t.key: t for t in BUILTIN_TYPES}
        self.rv = 0
        self.events: list[tuple[int, tuple[str, str, str], str, dict[str, Any]]] = []
        self.changed = asyncio.Condition()
        self.log_reader: Callable[[str, str, str | None, bool], str | None] | None = None

    # --- the store ------------------------------------------------------------------

    def type_of(self, group: str, version: str, plural: str) -> ResourceType:
        t = self.types.get((group, version, plural))
        if t is None:
            gv = f"{group}/{version}" if group else version
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({gv} {plural})")
        return t

    def type_by_kind(self, api_version: str, kind: str) -> ResourceType:
        for t in self.types.values():
            if t.group_version == api_version and t.kind == kind:
                return t
        raise ApiError(404, "NotFound", f"no matches for kind {kind!r} in version {api_version!r}")

    def _key(self, t: ResourceType, namespace: str | None, name: str) -> Any:
        return (kmock.resource(t.group, t.version, t.plural), namespace if t.namespaced else None, name)

    def get(self, t: ResourceType, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = self._key(t, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def list(self, t: ResourceType, namespace: str | None = None) -> list[dict[str, Any]]:
        res = kmock.resource(t.group, t.version, t.plural)
        out = []
        for (r, ns, _), obj in list(self.objects.items()):
            if r == res and not obj.deleted and (namespace is None or ns == namespace):
                out.append(copy.deepcopy(obj.raw))
        return sorted(out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _publish(self, t: ResourceType, type_: str, obj: dict[str, Any]) -> None:
        self.events.append((self.rv, t.key, type_, copy.deepcopy(obj)))
        if len(self.events) > 20000:
            del self.events[:5000]
        self._notify()

    def _notify(self) -> None:
        async def notify() -> None:
            async with self.changed:
                self.changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(notify())
        except RuntimeError:
            pass  # used without a server (pure tests): no watch to wake

    def _stamp(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def create(self, t: ResourceType, namespace: str | None, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", f"{t.kind} is invalid: metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        ns = (namespace or meta.get("namespace")) if t.namespaced else None
        if t.namespaced:
            if not ns:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = ns
            if self.get(self.types[("", "v1", "namespaces")], None, ns) is None:
                raise ApiError(404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})
        else:
            meta.pop("namespace", None)
        if self.get(t, ns, meta["name"]) is not None:
            raise ApiError(409, "AlreadyExists", f'{t.plural}{"." + t.group if t.group else ""} "{meta["name"]}" already exists',
                           {"name": meta["name"], "group": t.group, "kind": t.plural})  # fmt: skip
        obj["apiVersion"], obj["kind"] = t.group_version, t.kind
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
        meta.pop("deletionTimestamp", None)
        if t.kind == "Namespace":
            obj["status"] = {"phase": "Active"}
        if t.kind == "Pod":
            obj.setdefault("status", {}).setdefault("phase", "Pending")
            obj["spec"].setdefault("restartPolicy", "Always")
        if t.kind == "CustomResourceDefinition":
            self._register_crd(obj)
        if dry_run:
            return obj
        self._stamp(obj)
        key = self._key(t, ns, meta["name"])
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        self._publish(t, "ADDED", obj)
        return copy.deepcopy(obj)

    def update(self, t: ResourceType, namespace: str | None, name: str, new: dict[str, Any], subresource: str | None = None,
               check_version: bool = True) -> dict[str, Any]:  # fmt: skip
        """Replace an object (PUT semantics): the status subresource changes only the
        status, the main resource everything but the status (when it has a subresource)."""
        old = self.get(t, namespace, name)
        if old is None:
            raise ApiError(404, "NotFound", f'{t.plural}{"." + t.group if t.group else ""} "{name}" not found',
                           {"name": name, "group": t.group, "kind": t.plural})  # fmt: skip
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if check_version and want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {t.plural} "{name}": the object has been '
                           "modified; please apply your changes to the latest version and try again")  # fmt: skip
        if subresource == "status":
            obj = copy.deepcopy(old)
            obj["status"] = copy.deepcopy(new.get("status"))
            if obj["status"] is None:
                obj.pop("status")
        else:
            obj = copy.deepcopy(new)
            obj["apiVersion"], obj["kind"] = t.group_version, t.kind
            meta = obj.setdefault("metadata", {})
            for k in ("uid", "creationTimestamp", "namespace", "name", "generation", "deletionTimestamp"):
                if k in old["metadata"]:
                    meta[k] = old["metadata"][k]
                else:
                    meta.pop(k, None)
            if old["metadata"].get("deletionTimestamp") and len(meta.get("finalizers") or []) > len(old["metadata"].get("finalizers") or []):
                raise ApiError(422, "Invalid", "no new finalizers can be added if the object is being deleted")
            if "status" in t.subresources or t.kind == "Pod":
                if "status" in old:
                    obj["status"] = old["status"]
                else:
                    obj.pop("status", None)
            strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
            if strip(obj) != strip(old):
                meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        if obj == old:
            return obj  # a no-op write changes nothing, not even the resourceVersion
        if t.kind == "CustomResourceDefinition":
            self._register_crd(obj)
        self._stamp(obj)
        key = self._key(t, namespace, name)
        meta = obj["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key].create(obj)
            self._remove(t, key, obj)
            return obj
        self.objects[key].create(obj)
        self._publish(t, "MODIFIED", obj)
        return copy.deepcopy(obj)

    def patch(self, t: ResourceType, namespace: str | None, name: str, patch: Any, content_type: str,
              subresource: str | None = None) -> dict[str, Any]:  # fmt: skip
        old = self.get(t, namespace, name)
        if old is None:
            raise ApiError(404, "NotFound", f'{t.plural}{"." + t.group if t.group else ""} "{name}" not found',
                           {"name": name, "group": t.group, "kind": t.plural})  # fmt: skip
        try:
            if "json-patch" in content_type:
                new = jsonpatch.apply_patch(old, patch, in_place=False)
            elif "strategic" in content_type:
                if not isinstance(patch, dict):
                    raise ApiError(400, "BadRequest", "a strategic merge patch must be a JSON object")
                if t.printer_columns is not None:  # custom resources have no strategic merge
                    raise ApiError(415, "UnsupportedMediaType", "strategic merge patch is not supported for custom resources")
                new = strategic_merge(old, patch)
            elif "merge-patch" in content_type:
                if not isinstance(patch, dict):
                    raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
                new = kmock_dicts.merge_patch_dict(old, patch)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got {content_type!r})")
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, ValueError, TypeError) as err:
            raise ApiError(422, "Invalid", f"the patch could not be applied: {err}") from err
        new = copy.deepcopy(dict(new))
        new.setdefault("metadata", {})["resourceVersion"] = (patch.get("metadata") or {}).get(
            "resourceVersion") if isinstance(patch, dict) else None
        if not new["metadata"]["resourceVersion"]:
            new["metadata"].pop("resourceVersion")
        if subresource != "status" and ("status" in t.subresources or t.kind == "Pod"):
            new["status"] = old.get("status")
            if new["status"] is None:
                new.pop("status")
        return self.update(t, namespace, name, new, subresource)

    def delete(self, t: ResourceType, namespace: str | None, name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        options = options or {}
        obj = self.get(t, namespace, name)
        if obj is None:
            raise ApiError(404, "NotFound", f'{t.plural}{"." + t.group if t.group else ""} "{name}" not found',
                           {"name": name, "group": t.group, "kind": t.plural})  # fmt: skip
        meta = obj["metadata"]
        key = self._key(t, namespace, name)
        if options.get("propagationPolicy") == "Orphan":
            meta.setdefault("annotations", {})["e2e.persia.com/orphan-dependents"] = "true"
        grace = options.get("gracePeriodSeconds")
        graceful_pod = t.kind == "Pod" and obj.get("spec", {}).get("nodeName") and grace != 0 \
            and obj.get("status", {}).get("phase") not in ("Succeeded", "Failed")
        if meta.get("finalizers") or graceful_pod:
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now_iso()
                if t.kind == "Pod":
                    default = obj["spec"].get("terminationGracePeriodSeconds", 30)
                    meta["deletionGracePeriodSeconds"] = int(default if grace is None else grace)
                self._stamp(obj)
                self.objects[key].create(obj)
                self._publish(t, "MODIFIED", obj)
            return copy.deepcopy(obj)
        self._remove(t, key, obj)
        return obj

    def _remove(self, t: ResourceType, key: Any, obj: dict[str, Any]) -> None:
        self._stamp(obj)
        self.objects[key].delete()
        self._publish(t, "DELETED", obj)
        if t.kind == "CustomResourceDefinition":
            self._unregister_crd(obj)
        orphan = (obj["metadata"].get("annotations") or {}).get("e2e.persia.com/orphan-dependents") == "true"
        self._collect_garbage(obj["metadata"]["uid"], orphan)

    def _collect_garbage(self, uid: str, orphan: bool) -> None:
        """Delete (or orphan) the dependents of a removed owner, as the garbage collector
        does with background propagation (here: at once, in the same call)."""
        for dt in list(self.types.values()):
            for dep in self.list(dt):
                refs = dep["metadata"].get("ownerReferences") or []
                if not any(r.get("uid") == uid for r in refs):
                    continue
                rest = [r for r in refs if r.get("uid") != uid]
                ns, name = dep["metadata"].get("namespace"), dep["metadata"]["name"]
                try:
                    if orphan or rest:
                        dep["metadata"]["ownerReferences"] = rest
                        dep["metadata"].pop("resourceVersion", None)
                        self.update(dt, ns, name, dep)
                    else:
                        self.delete(dt, ns, name, {"propagationPolicy": "Background"})
                except ApiError:
                    pass  # already gone

    # --- CRDs -------------------------------------------------------------------------

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec, names = crd.get("spec") or {}, (crd.get("spec") or {}).get("names") or {}
        for v in spec.get("versions") or []:
            if not v.get("served", True):
                continue
            subs = set((v.get("subresources") or {}).keys())
            self.types[(spec["group"], v["name"], names["plural"])] = ResourceType(
                spec["group"], v["name"], names["plural"], names["kind"], spec.get("scope", "Namespaced") == "Namespaced",
                names.get("singular", names["kind"].lower()), list(names.get("shortNames") or []),
                list(names.get("categories") or []), subs, list(v.get("additionalPrinterColumns") or []),
            )  # fmt: skip
        crd["status"] = {
            "acceptedNames": dict(names),
            "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": now_iso(),
                 "message": "no conflicts found"},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "lastTransitionTime": now_iso(), "message": "the initial names have been accepted"},
            ],
        }  # fmt: skip

    def _unregister_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        for v in spec.get("versions") or []:
            self.types.pop((spec.get("group"), v["name"], (spec.get("names") or {}).get("plural")), None)

    # --- HTTP -------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/") or "/"
        try:
            discovery = self._discovery(path)
            if discovery is not None:
                return aiohttp.web.json_response(discovery)
            if path.startswith("/openapi/"):
                return aiohttp.web.json_response(self._openapi(path))
            target = parse_path(path)
            if target is not None:
                return await self._serve_resource(request, *target)
        except ApiError as err:
            return aiohttp.web.json_response(err.status(), status=err.code)
        return await super()._handle(request)

    def _discovery(self, path: str) -> dict[str, Any] | None:
        if path == "/version":
            return SERVER_VERSION
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}  # fmt: skip
        groups: dict[str, list[str]] = {}
        for t in self.types.values():
            if t.group and t.version not in groups.setdefault(t.group, []):
                groups[t.group].append(t.version)

        def group_doc(name: str) -> dict[str, Any]:
            versions = [{"groupVersion": f"{name}/{v}", "version": v} for v in groups[name]]
            return {"kind": "APIGroup", "apiVersion": "v1", "name": name, "versions": versions,
                    "preferredVersion": versions[0]}  # fmt: skip

        if path == "/apis":
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_doc(g) for g in sorted(groups)]}
        parts = path.strip("/").split("/")
        if parts[0] == "apis" and len(parts) == 2:
            if parts[1] not in groups:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return group_doc(parts[1])
        if (parts[0] == "api" and len(parts) == 2) or (parts[0] == "apis" and len(parts) == 3):
            group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
            served = [t for t in self.types.values() if t.group == group and t.version == version]
            if not served:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": served[0].group_version,
                    "resources": [e for t in served for e in t.discovery()]}  # fmt: skip
        if path == "/":
            return {"paths": ["/api", "/api/v1", "/apis", "/openapi/v3", "/version",
                              *sorted({f"/apis/{t.group_version}" for t in self.types.values() if t.group})]}  # fmt: skip
        return None

    def _openapi(self, path: str) -> dict[str, Any]:
        """OpenAPI v3: just enough for kubectl to see that PATCH takes `fieldValidation`
        (it then validates server-side; this server accepts the parameter and ignores it)."""
        gvs = sorted({t.group_version for t in self.types.values()})
        if path == "/openapi/v3":
            return {"paths": {("api/" if "/" not in gv else "apis/") + gv: {
                "serverRelativeURL": f"/openapi/v3/{'api/' if '/' not in gv else 'apis/'}{gv}?hash={self.rv}"} for gv in gvs}}
        gv = path.removeprefix("/openapi/v3/").removeprefix("apis/").removeprefix("api/")
        paths = {}
        for t in self.types.values():
            if t.group_version != gv:
                continue
            base = f"/api/{gv}" if not t.group else f"/apis/{gv}"
            item = f"{base}/namespaces/{{namespace}}/{t.plural}/{{name}}" if t.namespaced else f"{base}/{t.plural}/{{name}}"
            paths[item] = {"patch": {
                "x-kubernetes-group-version-kind": {"group": t.group, "version": t.version, "kind": t.kind},
                "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK"}},
            }}  # fmt: skip
        if not paths:
            raise ApiError(404, "NotFound", f"no OpenAPI document for {gv}")
        return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": SERVER_VERSION["gitVersion"]},
                "paths": paths, "components": {"schemas": {}}}  # fmt: skip

    async def _serve_resource(self, request: rendering.Request, group: str, version: str, plural: str,
                              ns: str | None, name: str | None, sub: str | None) -> aiohttp.web.StreamResponse:  # fmt: skip
        t = self.type_of(group, version, plural)
        method = request.method.value.upper() if hasattr(request.method, "value") else str(request.method).upper()
        params = request.params
        body = request.data
        ctype = request.headers.get("Content-Type", "application/json")
        if "protobuf" in ctype or "cbor" in ctype:
            raise ApiError(415, "UnsupportedMediaType", f"the e2e harness serves JSON only, not {ctype}")
        if sub and sub not in t.subresources:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({t.plural}/{sub})")
        if sub == "log" and method == "GET":
            return await self._serve_log(ns or "", name or "", params)
        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._serve_watch_stream(request, t, ns, name)
        if method == "GET" and name is None:
            items = self._select(t, ns, params)
            if _wants_table(request):
                return aiohttp.web.json_response(table(t.kind, items, t.printer_columns, str(self.rv)))
            for item in items:
                item.setdefault("apiVersion", t.group_version)
                item.setdefault("kind", t.kind)
            return aiohttp.web.json_response({"kind": f"{t.kind}List", "apiVersion": t.group_version,
                                              "metadata": {"resourceVersion": str(self.rv)}, "items": items})  # fmt: skip
        if method == "GET":
            obj = self.get(t, ns, name or "")
            if obj is None:
                raise ApiError(404, "NotFound", f'{t.plural}{"." + t.group if t.group else ""} "{name}" not found',
                               {"name": name, "group": t.group, "kind": t.plural})  # fmt: skip
            if _wants_table(request):
                return aiohttp.web.json_response(table(t.kind, [obj], t.printer_columns, str(self.rv)))
            return aiohttp.web.json_response(obj)
        if method == "POST" and name is None:
            obj = self.create(t, ns, body, dry_run=params.get("dryRun") == "All")
            return aiohttp.web.json_response(obj, status=201)
        if method == "PUT" and name is not None:
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the request body must be a JSON object")
            return aiohttp.web.json_response(self.update(t, ns, name, body, sub))
        if method == "PATCH" and name is not None:
            if "apply-patch" in ctype:
                raise ApiError(415, "UnsupportedMediaType", "server-side apply is not supported by the e2e harness; "
                               "use client-side kubectl apply")  # fmt: skip
            patch = json.loads(request.body or b"null")
            return aiohttp.web.json_response(self.patch(t, ns, name, patch, ctype, sub))
        if method == "DELETE" and name is not None:
            options = body if isinstance(body, dict) else {}
            if "gracePeriodSeconds" in params:
                options["gracePeriodSeconds"] = int(params["gracePeriodSeconds"])
            if "propagationPolicy" in params:
                options["propagationPolicy"] = params["propagationPolicy"]
            return aiohttp.web.json_response(self.delete(t, ns, name, options))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {request.url.path}")

    def _select(self, t: ResourceType, ns: str | None, params: Any) -> list[dict[str, Any]]:
        try:
            labels = parse_label_selector(params.get("labelSelector"))
            fields = parse_field_selector(params.get("fieldSelector"))
        except ValueError as err:
            raise ApiError(400, "BadRequest", str(err)) from err
        return [o for o in self.list(t, ns) if labels(o["metadata"].get("labels") or {}) and fields(o)]

    async def _serve_watch_stream(self, request: rendering.Request, t: ResourceType, ns: str | None,
                                  name: str | None) -> aiohttp.web.StreamResponse:  # fmt: skip
        params = dict(request.params)
        if name is not None:  # /…/plural/<name>?watch=true: a watch of one object
            params["fieldSelector"] = ",".join(filter(None, [params.get("fieldSelector"), f"metadata.name={name}"]))
        try:
            labels = parse_label_selector(params.get("labelSelector"))
            fields = parse_field_selector(params.get("fieldSelector"))
        except ValueError as err:
            raise ApiError(400, "BadRequest", str(err)) from err
        as_table = _wants_table(request)

        def matches(obj: dict[str, Any]) -> bool:
            meta = obj["metadata"]
            return (ns is None or meta.get("namespace") == ns) and labels(meta.get("labels") or {}) and fields(obj)

        def encode(type_: str, obj: dict[str, Any]) -> bytes:
            payload = table(t.kind, [obj], t.printer_columns, obj["metadata"].get("resourceVersion", ""), True) if as_table else obj
            return json.dumps({"type": type_, "object": payload}).encode() + b"\n"

        raw = request._raw_request
        assert raw is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        since = params.get("resourceVersion")
        if since in (None, "", "0"):
            for obj in self.list(t, ns):
                if matches(obj):
                    await response.write(encode("ADDED", obj))
            position = self.rv
        else:
            position = int(since)
            if self.events and position < self.events[0][0] - 1:
                gone = ApiError(410, "Expired", f"too old resource version: {position} ({self.events[0][0]})")
                await response.write(json.dumps({"type": "ERROR", "object": gone.status()}).encode() + b"\n")
                return response
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(params.get("timeoutSeconds") or 1800)
        try:
            while loop.time() < deadline:
                start = bisect.bisect_right(self.events, position, key=lambda e: e[0])
                for rv, key, type_, obj in self.events[start:]:
                    position = rv
                    if key == t.key and matches(obj):
                        await response.write(encode(type_, obj))
                async with self.changed:
                    try:
                        await asyncio.wait_for(self.changed.wait(), timeout=max(0.0, min(1.0, deadline - loop.time())))
                    except TimeoutError:
                        pass
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        return response

    async def _serve_log(self, ns: str, name: str, params: Any) -> aiohttp.web.StreamResponse:
        if self.get(self.types[("", "v1", "pods")], ns, name) is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
        if self.log_reader is None:
            raise ApiError(400, "BadRequest", "no kubelet serves logs")
        text = self.log_reader(ns, name, params.get("container"), params.get("previous") == "true")
        if text is None:
            raise ApiError(400, "BadRequest", f'container in pod "{name}" has no log yet')
        if params.get("tailLines"):
            text = "".join(text.splitlines(keepends=True)[-int(params["tailLines"]):])
        return aiohttp.web.Response(text=text, content_type="text/plain")


def parse_path(path: str) -> tuple[str, str, str, str | None, str | None, str | None] | None:
    """/api/v1/namespaces/ns/pods/name/log -> ("", "v1", "pods", "ns", "name", "log").

    Namespaces are told apart from namespaced collections as the API server does:
    /api/v1/namespaces/<name>[/status|/finalize] is the Namespace itself."""
    segs = [s for s in path.strip("/").split("/") if s]
    if len(segs) >= 3 and segs[0] == "api":
        group, version, rest = "", segs[1], segs[2:]
    elif len(segs) >= 4 and segs[0] == "apis":
        group, version, rest = segs[1], segs[2], segs[3:]
    else:
        return None
    ns = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        ns, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    sub = "/".join(rest[2:]) or None
    return group, version, plural, ns, name, sub
