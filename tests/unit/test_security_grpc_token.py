"""The gRPC job credential (``persia.security.grpc_token``) and the refusal log's pace."""

from __future__ import annotations

import hashlib
import hmac
import logging

from persia import rpc
from persia.security import grpc_token, grpc_token_matches, ref_key


def test_token_is_an_hmac_of_the_secret_and_other_keys_are_not():
    token = grpc_token(b"s3cret")
    assert token == hmac.new(b"s3cret", b"persia grpc v1", hashlib.sha256).hexdigest()
    assert bytes.fromhex(token) != ref_key(b"s3cret")  # one key per use
    assert grpc_token(b"other") != token
    assert grpc_token(None) is None and grpc_token(b"") is None


def test_token_comparison_never_raises():
    token = grpc_token(b"s3cret")
    assert grpc_token_matches(token, token)
    assert grpc_token_matches(token.encode(), token)
    for value in (None, "", token[:-1], token + "0", token.upper(), "\u00e9" * 64, "\udcff" * 64, b"\xff" * 64):
        assert not grpc_token_matches(value, token), value


def test_refusals_are_logged_once_per_interval_with_the_count_between(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(rpc.time, "monotonic", lambda: now[0])
    refusals = rpc._Refusals(1.0)
    caplog.set_level(logging.WARNING, logger="persia.rpc")
    for t in (100.0, 100.2, 100.9, 101.0, 101.5):
        now[0] = t
        refusals.note("persia.X/Y", "ipv4:127.0.0.1:1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "persia.X/Y" in lines[0] and "more refused" not in lines[0]
    assert "2 more refused since the last line" in lines[1]
