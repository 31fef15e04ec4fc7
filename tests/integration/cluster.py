"""In-process PS replicas and embedding workers on loopback, each with its own NATS connection."""

from __future__ import annotations

from contextlib import contextmanager

from persia.bus import NatsBus
from persia.config import load_embedding_config_from_dict, load_global_config_from_dict
from persia.embedding_ps.service import SERVICE as PS_SERVICE
from persia.embedding_ps.service import EmbeddingParameterServer
from persia.embedding_worker.colocated import InProcessPs
from persia.embedding_worker.service import EmbeddingWorker

EMBEDDING_CONFIG = {
    "feature_index_prefix_bit": 8,
    "slots_config": {
        "user": {"dim": 4},
        "item": {"dim": 4, "sqrt_scaling": True},
        "tags": {"dim": 3, "embedding_summation": False, "sample_fixed_size": 3},
    },
}
GLOBAL_CONFIG = {
    "embedding_worker_config": {"forward_buffer_size": 8},
    "embedding_parameter_server_config": {"capacity": 100000, "num_hashmap_internal_shards": 2},
}


@contextmanager
def cluster(num_ps: int = 1, num_workers: int = 1, embedding_config=None, global_config=None,
            colocate_ps: bool = False):
    """``colocate_ps``: embedding worker i calls PS replica i (when there is one) in this process
    instead of over gRPC, as ``embedding-worker --with-ps`` does; the other replicas over gRPC."""
    ec = load_embedding_config_from_dict(embedding_config or EMBEDDING_CONFIG)
    gc = load_global_config_from_dict(global_config or GLOBAL_CONFIG)
    buses, servers = [], []
    try:
        for i in range(num_ps):
            bus = NatsBus(name=f"ps{i}")
            buses.append(bus)
            servers.append(EmbeddingParameterServer(gc, i, num_ps, port=0, bus=bus))
        for i in range(num_workers):
            bus = NatsBus(name=f"ew{i}")
            buses.append(bus)
            ps = servers[i] if colocate_ps and i < num_ps else None
            colocated = None if ps is None else InProcessPs(ps.address, PS_SERVICE, ps.methods)
            servers.append(EmbeddingWorker(ec, gc, i, num_workers, port=0, bus=bus, discovery_deadline_s=20,
                                           colocated_ps=colocated))
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()
        for b in buses:
            b.close()
