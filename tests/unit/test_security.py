"""Pure security decisions: env parsing, URL redaction, signatures, checkpoint roots, schemas."""

from __future__ import annotations

import numpy as np
import pytest

from persia import messages as M
from persia.security import (
    GrpcTls, NatsAuth, SignatureChecker, Unauthorized, bind_address, check_under_root, checkpoint_root,
    needs_signature, redact_url, sign, with_tls_scheme,
)


def test_redact_url_hides_user_password_and_token():
    assert redact_url("nats://alice:s3cret@nats:4222") == "nats://***@nats:4222"
    assert redact_url("tok3n@nats:4222,nats://b:4222") == "nats://***@nats:4222,nats://b:4222"
    assert redact_url("nats://nats:4222") == "nats://nats:4222"
    assert "s3cret" not in redact_url("nats://a:s3cret@h1:1,nats://a:s3cret@h2:2")


def test_nats_auth_from_env(tmp_path):
    assert NatsAuth.from_env({}).connect_kwargs() == {}
    kw = NatsAuth.from_env({"PERSIA_NATS_USER": "u", "PERSIA_NATS_PASSWORD": "p"}).connect_kwargs()
    assert kw == {"user": "u", "password": "p"}
    assert NatsAuth.from_env({"PERSIA_NATS_TOKEN": "t"}).connect_kwargs() == {"token": "t"}
    with pytest.raises(ValueError, match="PERSIA_NATS_PASSWORD"):
        NatsAuth.from_env({"PERSIA_NATS_USER": "u"})
    with pytest.raises(ValueError, match="not both"):
        NatsAuth.from_env({"PERSIA_NATS_USER": "u", "PERSIA_NATS_PASSWORD": "p", "PERSIA_NATS_TOKEN": "t"})
    with pytest.raises(ValueError, match="PERSIA_NATS_TLS_CA='/nope'"):
        NatsAuth.from_env({"PERSIA_NATS_TLS_CA": "/nope"})
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    auth = NatsAuth.from_env({"PERSIA_NATS_TLS_CA": str(ca)})
    assert with_tls_scheme(["nats://h:1", "tls://h:2"], auth) == ["tls://h:1", "tls://h:2"]
    assert with_tls_scheme(["nats://h:1"], NatsAuth()) == ["nats://h:1"]


def test_grpc_tls_from_env_requires_pairs(tmp_path):
    assert not GrpcTls.from_env({}).enabled
    cert = tmp_path / "c.pem"
    cert.write_text("c")
    with pytest.raises(ValueError, match="set together"):
        GrpcTls.from_env({"PERSIA_GRPC_TLS_CERT": str(cert)})
    with pytest.raises(ValueError, match="PERSIA_GRPC_TLS_CA"):
        GrpcTls(cert=b"c", key=b"k").channel_credentials()


def test_bind_address():
    assert bind_address({}) == "0.0.0.0"
    assert bind_address({"PERSIA_BIND_HOST": "127.0.0.1"}) == "127.0.0.1"
    assert bind_address({"PERSIA_BIND_ADDRESS": "10.1.2.3", "PERSIA_BIND_HOST": "127.0.0.1"}) == "10.1.2.3"


def test_signed_subjects():
    assert needs_signature("persia.job.ps.clear.0")
    assert needs_signature("persia.job.ps.dump.3")
    assert needs_signature("persia.job.nn.eos.1")
    assert not needs_signature("persia.job.ps.info")
    assert needs_signature("persia.job.nn.batch.0")
    assert not needs_signature("persia.job.ew.forward.0")
    assert not needs_signature("other.job.ps.clear.0")


def test_signature_accepts_once_and_refuses_forgery_replay_staleness():
    secret = b"k" * 32
    checker = SignatureChecker(secret)
    subj, payload = "persia.j.ps.clear.0", b"payload"
    header = sign(secret, subj, payload, now=1000.0)
    checker.check(subj, payload, header, now=1001.0)
    with pytest.raises(Unauthorized, match="replayed"):
        checker.check(subj, payload, header, now=1002.0)
    fresh = sign(secret, subj, payload, now=1000.0)
    for bad_subj, bad_payload, bad_header, why in [
        (subj, payload, None, "unsigned"),
        (subj, payload, "garbage", "malformed"),
        (subj, payload, sign(b"other", subj, payload, now=1000.0), "bad signature"),
        ("persia.j.ps.clear.1", payload, fresh, "bad signature"),  # another replica
        ("persia.other.ps.clear.0", payload, fresh, "bad signature"),  # another job
        (subj, b"changed", fresh, "bad signature"),
        (subj, payload, sign(secret, subj, payload, now=0.0), "old"),
    ]:
        with pytest.raises(Unauthorized, match=why):
            checker.check(bad_subj, bad_payload, bad_header, now=1001.0)


def test_checkpoint_root(tmp_path, monkeypatch):
    assert checkpoint_root({}) is None
    assert checkpoint_root({}, config_dir="/c") == "/c"
    assert checkpoint_root({"PERSIA_CHECKPOINT_DIR": "/d"}, config_dir="/c") == "/d"
    assert checkpoint_root({"PERSIA_CHECKPOINT_ROOT": "/r", "PERSIA_CHECKPOINT_DIR": "/d"}) == "/r"
    root = tmp_path / "ckpt"
    root.mkdir()
    assert check_under_root(str(root / "a" / "b"), str(root)) == root / "a" / "b"
    for bad in [str(tmp_path / "elsewhere"), str(root / ".." / "x"), "/etc", "hdfs://nn/x", ""]:
        with pytest.raises(ValueError):
            check_under_root(bad, str(root))
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="outside"):
        check_under_root(str(root / "link" / "x"), str(root))


