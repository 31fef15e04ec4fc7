"""`make serve-demo`: train adult-income, serve the checkpoint, send the whole test set through the
model server over HTTP/JSON and compare the served AUC with the training job's evaluation AUC."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

from adult import ID_SLOTS, read_split  # noqa: E402
from persia.serving.local_stack import InferenceStack, post_json  # noqa: E402
from persia.utils import load_yaml  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "config"


def train(workdir: Path) -> dict:
    """One epoch in local mode; the NN worker dumps the checkpoint (with jit_dense.pt) to workdir/ckpt."""
    result = workdir / "result.json"
    cmd = [sys.executable, "-m", "persia.launcher", "local",
           "--nn-worker", str(HERE / "train.py"), "--data-loader", str(HERE / "data_loader.py"),
           "--embedding-config", str(CONFIG / "embedding_config.yml"),
           "--global-config", str(CONFIG / "global_config.yml"),
           "--result-file", str(result), "--no-progress", "--env", f"PERSIA_CKPT_DIR={workdir / 'ckpt'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return json.loads(result.read_text())


def request_body(split: dict, start: int, end: int) -> dict:
    """What a client sends: IDs as decimal strings (exact above 2^53), dense rows as numbers."""
    return {
        "id_type_features": {slot: [str(v) for v in split["ids"][start:end, j]] for j, slot in enumerate(ID_SLOTS)},
        "non_id_type_features": {"dense": split["dense"][start:end].tolist()},
    }


def serve_and_score(workdir: Path, batch: int = 64, clients: int = 4) -> tuple[float, int]:
    stack = InferenceStack(workdir / "serving", str(CONFIG / "embedding_config.yml"),
                           load_yaml(str(CONFIG / "global_config.yml")), model=str(workdir / "ckpt" / "jit_dense.pt"),
                           checkpoint=str(workdir / "ckpt"))
    try:
        stack.wait_ready()
        split = read_split("test")
        n = split["label"].shape[0]
        starts = list(range(0, n, batch))

        def one(start):
            status, body = post_json(stack.url + "/v1/predict", request_body(split, start, min(start + batch, n)))
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {body}")
            return body["predictions"]

        with ThreadPoolExecutor(clients) as pool:  # concurrent clients: the server batches them
            preds = np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in pool.map(one, starts)])
        return float(roc_auc_score(split["label"].ravel(), preds)), n
    finally:
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", help="keep the checkpoint and logs here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="persia-serve-demo-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        print("training adult-income (one epoch, local mode) ...", flush=True)
        result = train(workdir)
        print(f"serving {workdir / 'ckpt'} ...", flush=True)
        served, n = serve_and_score(workdir)
        print(f"served AUC {served:.6f} (evaluation AUC {result['auc']:.6f}) over {n} test samples")
        if abs(served - result["auc"]) > 1e-6:
            print("served and evaluation AUC differ by more than 1e-6", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
