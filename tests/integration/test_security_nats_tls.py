"""NATS with the other credential kinds of the contract, on a real nats-server: mutual TLS
(``PERSIA_NATS_TLS_*``) and an nkey seed file (``PERSIA_NATS_CREDS``)."""

from __future__ import annotations

import os

import pytest

from persia.bus import NatsBus
from persia.nats_server import NatsServer
from persia.security import NatsAuth

from .certs import certs  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _round_trip(url: str, auth: NatsAuth) -> None:
    bus = NatsBus(url, name="tls-client", auth=auth, secret=b"")
    try:
        bus.serve("persia.tls.echo", lambda m: m, blocking=False)
        assert bus.request("persia.tls.echo", {"x": 1}) == {"x": 1}
    finally:
        bus.close()


def test_nats_mutual_tls(certs):
    tls = (f'tls {{\n  cert_file: "{certs / "server.pem"}"\n  key_file: "{certs / "server.key"}"\n'
           f'  ca_file: "{certs / "ca.pem"}"\n  verify: true\n}}\n')
    with NatsServer(extra_config=tls) as server:
        creds = {"PERSIA_NATS_USER": server.user, "PERSIA_NATS_PASSWORD": server.password}
        _round_trip(server.url, NatsAuth.from_env(dict(
            creds, PERSIA_NATS_TLS_CA=str(certs / "ca.pem"), PERSIA_NATS_TLS_CERT=str(certs / "client.pem"),
            PERSIA_NATS_TLS_KEY=str(certs / "client.key"))))
        for env in (creds,  # plaintext
                    dict(creds, PERSIA_NATS_TLS_CA=str(certs / "ca.pem"))):  # no client certificate
            with pytest.raises(ConnectionError):
                NatsBus(server.url, name="no-tls", auth=NatsAuth.from_env(env), secret=b"")


def test_nats_nkey_seed_file(tmp_path):
    nkeys = pytest.importorskip("nkeys")
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    (tmp_path / "user.nk").write_bytes(seed)
    users = f'authorization {{\n  users = [ {{ nkey: "{public}" }} ]\n}}\n'
    with NatsServer(auth=False, extra_config=users) as server:
        _round_trip(server.url, NatsAuth.from_env({"PERSIA_NATS_CREDS": str(tmp_path / "user.nk")}))
        with pytest.raises(ConnectionError):
            NatsBus(server.url, name="anonymous", auth=NatsAuth(), secret=b"")
