"""Our system as a benchmark "system": one ``persia-launcher local`` run of the synthetic-CTR
example (every role a process on this machine), its result parsed from the NN worker's
``PERSIA_RESULT {json}`` line.

Assumed launcher contract (what the runtime's local mode provides):
``persia-launcher local --nn-worker train.py --data-loader data_loader.py --embedding-config E.yml
--global-config G.yml --num-ps N --num-embedding-workers N --num-nn-workers 1 --num-data-loaders 1``
passes its environment to every role and exits with the trainer's status.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from bench._paths import EXAMPLE_DIR, REPO_ROOT, child_env
from bench.spec import DEFAULT_HYBRID_STALENESS, RunSpec
from synthetic_ctr.settings import ExampleSettings

LAUNCHER = "persia-launcher"
HYBRID_STALENESS = DEFAULT_HYBRID_STALENESS  # the adult-income example's bound
ADULT_DIR = REPO_ROOT / "examples" / "adult-income"


def find_launcher() -> str | None:
    """The launcher beside this interpreter (the venv's bin) or on PATH."""
    local = Path(sys.executable).parent / LAUNCHER
    if local.is_file():
        return str(local)
    return shutil.which(LAUNCHER)


def launcher_unavailable_reason(timeout_s: float = 60.0) -> str | None:
    """None when ``persia-launcher local --help`` works, else why our system cannot be run yet."""
    exe = find_launcher()
    if exe is None:
        return f"{LAUNCHER} is not installed"
    try:
        proc = subprocess.run(
            [exe, "local", "--help"], capture_output=True, text=True, timeout=timeout_s, env=child_env()
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{LAUNCHER} local --help failed: {e}"
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return f"{LAUNCHER} local --help exited {proc.returncode}: {last[0][:200]}"
    from persia import unique
    from persia.embedding_ps import kernels

    # without them the PS and the embedding worker fall back to numpy (and only log so): figures
    # that are not our system's
    return kernels.unavailable_reason() or unique.unavailable_reason()


def staleness_of(spec: RunSpec) -> int:
    """persia-sync is the synchronous reference: staleness 1 (update before the next lookup)."""
    if not spec.system.startswith("persia"):
        raise ValueError(f"staleness is a setting of our system, not of system={spec.system!r}")
    return spec.effective_staleness


def example_settings(spec: RunSpec) -> ExampleSettings:
    return ExampleSettings(
        data_dir=spec.data_dir,
        mlp=spec.mlp,
        batch_size=spec.batch_size,
        train_rows=spec.train_rows,
        test_rows=spec.test_rows,
        eval_points=spec.eval_points,
        curve_eval_rows=spec.curve_eval_rows,
        seed=spec.seed,
        dense_optimizer=spec.dense_optimizer,
        dense_lr=spec.dense_lr,
        embedding_lr=spec.embedding_lr,
        staleness=staleness_of(spec),
        reproducible=False,
        device=spec.device,
        mixed_precision=spec.mixed_precision,
    )


def launcher_argv(
    launcher: str,
    example_dir: Path,
    num_ps: int,
    num_embedding_workers: int,
    num_nn_workers: int = 1,
    num_data_loaders: int = 1,
    nn_threads: int | str | None = None,
    colocate_ps: bool = False,
    cpu_placement: str = "auto",
) -> list[str]:
    threads = ["--nn-threads", str(nn_threads)] if nn_threads else []
    threads += ["--colocate-ps"] if colocate_ps else []
    threads += [] if cpu_placement == "auto" else ["--cpu-placement", cpu_placement]
    return [
        launcher,
        "local",
        "--nn-worker", str(example_dir / "train.py"),
        "--data-loader", str(example_dir / "data_loader.py"),
        "--embedding-config", str(example_dir / "config" / "embedding_config.yml"),
        "--global-config", str(example_dir / "config" / "global_config.yml"),
        "--num-ps", str(num_ps),
        "--num-embedding-workers", str(num_embedding_workers),
        "--num-nn-workers", str(num_nn_workers),
        "--num-data-loaders", str(num_data_loaders),
        *threads,
    ]  # fmt: skip


def with_role_env(argv: list[str], env: dict[str, str]) -> list[str]:
    """``persia-launcher local``'s argv with ``--env KEY=VALUE`` for every role (pure)."""
    at = argv.index("local") + 1
    return argv[:at] + [word for key, value in env.items() for word in ("--env", f"{key}={value}")] + argv[at:]


def synthetic_command(spec: RunSpec, launcher: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment for one run of our system on the synthetic CTR data."""
    argv = launcher_argv(launcher, EXAMPLE_DIR, spec.num_ps, spec.num_embedding_workers, spec.num_nn_workers,
                         nn_threads=spec.nn_threads, colocate_ps=spec.colocate_ps, cpu_placement=spec.cpu_placement)
    env = example_settings(spec).to_env()
    env["PERSIA_REPLAY_OWN_UPDATES"] = "1" if spec.replay else "0"
    if spec.staleness_warmup_steps is not None:
        env["PERSIA_STALENESS_WARMUP_STEPS"] = str(spec.staleness_warmup_steps)
    return argv, child_env(env)


def adult_income_command(launcher: str) -> tuple[list[str], dict[str, str]] | str:
    """argv/env for the adult-income example, or why it cannot run (its files are not there)."""
    needed = ["train.py", "data_loader.py", "config/embedding_config.yml", "config/global_config.yml"]
    missing = [n for n in needed if not (ADULT_DIR / n).is_file()]
    if missing:
        return f"examples/adult-income lacks {', '.join(missing)}"
    argv = launcher_argv(launcher, ADULT_DIR, 1, 1)
    return argv, child_env({"EMBEDDING_STALENESS": str(HYBRID_STALENESS), "REPRODUCIBLE": "0"})
