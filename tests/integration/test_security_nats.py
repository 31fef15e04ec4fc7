"""NATS security with a real nats-server and real PS / embedding worker / NN-worker handlers:
unauthenticated clients are refused, forged controls (no job secret, a replay, a path outside the
checkpoint root) and malformed messages (hypothesis over every message schema) change nothing and
stop nothing."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persia import messages as M
from persia.bus import NatsBus, subject
from persia.errors import RemoteError
from persia.nats_server import CONFIG_NAME, NatsServer, private_dir_with_config
from persia.nn_worker.datasets import StreamingDataset, _stream_state, route_ends
from persia.security import SIGNATURE_HEADER, NatsAuth, new_secret, sign
from persia.wire.codec import decode, encode

from .cluster import cluster

pytestmark = pytest.mark.integration


def test_unauthenticated_and_wrong_password_clients_are_refused(nats_server):
    for auth in (NatsAuth(), NatsAuth(user="persia", password="wrong"), NatsAuth(token="guess")):
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="Authorization Violation|[Aa]uthoriz"):
            NatsBus(nats_server.url, name="intruder", auth=auth, secret=b"")
        assert time.monotonic() - t0 < 30  # a clear error, not a hang
    # a refused bus leaves no loop thread or pool behind (a role retrying would pile them up)
    left = [t.name for t in threading.enumerate() if t.name in ("nats-intruder",) or t.name.startswith("bus-intruder")]
    assert left == []
    ok = NatsBus(nats_server.url, name="member", auth=NatsAuth(**{
        "user": nats_server.user, "password": nats_server.password}), secret=b"")
    ok.close()


def test_nats_credentials_stay_out_of_argv_and_other_users_files(nats_server):
    pid = nats_server._proc.pid
    argv = open(f"/proc/{pid}/cmdline", "rb").read().decode()
    assert nats_server.password not in argv
    assert nats_server.password not in nats_server.url
    # the config it started from, with the password, is gone once it serves: a launcher killed
    # with SIGKILL leaves no credentials behind
    words = argv.split("\0")
    conf = words[words.index("-c") + 1]
    assert not os.path.exists(conf) and not os.path.exists(os.path.dirname(conf)), conf


def test_a_restart_keeps_the_port_and_credentials_and_leaves_no_config():
    server = NatsServer()
    try:
        url = server.start()
        server.restart()
        assert server.url == url
        bus = NatsBus(url, name="member", auth=NatsAuth(user=server.user, password=server.password), secret=b"")
        bus.close()
        words = open(f"/proc/{server.process.pid}/cmdline", "rb").read().decode().split("\0")
        assert not os.path.exists(words[words.index("-c") + 1])
    finally:
        server.stop()


def test_a_restart_waits_for_its_port_while_another_socket_holds_it():
    """A client's reconnect can pick the server's old port as its own source port and connect to
    itself: the port is held for a moment. The restart tries again instead of failing the job;
    a port that stays taken is still an error."""
    server = NatsServer()
    try:
        url = server.start()
        server.process.kill()
        server.process.wait()
        squatter = socket.create_server(("127.0.0.1", server.port))
        threading.Timer(1.0, squatter.close).start()  # held for a moment, then freed
        started = time.monotonic()
        assert server.restart() == url
        assert time.monotonic() - started >= 0.9  # it did wait for the port
        NatsBus(url, name="member", auth=NatsAuth(user=server.user, password=server.password), secret=b"").close()
        server.process.kill()
        server.process.wait()
        with socket.create_server(("127.0.0.1", server.port)):  # held for good
            with pytest.raises(RuntimeError, match="address already in use"):
                server.restart(port_busy_s=1.0)
    finally:
        server.stop()


def test_the_config_is_private_from_the_moment_it_exists():
    workdir = private_dir_with_config('authorization { password: "s3cret" }')
    try:
        assert stat.S_IMODE(os.stat(workdir).st_mode) == 0o700
        conf = workdir / CONFIG_NAME
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
        assert conf.read_text() == 'authorization { password: "s3cret" }'
    finally:
        shutil.rmtree(workdir)


def _raw_request(bus: NatsBus, subj: str, payload: bytes, headers=None) -> dict:
    msg = bus.run(bus.nc.request(subj, payload, timeout=10, headers=headers))
    return decode(msg.data)


def _state(ps, ew, ds, ckpt_root):
    return (len(ps.store), ps.store.hyperparameters, ps._optimizer, ps.status()["state"],
            ew.stats()["pending"], ds._queue.qsize(), sorted(os.listdir(ckpt_root)))


@pytest.fixture
def job(persia_env, tmp_path, monkeypatch):
    """A PS, an embedding worker and an NN rank's stream, configured and holding 5 rows."""
    root = tmp_path / "ckpt"
    root.mkdir()
    monkeypatch.setenv("PERSIA_CHECKPOINT_ROOT", str(root))
    with cluster(1, 1) as (ps, ew):
        member = NatsBus(name="trainer")  # the job's own: credentials and secret from env
        member.request(subject("ps", "configure", 0), {"init_lower": -0.1, "init_upper": 0.1})
        member.request(subject("ps", "register_optimizer", 0), {"type": "SGD", "lr": 0.1})
        ps.lookup({"train": True, "tables": [{"dim": 4, "signs": np.arange(1, 6, dtype=np.uint64)}]})
        ds = StreamingDataset(buffer_size=64)
        stream = _stream_state(0, SimpleNamespace())  # the process's stream of rank 0
        route_ends(member, 0)  # its ends of stream go to the open view's queue
        stream.open_view(ds, 0, None, 1.0)
        ds._register(member, stream, 0)
        # an account of another job on the same NATS: authenticated, but without this job's secret
        outsider = NatsBus(name="other-job", secret=new_secret().encode())
        try:
            yield member, outsider, ps, ew, ds, root
        finally:
            outsider.close()
            member.close()


