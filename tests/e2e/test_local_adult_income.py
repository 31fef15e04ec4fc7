"""The main job end to end: `persia-launcher local` on the bundled adult-income data, every role a
real process (nats-server, PS, embedding workers, NN workers with DDP/gloo, data loaders)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from persia.nn_worker.cpu_placement import format_cpus

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "adult-income"


def run_local(tmp_path, *flags: str, env_extra: list[str] = ()) -> tuple[dict, str]:
    result_file = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "persia.launcher", "local",
        "--nn-worker", str(EXAMPLE / "train.py"),
        "--data-loader", str(EXAMPLE / "data_loader.py"),
        "--embedding-config", str(EXAMPLE / "config" / "embedding_config.yml"),
        "--global-config", str(EXAMPLE / "config" / "global_config.yml"),
        "--result-file", str(result_file), "--no-progress", *flags,
    ]
    for kv in env_extra:
        cmd += ["--env", kv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return json.loads(result_file.read_text()), proc.stdout


def test_adult_income_reaches_persia_auc(tmp_path):
    result, out = run_local(tmp_path, env_extra=[f"PERSIA_CKPT_DIR={tmp_path / 'ckpt'}"])
    # issue 5's target (PERSIA published 0.8928); one epoch gives ~0.915 with the bucketised slots
    assert result["auc"] >= 0.90, result
    assert result["train_samples"] == 32561 and result["train_steps"] == 255  # one epoch of batch 128
    assert "[ps-0]" in out and "[ew-0]" in out and "[nn]" in out
    assert (tmp_path / "ckpt" / "embedding_dump_done").exists()
    assert (tmp_path / "ckpt" / "jit_dense.pt").exists()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # --cpu-placement auto: the NN worker started on the other CPUs and moved out
        rest = format_cpus(cpus[1:])
        assert f"rank 0 on CPU {cpus[0]}" in out
        assert (f"training thread on CPU {cpus[0]}, other threads on CPUs {rest} "
                f"(the process started on CPUs {rest})") in out, out[-3000:]


def test_adult_income_with_two_of_every_role(tmp_path):
    result, out = run_local(tmp_path, "--num-ps", "2", "--num-embedding-workers", "2",
                            "--nproc-per-node", "2", "--num-data-loaders", "2")
    assert result["world_size"] == 2
    assert result["auc"] >= 0.90, result
    if len(os.sched_getaffinity(0)) == 2:  # no CPU left for the other roles: nothing placed
        assert "CPU placement: not placed: 2 CPU(s) for 2 NN rank(s)" in out
    # 255 batches over 2 ranks: rank 0 trains 127 or 128 of them (uneven tails are cut so DDP stays in step)
    assert result["train_steps"] in (127, 128)


def test_adult_income_with_each_ps_inside_its_embedding_worker(tmp_path):
    # --colocate-ps: two processes, each an embedding worker calling its own PS replica directly
    # and the other one over gRPC (persia.embedding_worker.colocated); the NN workers' configure,
    # optimizer and checkpoint requests reach both replicas over NATS as before
    result, out = run_local(tmp_path, "--colocate-ps", "--num-ps", "2", "--num-embedding-workers", "2",
                            env_extra=[f"PERSIA_CKPT_DIR={tmp_path / 'ckpt'}"])
    assert result["auc"] >= 0.90, result
    assert result["train_samples"] == 32561 and result["train_steps"] == 255
    assert "[ew-ps-0]" in out and "[ew-ps-1]" in out and "[ps-0]" not in out
    assert out.count("2 PS replicas, ") == 2 and "in this process" in out
    assert (tmp_path / "ckpt" / "embedding_dump_done").exists()


def test_a_failing_role_fails_the_run(tmp_path):
    bad = tmp_path / "bad_loader.py"
    bad.write_text("raise SystemExit(3)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "persia.launcher", "local", "--nn-worker", str(EXAMPLE / "train.py"),
         "--data-loader", str(bad), "--embedding-config", str(EXAMPLE / "config" / "embedding_config.yml"),
         "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert "dl-0 exit code 3: not restarted" in proc.stdout


def test_ctrl_c_tears_every_role_down(tmp_path):
    import os
    import re
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "persia.launcher", "local", "--nn-worker", str(EXAMPLE / "train.py"),
         "--data-loader", str(EXAMPLE / "data_loader.py"),
         "--embedding-config", str(EXAMPLE / "config" / "embedding_config.yml"),
         "--global-config", str(EXAMPLE / "config" / "global_config.yml"), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    pids, lines = [], []
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # wait until training is under way
        lines.append(line)
        m = re.search(r"started (\S+) \(pid (\d+)\)", line)
        if m:
            pids.append(int(m.group(2)))
        if "batch 0 loss" in line or time.monotonic() > deadline:
            break
    assert len(pids) == 4, "".join(lines)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(lines) + rest
    assert "SIGINT: stopping every role" in rest
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie is not a running process; anything else is a leak
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split()[2] == "Z", f"role pid {pid} still running"


def test_several_epochs_with_evaluation_between(tmp_path):
    # a DataCtx per epoch in the loader, a StreamingDataset(until="epoch") per epoch in the trainer
    result, out = run_local(tmp_path, env_extra=["EPOCHS=2"])
    assert result["batches_sent"] == result["batches_trained"] == result["train_steps"] == 510
    assert result["batches_failed"] == {}
    assert len(result["epoch_aucs"]) == 2 and result["auc"] >= 0.90
    assert "every acknowledged batch accounted for" in out


def test_persia_style_epochs_train_every_batch(tmp_path):
    # PERSIA's users: a DataCtx per epoch in the loader, ONE DataLoader in the trainer. Every epoch
    # is trained (the stream ends when the loader process does), not just the first.
    loader = tmp_path / "two_epochs.py"
    loader.write_text(
        "import os, runpy\nos.environ['EPOCHS'] = '2'\n"
        f"runpy.run_path({str(EXAMPLE / 'data_loader.py')!r}, run_name='__main__')\n")
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "persia.launcher", "local", "--nn-worker", str(EXAMPLE / "train.py"),
         "--data-loader", str(loader), "--embedding-config", str(EXAMPLE / "config" / "embedding_config.yml"),
         "--global-config", str(EXAMPLE / "config" / "global_config.yml"), "--no-progress",
         "--result-file", str(result_file)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads(result_file.read_text())
    assert result["train_steps"] == result["batches_trained"] == 510, result
