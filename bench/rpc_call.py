"""CPU of one call on our gRPC layer (``persia.rpc``) against a plain TCP round trip of the same bytes.

Every batch costs one gRPC call per hop (NN worker -> embedding worker -> PS), and at batch 256
the embedding path's CPU is mostly such per-batch costs (docs/benchmarks.md, session 5). This
measures what a call costs on each end, beside the floor the kernel sets: the same request and
reply bytes over a plain socket (length-prefixed, one thread each end), and one message each way
on a long-lived gRPC bidirectional stream (what a stream per client would cost per batch instead
of a unary call; our layer has no streams). The server runs in its own process; its CPU comes
from ``/proc``.

    python -m bench.rpc_call                          # 100 B, and a PS Step's 200 KB / 300 KB
    python -m bench.rpc_call --sizes 40000:100000 --calls 3000
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

SERVICE = "persia.bench.Echo"


def _proc_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


def _same(b: bytes) -> bytes:
    return b


def serve(reply_bytes: int) -> None:
    """Child process: a gRPC server (our layer) and a plain TCP server, both answering
    ``reply_bytes`` bytes; prints their ports, then serves until killed."""
    from persia import rpc

    import grpc

    reply = b"r" * reply_bytes
    _server, grpc_port = rpc.serve(SERVICE, {"Echo": lambda _req: reply}, port=0, host="127.0.0.1")
    # the same server, a raw bytes stream method: one reply per request, in order
    _server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("persia.bench.Stream", {
        "Echo": grpc.stream_stream_rpc_method_handler(lambda requests, _ctx: (reply for _ in requests),
                                                      request_deserializer=_same, response_serializer=_same)})])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(json.dumps({"grpc": grpc_port, "tcp": listener.getsockname()[1]}), flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = struct.pack("!I", reply_bytes)
    try:
        while True:
            (n,) = struct.unpack("!I", _recv_exact(conn, 4))
            _recv_exact(conn, n)
            conn.sendall(header + reply)
    except ConnectionError:
        return  # the client is done


def measure(request_bytes: int, reply_bytes: int, calls: int) -> dict:
    child = subprocess.Popen([sys.executable, "-m", "bench.rpc_call", "--serve", str(reply_bytes)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        ports = json.loads(child.stdout.readline())
        from persia import rpc

        client = rpc.Client(f"127.0.0.1:{ports['grpc']}", SERVICE)
        request = b"q" * request_bytes
        sock = socket.create_connection(("127.0.0.1", ports["tcp"]))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = struct.pack("!I", request_bytes)

        def grpc_call():
            client.call("Echo", request)

        def tcp_call():
            sock.sendall(header + request)
            (n,) = struct.unpack("!I", _recv_exact(sock, 4))
            _recv_exact(sock, n)

        outgoing: queue.SimpleQueue = queue.SimpleQueue()
        stream = client._channel.stream_stream("/persia.bench.Stream/Echo", request_serializer=_same,
                                               response_deserializer=_same)(iter(outgoing.get, None))

        def stream_call():
            outgoing.put(request)
            if len(next(stream)) != reply_bytes:
                raise AssertionError("short stream reply")

        out = {"request_bytes": request_bytes, "reply_bytes": reply_bytes, "calls": calls}
        for name, call in (("tcp", tcp_call), ("grpc", grpc_call), ("grpc_stream", stream_call)):
            for _ in range(min(200, calls)):  # warm: connections, allocator
                call()
            s0, c0, w0 = _proc_cpu_s(child.pid), time.process_time(), time.perf_counter()
            for _ in range(calls):
                call()
            s1, c1, w1 = _proc_cpu_s(child.pid), time.process_time(), time.perf_counter()
            out[name] = {"server_cpu_us": (s1 - s0) / calls * 1e6, "client_cpu_us": (c1 - c0) / calls * 1e6,
                         "wall_us": (w1 - w0) / calls * 1e6}
        both = {k: out[k]["server_cpu_us"] + out[k]["client_cpu_us"] for k in ("tcp", "grpc", "grpc_stream")}
        out["grpc_over_tcp_cpu"] = both["grpc"] / both["tcp"] if both["tcp"] > 0 else None
        out["stream_over_unary_cpu"] = both["grpc_stream"] / both["grpc"] if both["grpc"] > 0 else None
        outgoing.put(None)
        client.close()
        sock.close()
        return out
    finally:
        child.kill()
        child.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100:100,200000:300000",
                    help="comma-separated REQUEST:REPLY byte counts (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    print(f"{'request':>9} {'reply':>9} | {'tcp server':>10} {'client':>7} | {'gRPC server':>11} {'client':>7} | "
          f"{'stream server':>13} {'client':>7} | {'gRPC / tcp CPU':>14} | {'stream / gRPC':>13}")
    results = []
    for pair in args.sizes.split(","):
        req, rep = (int(x) for x in pair.split(":"))
        r = measure(req, rep, args.calls)
        results.append(r)
        t, g, st = r["tcp"], r["grpc"], r["grpc_stream"]
        print(f"{req:>9,} {rep:>9,} | {t['server_cpu_us']:>8.0f}µs {t['client_cpu_us']:>5.0f}µs | "
              f"{g['server_cpu_us']:>9.0f}µs {g['client_cpu_us']:>5.0f}µs | "
              f"{st['server_cpu_us']:>11.0f}µs {st['client_cpu_us']:>5.0f}µs | "
              f"{r['grpc_over_tcp_cpu']:>14.2f} | {r['stream_over_unary_cpu']:>13.2f}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
