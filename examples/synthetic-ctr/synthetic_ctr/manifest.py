"""The dataset manifest (``manifest.json``): how it was generated, where the chunks are, and the
teacher's AUC on the test split (the upper bound a student can approach)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

MANIFEST_NAME = "manifest.json"
FORMAT = "synthetic-ctr/v1"


class GeneratorConfig(BaseModel):
    """Everything that determines the data; equal configs give byte-identical chunks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    train_rows: int = Field(ge=1)
    test_rows: int = Field(ge=1)
    seed: int = Field(default=0, ge=0)
    chunk_rows: int = Field(default=131072, ge=1)
    scale: float = Field(default=0.01, gt=0.0, le=1.0)
    cardinality_floor: int = Field(default=1000, ge=1)
    zipf_exponent: float = Field(default=1.1, gt=1.0, le=4.0)
    ctr: float = Field(default=0.25, gt=0.0, lt=1.0)
    teacher_logit_std: float = Field(default=2.0, gt=0.0)


class ChunkFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    rows: int = Field(ge=1)


class Split(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rows: int = Field(ge=0)
    positive_rate: float
    files: list[ChunkFile]

    @model_validator(mode="after")
    def _rows_add_up(self) -> Split:
        total = sum(f.rows for f in self.files)
        if total != self.rows:
            raise ValueError(f"split rows={self.rows} but its files hold {total} rows")
        return self


class TeacherStats(BaseModel):
    model_config = ConfigDict(extra="forbid")

    test_auc: float
    test_logloss: float
    logit_scale: float
    logit_bias: float


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = FORMAT
    config: GeneratorConfig
    dense_names: list[str]
    slot_names: list[str]
    cardinalities: list[int]
    splits: dict[str, Split]
    teacher: TeacherStats
    vocab_file: str
    vocab_sizes: list[int]
    generation_seconds: float

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise KeyError(f"split={name!r} not in manifest (has {sorted(self.splits)})")
        return self.splits[name]


def load_manifest(data_dir: str | Path) -> Manifest:
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST_NAME} in data_dir={str(data_dir)!r}")
    manifest = Manifest.model_validate(json.loads(path.read_text()))
    if manifest.format != FORMAT:
        raise ValueError(f"manifest format={manifest.format!r}, expected {FORMAT!r}")
    return manifest


def write_manifest(data_dir: str | Path, manifest: Manifest) -> None:
    path = Path(data_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n")
    tmp.replace(path)
