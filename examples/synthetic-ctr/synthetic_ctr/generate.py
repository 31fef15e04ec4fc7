"""Generate a synthetic Criteo-schema dataset as chunked ``.npz`` files plus ``manifest.json``.

Per row: 13 dense floats (``log1p`` of heavy-tailed counts, the usual Criteo preprocessing), one
uint64 ID per categorical slot (Zipf-ranked, mixed over the full uint64 range) and a label drawn
from the hidden teacher. Chunk ``k`` of a split is drawn from its own seed stream, so the output
depends only on the config. Also writes ``vocab.npz`` (sorted distinct training IDs per slot), the
preprocessing artefact table-based baselines (``nn.EmbeddingBag``, TorchRec) need to map IDs to rows.

CLI: ``python -m synthetic_ctr.generate OUT_DIR --train-rows N --test-rows M [--seed S] ...``
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from synthetic_ctr.idmix import ids_for
from synthetic_ctr.manifest import (
    ChunkFile,
    GeneratorConfig,
    Manifest,
    Split,
    TeacherStats,
    load_manifest,
    write_manifest,
)
from synthetic_ctr.metrics import binary_log_loss, rank_auc
from synthetic_ctr.schema import DENSE_NAMES, NUM_DENSE, NUM_SLOTS, SLOT_NAMES, scaled_cardinalities
from synthetic_ctr.teacher import Teacher, build_teacher, calibrate

VOCAB_NAME = "vocab.npz"
_STREAM_TEACHER, _STREAM_CALIBRATION, _STREAM_TRAIN, _STREAM_TEST = 0, 1, 2, 3
_CALIBRATION_ROWS = 65536


def zipf_ranks(rng: np.random.Generator, n: int, cardinality: int, exponent: float) -> np.ndarray:
    """0-based ranks in [0, cardinality) with P(rank) ~ (rank + 1) ** -exponent (a bounded
    continuous power law floored to integers: vectorised inverse CDF, no table)."""
    one_minus = 1.0 - exponent
    top = (cardinality + 1.0) ** one_minus - 1.0
    u = rng.random(n)
    x = np.power(1.0 + u * top, 1.0 / one_minus)
    return np.minimum(x.astype(np.int64) - 1, cardinality - 1)


def _draw_rows(
    rng: np.random.Generator, n: int, cards: tuple[int, ...], exponent: float
) -> tuple[np.ndarray, np.ndarray]:
    """Latent dense values (n, 13) and ranks (n, 26)."""
    latent = rng.standard_normal((n, NUM_DENSE), dtype=np.float32)
    ranks = np.empty((n, NUM_SLOTS), dtype=np.int64)
    for s, card in enumerate(cards):
        ranks[:, s] = zipf_ranks(rng, n, card, exponent)
    return latent, ranks


def observed_dense(latent: np.ndarray) -> np.ndarray:
    """What the student sees: log1p of a rounded count whose log is linear in the latent value."""
    counts = np.rint(np.exp(1.5 * latent + 1.5))
    return np.log1p(counts).astype(np.float32)


def _chunk_rng(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stream, index]))


def make_teacher(cfg: GeneratorConfig) -> Teacher:
    cards = scaled_cardinalities(cfg.scale, cfg.cardinality_floor)
    teacher = build_teacher(cards, _chunk_rng(cfg.seed, _STREAM_TEACHER, 0))
    latent, ranks = _draw_rows(
        _chunk_rng(cfg.seed, _STREAM_CALIBRATION, 0), _CALIBRATION_ROWS, cards, cfg.zipf_exponent
    )
    return calibrate(teacher, teacher.raw_logit(latent, ranks), cfg.teacher_logit_std, cfg.ctr)


def generate_chunk(
    cfg: GeneratorConfig, teacher: Teacher, stream: int, index: int, rows: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One chunk's arrays plus the teacher's click probabilities for those rows."""
    cards = scaled_cardinalities(cfg.scale, cfg.cardinality_floor)
    rng = _chunk_rng(cfg.seed, stream, index)
    latent, ranks = _draw_rows(rng, rows, cards, cfg.zipf_exponent)
    prob = teacher.probability(latent, ranks)
    label = (rng.random(rows, dtype=np.float32) < prob).astype(np.float32).reshape(rows, 1)
    ids = np.empty((rows, NUM_SLOTS), dtype=np.uint64)
    for s in range(NUM_SLOTS):
        ids[:, s] = ids_for(s, ranks[:, s])
    return {"dense": observed_dense(latent), "ids": ids, "label": label}, prob


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    tmp.replace(path)


