"""bench/rpc_call.py: one call on our gRPC layer against a plain TCP round trip of the same bytes
and one message each way on a gRPC stream, each end's CPU measured (the server in its own process, through /proc)."""

from __future__ import annotations

import socket

import pytest

from bench import rpc_call


def test_both_transports_answer_with_the_bytes_asked_and_their_cpu_is_measured():
    r = rpc_call.measure(request_bytes=1000, reply_bytes=50_000, calls=30)
    assert (r["request_bytes"], r["reply_bytes"], r["calls"]) == (1000, 50_000, 30)
    for transport in ("tcp", "grpc", "grpc_stream"):
        m = r[transport]
        assert m["wall_us"] > 0 and m["client_cpu_us"] > 0, m
        assert m["server_cpu_us"] >= 0, m  # clock ticks: a fast server can read 0 over 30 calls
    assert r["grpc_over_tcp_cpu"] is None or r["grpc_over_tcp_cpu"] > 0
    assert r["stream_over_unary_cpu"] is None or r["stream_over_unary_cpu"] > 0


def test_a_reply_of_the_wrong_size_is_not_taken_for_an_answer():
    """The TCP leg reads exactly the announced bytes: a short read fails instead of timing a partial reply."""
    a, b = socket.socketpair()
    try:
        a.sendall(b"abc")
        a.close()
        with pytest.raises(ConnectionError, match="peer closed"):
            rpc_call._recv_exact(b, 4)
    finally:
        b.close()