def test_schemas_name_the_field():
    with pytest.raises(M.MessageError, match="'loader' is missing"):
        M.validate(M.EndOfStream, {}, "nn.eos")
    with pytest.raises(M.MessageError, match="'sent'.*'x'"):
        M.validate(M.EndOfStream, {"loader": 0, "loader_size": 1, "sent": "x"}, "nn.eos")
    with pytest.raises(M.MessageError, match="expected a map"):
        M.validate(M.EndOfStream, [1, 2], "nn.eos")
    with pytest.raises(M.MessageError, match="batch_size.*1000000000000"):
        M.validate(M.WorkerLookupDirect, {"batch_size": 10**12, "features": []})
    with pytest.raises(M.MessageError, match="signs"):
        M.validate(M.PsLookup, {"train": True, "tables": [{"dim": 4, "signs": np.zeros(3, np.float32)}]})
    with pytest.raises(M.MessageError, match="more.*Extra inputs"):
        M.validate(M.CheckpointDir, {"dir": "/x", "more": 1})
    ok = {"loader": 0, "loader_size": 1, "sent": 3, "failed": None}
    assert M.validate(M.EndOfStream, ok) is ok


def test_packed_id_features_schema_names_the_field():
    """A data loader's Forward carries the batch's ID features packed (persia.wire.ids); the schema
    refuses other kinds and ranks of its arrays and a list of names past the limit."""
    good = {"names": ["a", "b"], "single": np.array([True, False]), "values": np.zeros(5, np.uint64),
            "offsets": np.array([[0, 1, 3]])}
    msg = {"batch_size": 2, "features": good}
    assert M.validate(M.Forward, msg) is msg
    for field, bad, expect in [
        ("values", np.zeros(5, np.float32), "features.values.*kind 'u'"),
        ("values", np.zeros((5, 1), np.uint64), "features.values.*1-D"),
        ("offsets", np.zeros(3, np.int64), "features.offsets.*2-D"),
        ("single", np.array([1, 0]), "features.single.*kind 'b'"),
        ("names", ["a", ""], "features.names.1"),
        ("names", [f"n{i}" for i in range(M.MAX_ITEMS + 1)], "features.names"),
    ]:
        with pytest.raises(M.MessageError, match=expect):
            M.validate(M.Forward, {"batch_size": 2, "features": dict(good, **{field: bad})}, "ew.forward")
    with pytest.raises(M.MessageError, match="features.*Extra inputs"):
        M.validate(M.Forward, {"batch_size": 2, "features": dict(good, extra=1)}, "ew.forward")
    assert M.validate(M.NoPayload, None) is None


def test_every_nats_handler_in_the_runtime_has_a_schema():
    """A new ``bus.serve``/``subscribe_events`` must name its message model (persia.messages)."""
    import ast
    from pathlib import Path

    import persia

    missing = []
    for path in Path(persia.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("serve", "subscribe_events")
                    and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "rpc")
                    and path.name != "bus.py"
                    and not any(k.arg == "schema" for k in node.keywords)):
                missing.append(f"{path.name}:{node.lineno}")
    assert not missing, f"NATS handlers without schema=: {missing}"


def test_metrics_port_per_process():
    from persia.metrics import metrics_port

    assert metrics_port({}) is None
    assert metrics_port({"PERSIA_METRICS_PORT": "9090"}) == 9090
    assert metrics_port({"PERSIA_METRICS_PORT": "9090", "PERSIA_METRICS_PORT_OFFSET": "3", "LOCAL_RANK": "1"}) == 9094
    assert metrics_port({"PERSIA_METRICS_PORT": "0", "PERSIA_METRICS_PORT_OFFSET": "3"}) == 0


def test_local_plan_gives_every_process_its_own_metrics_offset_and_loopback(tmp_path):
    from types import SimpleNamespace

    from persia.local import plan

    for f in ("nn.py", "dl.py", "emb.yml"):
        (tmp_path / f).write_text("")
    args = SimpleNamespace(num_ps=2, num_embedding_workers=2, nproc_per_node=2, num_data_loaders=2,
                           nn_worker=str(tmp_path / "nn.py"), data_loader=str(tmp_path / "dl.py"),
                           embedding_config=str(tmp_path / "emb.yml"), global_config=None, cores=2,
                           nn_threads=None, job_name="j", env=[])
    procs = plan(args, base_env={"PERSIA_NATS_PASSWORD": "leak", "PERSIA_NATS_URL": "nats://x:1",
                                 "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "REPLICA_INDEX": "3"})
    offsets = [int(p.env["PERSIA_METRICS_PORT_OFFSET"]) for p in procs]
    assert offsets == [0, 1, 2, 3, 4, 6, 7]  # ps, ps, ew, ew, nn (2 ranks), dl, dl
    # the launcher's own shell's ranks reach no role (a LOCAL_RANK would move its metrics port)
    assert not any(k in p.env for p in procs for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))
    assert [p.env.get("REPLICA_INDEX") for p in procs] == ["0", "1", "0", "1", None, None, None]  # servers' own
    assert all(p.env["PERSIA_BIND_ADDRESS"] == "127.0.0.1" for p in procs)
    assert all("PERSIA_NATS_PASSWORD" not in p.env and "PERSIA_NATS_URL" not in p.env for p in procs)
    assert not any("leak" in " ".join(p.argv) for p in procs)