def generate_dataset(out_dir: str | Path, cfg: GeneratorConfig, *, reuse: bool = True) -> Manifest:
    """Write the dataset under ``out_dir``. With ``reuse``, an existing dataset generated from the
    same config is returned as is (generation is deterministic, so it would be identical)."""
    out = Path(out_dir)
    if reuse and (out / "manifest.json").is_file():
        try:
            existing = load_manifest(out)
            if existing.config == cfg:
                return existing
        except (ValueError, KeyError):
            pass
    started = time.perf_counter()
    if out.exists():
        for sub in ("train", "test"):
            shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    cards = scaled_cardinalities(cfg.scale, cfg.cardinality_floor)
    teacher = make_teacher(cfg)

    splits: dict[str, Split] = {}
    vocab_parts: list[list[np.ndarray]] = [[] for _ in range(NUM_SLOTS)]
    test_auc = test_logloss = float("nan")
    for name, stream, total in (("train", _STREAM_TRAIN, cfg.train_rows), ("test", _STREAM_TEST, cfg.test_rows)):
        (out / name).mkdir(exist_ok=True)
        files: list[ChunkFile] = []
        labels, probs = [], []
        for index in range(math.ceil(total / cfg.chunk_rows)):
            rows = min(cfg.chunk_rows, total - index * cfg.chunk_rows)
            arrays, prob = generate_chunk(cfg, teacher, stream, index, rows)
            rel = f"{name}/part-{index:05d}.npz"
            _write_npz(out / rel, arrays)
            files.append(ChunkFile(path=rel, rows=rows))
            labels.append(arrays["label"][:, 0])
            probs.append(prob)
            if name == "train":
                for s in range(NUM_SLOTS):
                    vocab_parts[s].append(np.unique(arrays["ids"][:, s]))
        y = np.concatenate(labels)
        splits[name] = Split(rows=total, positive_rate=float(y.mean()), files=files)
        if name == "test":
            p = np.clip(np.concatenate(probs).astype(np.float64), 1e-7, 1 - 1e-7)
            test_auc = rank_auc(y, p)
            test_logloss = binary_log_loss(y, p)

    vocab = {SLOT_NAMES[s]: np.unique(np.concatenate(vocab_parts[s])) for s in range(NUM_SLOTS)}
    _write_npz(out / VOCAB_NAME, vocab)
    manifest = Manifest(
        config=cfg,
        dense_names=list(DENSE_NAMES),
        slot_names=list(SLOT_NAMES),
        cardinalities=list(cards),
        splits=splits,
        teacher=TeacherStats(
            test_auc=test_auc,
            test_logloss=test_logloss,
            logit_scale=teacher.logit_scale,
            logit_bias=teacher.logit_bias,
        ),
        vocab_file=VOCAB_NAME,
        vocab_sizes=[int(len(vocab[n])) for n in SLOT_NAMES],
        generation_seconds=round(time.perf_counter() - started, 3),
    )
    write_manifest(out, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--train-rows", type=int, required=True)
    p.add_argument("--test-rows", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-rows", type=int, default=131072)
    p.add_argument("--scale", type=float, default=0.01, help="cardinality scale vs Criteo Kaggle")
    p.add_argument("--zipf-exponent", type=float, default=1.1)
    p.add_argument("--ctr", type=float, default=0.25)
    p.add_argument("--teacher-logit-std", type=float, default=2.0)
    p.add_argument("--force", action="store_true", help="regenerate even if the same config exists")
    a = p.parse_args(argv)
    cfg = GeneratorConfig(
        train_rows=a.train_rows,
        test_rows=a.test_rows,
        seed=a.seed,
        chunk_rows=a.chunk_rows,
        scale=a.scale,
        zipf_exponent=a.zipf_exponent,
        ctr=a.ctr,
        teacher_logit_std=a.teacher_logit_std,
    )
    m = generate_dataset(a.out_dir, cfg, reuse=not a.force)
    print(
        f"wrote {m.splits['train'].rows} train + {m.splits['test'].rows} test rows to {a.out_dir} "
        f"in {m.generation_seconds:.1f}s; teacher test AUC {m.teacher.test_auc:.4f}, "
        f"CTR {m.splits['train'].positive_rate:.3f}, vocab {sum(m.vocab_sizes)} IDs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
