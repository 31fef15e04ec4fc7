"""The NN worker's dense step alone: what one training step costs without any other role.

The same step as ``TrainCtx`` runs on the synthetic-CTR example: the embedding leaf and its
26-slot graph (``persia.nn_worker.embedding_tensors.build``), the model, BCE, backward, the
gradient leaf to numpy, the finiteness checks and fused Adam. Each configuration runs in its own
process, because ``OMP_WAIT_POLICY`` is read when torch loads: one torch thread, two threads
spinning as torch does by default (the baseline's setting), and two threads waiting passively (local
mode's setting, so that idle threads leave the core to the other roles). Ratios are to the
spinning two-thread run of the same invocation.

    python -m bench.dense_step                      # MLP 400-400-400 at batch 256 and 1024
    python -m bench.dense_step --mlp ffnn --batch-size 256 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench import _paths  # noqa: F401  (puts synthetic_ctr on sys.path)

CONFIGS = (("1 thread", 1, None), ("2 threads, spinning", 2, None), ("2 threads, passive", 2, "PASSIVE"))
DISTINCT_ROWS = 3000  # distinct IDs in a batch of 256 of the synthetic data (one leaf of dim 16)


def measure(mlp: str, batch_size: int, steps: int, seed: int = 0) -> dict[str, float]:
    """ms per step of the NN worker's dense step in this process (its torch threads as set)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from persia.nn_worker import embedding_tensors
    from persia.nn_worker.denormals import FlushDenormals
    from persia.nn_worker.train_ctx import _dense_grads, all_finite, finite_step
    from synthetic_ctr.model import CTRTower, parse_hidden
    from synthetic_ctr.schema import NUM_DENSE, NUM_SLOTS

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = CTRTower(parse_hidden(mlp))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    n = 16  # distinct batches, cycled
    tables = [[{"dim": 16, "rows": rng.standard_normal((DISTINCT_ROWS, 16)).astype(np.float32),
                "gather": rng.integers(0, DISTINCT_ROWS, size=(NUM_SLOTS, batch_size)).astype(np.int32)}]
              for _ in range(n)]
    slots = [{"dim": 16, "gather": i} for i in range(NUM_SLOTS)]
    dense = [torch.randn(batch_size, NUM_DENSE) for _ in range(n)]
    labels = [torch.randint(0, 2, (batch_size, 1)).float() for _ in range(n)]

    def step(i: int) -> None:
        st = embedding_tensors.build(tables[i % n], slots, "cpu", True)
        out = model([dense[i % n]], st.emb)
        loss = F.binary_cross_entropy(out, labels[i % n])
        loss.backward()
        for leaf in st.leaves:
            np.isfinite(leaf.grad.numpy()).all()
        finite_step(loss, _dense_grads(opt))  # as TrainCtx: the loss and the dense gradients at once
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 20 == 0:
            all_finite(list(model.parameters()))

    with FlushDenormals({}):  # as the NN worker trains; for this call only (tests call it in-process)
        for i in range(max(3, steps // 10)):
            step(i)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(steps):
            step(i)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"ms_per_step": wall / steps * 1e3, "samples_per_sec": steps * batch_size / wall, "cpu_per_wall": cpu / wall}


def run_config(mlp: str, batch_size: int, steps: int, threads: int, wait_policy: str | None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    env["OMP_NUM_THREADS"] = str(threads)
    code = (f"import json, torch; torch.set_num_threads({threads}); from bench.dense_step import measure; "
            f"print(json.dumps(measure({mlp!r}, {batch_size}, {steps})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def thread_counts(cpus: int | None) -> tuple[int, ...]:
    """The torch thread counts our NN worker's tuner may train on with ``cpus`` CPUs (the
    launcher gives it all of them to start from; ``thread_tuning.candidates_for``), fewest first."""
    from persia.nn_worker.thread_tuning import candidates_for

    return tuple(sorted(candidates_for(max(1, cpus or 1))))


def measure_for_bound(mlp: str, batch_size: int, steps: int, cpus: int | None, repeats: int = 3,
                      runner=run_config) -> dict[str, Any]:
    """The dense step alone at every thread count the NN worker may pick, with local mode's
    passive OpenMP waiting: what bounds our throughput from the critical path's side
    (``bench.summary.dense_bound``). Each count runs ``repeats`` times, the counts' order reversed
    every other time, and keeps its fastest run: this host's speed swings by 15 % and more from
    minute to minute, a slow minute only ever makes a step slower, and a bound must not claim less
    than the dense step can do. ``{"status": "ok", "threads": {"1": {...}, ...}}`` (each with
    ``ms_all``, every run's ms a step), or ``failed`` with the reason."""
    got: dict[str, Any] = {"mlp": mlp, "batch_size": batch_size, "steps": steps, "wait_policy": "PASSIVE",
                           "repeats": repeats}
    counts = thread_counts(cpus)
    runs: dict[str, list[dict[str, float]]] = {str(n): [] for n in counts}
    try:
        for r in range(max(1, repeats)):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                runs[str(n)].append(runner(mlp, batch_size, steps, n, "PASSIVE"))
    except (subprocess.CalledProcessError, ValueError, IndexError) as exc:
        detail = exc.stderr.strip().splitlines()[-1] if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else exc
        return {**got, "status": "failed", "reason": f"dense step not measured: {detail}"}
    got["threads"] = {n: {**min(rs, key=lambda x: x["ms_per_step"]), "ms_all": [x["ms_per_step"] for x in rs]}
                      for n, rs in runs.items()}
    return {**got, "status": "ok"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mlp", default="mlp400")
    p.add_argument("--batch-size", type=int, action="append", help="repeatable (default: 256 and 1024)")
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    print(f"load {os.getloadavg()[0]:.1f}; ratios to '2 threads, spinning' of the same batch size")
    for bs in a.batch_size or [256, 1024]:
        got = {name: run_config(a.mlp, bs, a.steps, threads, policy) for name, threads, policy in CONFIGS}
        ref = got["2 threads, spinning"]["samples_per_sec"]
        for name, r in got.items():
            print(f"{a.mlp} batch {bs:5d} {name:20s} {r['ms_per_step']:8.2f} ms/step {r['samples_per_sec']:9.0f} "
                  f"samples/s  ratio {r['samples_per_sec'] / ref:.2f}  CPU/wall {r['cpu_per_wall']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
