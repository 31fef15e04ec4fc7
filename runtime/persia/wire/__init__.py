"""Wire formats: a pickle-free codec for trees of numpy arrays (NATS and gRPC payloads)."""
