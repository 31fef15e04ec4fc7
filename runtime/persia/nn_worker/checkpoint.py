"""Embedding checkpoints seen from the NN worker: every PS dumps/loads its own shard files; a
top-level marker says a dump is whole. The dense model and optimizer are saved beside it."""

from __future__ import annotations

import datetime as _dt
import json
import os
import threading
from pathlib import Path

import torch

EMBEDDING_DUMP_DONE = "embedding_dump_done"
CHECKPOINT_FORMAT = "persia-k8s-checkpoint/1"


class EmbeddingCheckpoints:
    """Checkpoint methods of ``EmbeddingCtx`` (needs ``_ps_all``, ``model``, ``device``)."""

    @staticmethod
    def _local_dir(path: str | os.PathLike) -> Path:
        s = str(path)
        if "://" in s and not s.startswith("file://"):
            raise ValueError(f"checkpoint directory {s!r}: only local paths are supported (no hdfs:// yet)")
        return Path(s.removeprefix("file://"))

    def _wait_for_updates(self) -> None:
        pass

    def dump_embedding(self, dst_dir: str, blocking: bool = True) -> None:
        """Every PS writes its own shard files; then a top-level done marker says the dump is whole."""
        directory = self._local_dir(dst_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self._wait_for_updates()

        def run():
            marker = directory / EMBEDDING_DUMP_DONE
            marker.unlink(missing_ok=True)
            results = self._ps_all("dump", {"dir": str(directory.resolve())})
            marker.write_text(json.dumps({
                "format": CHECKPOINT_FORMAT,
                "num_shards": len(results),
                "rows": [r["rows"] for r in results],
                "datetime": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            }))

        self._run_maybe_async(run, blocking, "dump")

    def load_embedding(self, src_dir: str, blocking: bool = True) -> None:
        directory = self._local_dir(src_dir)
        marker = directory / EMBEDDING_DUMP_DONE
        if not marker.exists():
            raise FileNotFoundError(
                f"{directory}: no {EMBEDDING_DUMP_DONE} marker: not an embedding checkpoint, or its dump did not finish"
            )

        def run():
            self._ps_all("load", {"dir": str(directory.resolve())})

        self._run_maybe_async(run, blocking, "load")

    def _run_maybe_async(self, fn, blocking: bool, kind: str) -> None:
        if blocking:
            fn()
            return

        def wrapper():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait_for_*
                setattr(self, f"_{kind}_error", exc)

        t = threading.Thread(target=wrapper, name=f"persia-{kind}", daemon=True)
        setattr(self, f"_{kind}_thread", t)
        setattr(self, f"_{kind}_error", None)
        t.start()

    def _wait_kind(self, kind: str) -> None:
        t = getattr(self, f"_{kind}_thread")
        if t is not None:
            t.join()
        err = getattr(self, f"_{kind}_error")
        setattr(self, f"_{kind}_error", None)
        if err is not None:
            raise err

    def wait_for_dump_embedding(self) -> None:
        self._wait_kind("dump")

    def wait_for_load_embedding(self) -> None:
        self._wait_kind("load")

    def _dense_module(self) -> torch.nn.Module:
        m = self.model
        return m.module if isinstance(m, torch.nn.parallel.DistributedDataParallel) else m

    def dump_checkpoint(self, dst_dir: str, dense_filename: str = "dense.pt",
                        jit_dense_filename: str = "jit_dense.pt", blocking: bool = True,
                        with_jit_model: bool = False) -> None:
        directory = self._local_dir(dst_dir)
        directory.mkdir(parents=True, exist_ok=True)
        if self.model is not None:
            dense = self._dense_module()
            torch.save(dense.state_dict(), directory / dense_filename)
            if with_jit_model:
                torch.jit.save(torch.jit.script(dense), str(directory / jit_dense_filename))
        self.dump_embedding(str(directory), blocking)

    def load_checkpoint(self, src_dir: str, map_location: str | None = None,
                        dense_filename: str = "dense.pt", blocking: bool = True) -> None:
        directory = self._local_dir(src_dir)
        dense_path = directory / dense_filename
        if self.model is not None and dense_path.exists():
            state = torch.load(dense_path, map_location=map_location or self.device, weights_only=True)
            self._dense_module().load_state_dict(state)
        self.load_embedding(str(directory), blocking)

    def dump_torch_state_dict(self, torch_instance, dst_dir: str, file_name: str, is_jit: bool = False) -> None:
        """PERSIA's: ``dst_dir/file_name`` gets the module's (or optimizer's) state dict, or with
        ``is_jit`` the module as TorchScript. Written under a temporary name, then renamed."""
        directory = self._local_dir(dst_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / file_name
        tmp = directory / f".{file_name}.tmp"
        if is_jit:
            scripted = torch_instance if isinstance(torch_instance, torch.jit.ScriptModule) else torch.jit.script(torch_instance)
            torch.jit.save(scripted, str(tmp))
        else:
            torch.save(torch_instance.state_dict(), tmp)
        os.replace(tmp, path)

    def load_torch_state_dict(self, torch_instance, src_dir: str, map_location: str | None = None) -> None:
        """PERSIA's: ``src_dir`` is the file ``dump_torch_state_dict`` wrote (tensors only: no
        pickled code is loaded)."""
        state = torch.load(self._local_dir(src_dir), map_location=map_location or self.device, weights_only=True)
        torch_instance.load_state_dict(state)
