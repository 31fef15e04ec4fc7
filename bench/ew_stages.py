"""CPU per batch of the embedding path's in-process stages (issue 15 item 3), on real batches of
the synthetic CTR data: what the embedding worker does per batch apart from its RPCs (decoding and
checking the data loader's packed IDs, prepare,
reply, gradient checks and split by PS replica, the codec both ways) and what the NN worker does
for the embedding part (tensors from the reply, backward through them, gradient copies).

    python bench/ew_stages.py DATA_DIR [--batch 256] [--batches 200]

DATA_DIR: a generated synthetic CTR dataset (``make bench`` leaves one under bench/results/data).
The PS is replaced by random rows (its cost is not part of these stages); the "model" is
``sum(emb_i * w_i)`` so that backward reaches every slot. Thread CPU time, one torch thread,
median of ``--repeats`` passes over the batches; the load of the machine changes the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from bench._paths import EXAMPLE_DIR, ensure_example_importable
from persia.config import load_embedding_config
from persia.embedding_worker import pipeline
from persia.embedding_worker.service import slot_specs
from persia.nn_worker import embedding_tensors
from persia import messages as M
from persia.messages import validate
from persia.wire import ids
from persia.wire.codec import decode, encode

STAGES = ["ew_decode_check_ids", "ew_prepare", "ew_reply", "ew_encode_reply", "nn_decode_reply", "nn_tensors", "nn_backward",
          "nn_copy_grads", "nn_encode_update", "ew_decode_update", "ew_check_grads", "ew_split_encode_ps"]


def load_batches(data_dir: str, batch: int, count: int, names: list[str]) -> list[bytes]:
    """Each batch's ID features as the data loader sends them (one packed record, one ID per
    sample per slot), encoded."""
    ensure_example_importable()
    from synthetic_ctr.reader import read_chunks

    return [encode({"batch_size": batch, "features": ids.pack(names, [np.ascontiguousarray(b.ids[:, s])
                                                                       for s in range(len(names))],
                                                               [None] * len(names), batch)})
            for b in read_chunks(data_dir, batch, max_rows=batch * count, drop_last=True)]


def one_pass(batches, slots, prefix_bit, weights) -> tuple[dict[str, float], dict[str, float]]:
    t = dict.fromkeys(STAGES, 0.0)
    size = {"reply_kb": 0.0, "update_kb": 0.0}
    rng = np.random.default_rng(0)
    stand_in_rows = []  # what the PS would answer (not a stage of ours), drawn before the clock runs
    for fwd in batches:
        req = decode(fwd)
        tables = pipeline.prepare(req["features"], req["batch_size"], slots, prefix_bit).tables
        stand_in_rows.append({d: rng.standard_normal((s.size, d)).astype(np.float32) for d, s in tables.items()})
    for n, fwd in enumerate(batches):
        clock = [time.thread_time()]
        req = decode(fwd)  # the data loader's message: codec, schema, checks (on_forward)
        validate(M.Forward, req, "ew.forward")
        pipeline.validate_features(req["features"], req["batch_size"], slots)
        clock.append(time.thread_time())
        prepared = pipeline.prepare(req["features"], req["batch_size"], slots, prefix_bit, checked=True)
        rows = stand_in_rows[n]
        clock.append(time.thread_time())
        reply = pipeline.lookup_reply(prepared, rows)
        clock.append(time.thread_time())
        buf = encode({"m": reply})
        clock.append(time.thread_time())
        resp = decode(buf)["m"]
        clock.append(time.thread_time())
        built = embedding_tensors.build(resp["tables"], resp["slots"], "cpu", True)
        clock.append(time.thread_time())
        sum((e * w).sum() for e, w in zip(built.emb, weights)).backward()
        clock.append(time.thread_time())
        grads = []
        for leaf in built.leaves:
            g = leaf.grad.detach().to("cpu", torch.float32).numpy()
            bool(np.isfinite(g).all())
            grads.append(g)
        clock.append(time.thread_time())
        ubuf = encode({"m": {"ref": 1, "grads": grads, "scale": 1.0,
                             "unused_slots": [i for i, u in enumerate(built.used) if not u]}})
        clock.append(time.thread_time())
        req = decode(ubuf)["m"]
        clock.append(time.thread_time())
        checked = pipeline.check_gradients(prepared, req["grads"], req["scale"], req["unused_slots"])
        clock.append(time.thread_time())
        parts = pipeline.split_gradients(prepared.tables, pipeline.split_by_shard(prepared.tables, 1), checked)
        encode({"m": {"tables": parts[0]}})
        clock.append(time.thread_time())
        for k, a, b in zip(STAGES, clock, clock[1:]):
            t[k] += (b - a) * 1e3 / len(batches)
        size["reply_kb"] += len(buf) / 1024 / len(batches)
        size["update_kb"] += len(ubuf) / 1024 / len(batches)
    return t, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_dir")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_embedding_config(EXAMPLE_DIR / "config" / "embedding_config.yml")
    slots = slot_specs(cfg)
    batches = load_batches(a.data_dir, a.batch, a.batches, list(slots))
    weights = [torch.randn(a.batch, s.dim) for s in slots.values()]
    one_pass(batches[:10], slots, cfg.feature_index_prefix_bit, weights)  # warm-up
    runs = [one_pass(batches, slots, cfg.feature_index_prefix_bit, weights) for _ in range(a.repeats)]
    for k in STAGES:
        print(f"{k:20s} {statistics.median(r[0][k] for r in runs):7.3f} ms/batch")
    ew = [sum(v for k, v in r[0].items() if k.startswith("ew_")) for r in runs]
    nn = [sum(v for k, v in r[0].items() if k.startswith("nn_")) for r in runs]
    print(f"{'embedding worker':20s} {statistics.median(ew):7.3f} ms/batch")
    print(f"{'NN worker':20s} {statistics.median(nn):7.3f} ms/batch")
    print(f"reply {runs[0][1]['reply_kb']:.1f} KB, update {runs[0][1]['update_kb']:.1f} KB per batch")


if __name__ == "__main__":
    main()