def test_forged_controls_are_refused_and_change_nothing(job, tmp_path):
    member, outsider, ps, ew, ds, root = job
    before = _state(ps, ew, ds, root)
    forged = {
        subject("ps", "clear", 0): None,
        subject("ps", "dump", 0): {"dir": str(root / "x")},
        subject("ps", "load", 0): {"dir": str(root)},
        subject("ps", "configure", 0): {"init_lower": 5.0, "init_upper": 9.0},
        subject("ps", "register_optimizer", 0): {"type": "SGD", "lr": 100.0},
        subject("nn", "eos", 0): {"loader": 0, "loader_size": 1, "sent": 0},
        subject("nn", "batch", 0): {"batch_id": 0, "ref": 1, "worker": 0, "non_id": [], "labels": []},
        subject("nn", "batch_group", 0): {"batches": [{"batch_id": 0, "ref": 1, "worker": 0}]},
    }
    for subj, payload in forged.items():
        # signed with another job's secret, and not signed at all
        with pytest.raises(RemoteError, match="bad signature"):
            outsider.request(subj, payload)
        reply = _raw_request(outsider, subj, encode(payload))
        assert reply["kind"] == "Unauthorized" and "unsigned" in reply["error"], reply
    # a replay of a genuine signed clear
    secret = os.environ["PERSIA_JOB_SECRET"].encode()
    subj, payload = subject("ps", "clear", 0), encode(None)
    header = {SIGNATURE_HEADER: sign(secret, subj, payload)}
    assert _raw_request(outsider, subj, payload, header) == {"ok": {"rows": 0}}
    ps.lookup({"train": True, "tables": [{"dim": 4, "signs": np.arange(1, 6, dtype=np.uint64)}]})
    assert "replayed" in _raw_request(outsider, subj, payload, header)["error"]
    # the job itself may not write outside the checkpoint root either
    for bad in (str(tmp_path / "elsewhere"), str(root / ".." / "elsewhere"), "/tmp"):
        with pytest.raises(RemoteError, match="outside the checkpoint root"):
            member.request(subject("ps", "dump", 0), {"dir": bad})
    assert not (tmp_path / "elsewhere").exists()
    assert _state(ps, ew, ds, root) == before
    # and the job's own controls still work
    assert member.request(subject("ps", "dump", 0), {"dir": str(root / "c1")})["done"]
    assert (root / "c1").is_dir()


# -- malformed messages: hypothesis over each schema --------------------------------------------------
_GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**63 - 1), max_size=2),
    st.sampled_from([np.zeros(3, np.float32), np.zeros((2, 2), np.uint64), np.array([1, 2], np.int8)]),
)


def message_for(schema) -> st.SearchStrategy:
    """Maps with the schema's field names (each absent or garbage) plus, sometimes, a stray one."""
    fields = {name: st.one_of(st.just(...), _GARBAGE) for name in schema.model_fields}
    extra = st.dictionaries(st.sampled_from(["zz", "dir", "loader", "m"]), _GARBAGE, max_size=1)
    return st.tuples(st.fixed_dictionaries(fields), extra).map(
        lambda fe: {**{k: v for k, v in fe[0].items() if v is not ...}, **fe[1]})


SERVED = [
    (("ps", "configure", 0), M.Configure), (("ps", "register_optimizer", 0), M.RegisterOptimizer),
    (("ps", "dump", 0), M.CheckpointDir), (("ps", "load", 0), M.CheckpointDir), (("ps", "clear", 0), M.NoPayload),
    (("ps", "status", 0), M.NoPayload), (("ps", "info", None), M.NoPayload),
    (("ew", "forward", 0), M.Forward), (("ew", "forward_group", 0), M.ForwardGroup), (("ew", "info", None), M.NoPayload),
    (("nn", "eos", 0), M.EndOfStream), (("nn", "batch", 0), M.Batch), (("nn", "batch_group", 0), M.BatchGroup),
    (("rdzv", "claim", None), M.RendezvousClaim), (("rdzv", "renew", None), M.RendezvousRenew),
]


def test_malformed_messages_never_change_state_or_stop_a_server(job):
    member, _, ps, ew, ds, root = job
    before = _state(ps, ew, ds, root)
    refused = []

    for (service, method, replica), schema in SERVED:
        subj = subject(service, method, replica)

        @settings(max_examples=25, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(message_for(schema))
        def send(msg):
            try:
                M.validate(schema, msg)
                return  # a well-formed message is not what this test is about
            except M.MessageError:
                pass
            with pytest.raises(RemoteError) as err:
                member.request(subj, msg, timeout=5)
            assert err.value.kind == "MessageError", err.value
            refused.append(subj)

        send()
    # bytes that are not even a payload, signed by the job itself
    for blob in (b"", b"\x00" * 7, b"PW1\x00\xff\xff\xff\xff", os.urandom(64)):
        for (service, method, replica), _ in SERVED:
            subj = subject(service, method, replica)
            hdr = member._headers(subj, blob)
            reply = _raw_request(member, subj, blob, hdr)
            assert "error" in reply and reply["kind"] in ("WireError", "MessageError"), (subj, reply)
    assert len(set(refused)) == len(SERVED)
    assert _state(ps, ew, ds, root) == before
    # every server still serves
    assert member.request(subject("ps", "status", 0))["state"] == "idle"
    assert member.request(subject("ew", "info"))["replica_index"] == 0
    assert len(ps.store) == 5
