"""The small contracts between the pieces: result line, example settings, launcher command."""

from __future__ import annotations

import math

import pytest

from bench.e2e_bench import command_for
from bench.persia_local import example_settings, launcher_argv, staleness_of, synthetic_command
from bench.spec import RunSpec
from synthetic_ctr.results import format_result_line, parse_result_line
from synthetic_ctr.settings import ENV_NAMES, ExampleSettings


def test_result_line_round_trips_and_survives_log_prefixes():
    line = format_result_line({"auc": 0.8, "samples_per_sec": 1234.5, "auc_curve": [{"samples": 10, "auc": math.nan}]})
    out = "noise\n[nn] " + line + "\n[local] done\n"
    got = parse_result_line(out)
    assert got["auc"] == 0.8 and got["samples_per_sec"] == 1234.5
    assert got["auc_curve"][0]["auc"] is None  # NaN is not JSON; it becomes null


def test_last_result_line_wins_and_bad_lines_are_errors():
    out = format_result_line({"auc": 0.1}) + "\n" + format_result_line({"auc": 0.2})
    assert parse_result_line(out)["auc"] == 0.2
    with pytest.raises(ValueError, match="no PERSIA_RESULT"):
        parse_result_line("nothing here")
    with pytest.raises(ValueError, match="malformed"):
        parse_result_line("PERSIA_RESULT {not json")
    with pytest.raises(ValueError, match="JSON object"):
        parse_result_line("PERSIA_RESULT [1, 2]")


def test_settings_round_trip_through_the_environment():
    s = ExampleSettings(data_dir="d", mlp="ffnn", batch_size=512, train_rows=99, staleness=1, reproducible=True, dense_lr=0.5)
    env = s.to_env()
    assert env["EMBEDDING_STALENESS"] == "1" and env["REPRODUCIBLE"] == "1"
    assert "SYNTHETIC_CTR_TEST_ROWS" not in env  # None is left out, so the default applies
    assert ExampleSettings.from_env(env) == s


def test_settings_errors_name_the_variable():
    with pytest.raises(ValueError, match="SYNTHETIC_CTR_DATA"):
        ExampleSettings.from_env({})
    with pytest.raises(ValueError, match="SYNTHETIC_CTR_BATCH_SIZE='0'"):
        ExampleSettings.from_env({ENV_NAMES["data_dir"]: "d", ENV_NAMES["batch_size"]: "0"})
    with pytest.raises(ValueError, match="EMBEDDING_STALENESS='soon'"):
        ExampleSettings.from_env({ENV_NAMES["data_dir"]: "d", "EMBEDDING_STALENESS": "soon"})


def test_sync_reference_runs_at_staleness_one_and_hybrid_at_ten_by_default():
    sync = RunSpec(system="persia-sync", data_dir="d", staleness=7)
    hybrid = RunSpec(system="persia-hybrid", data_dir="d")
    assert staleness_of(sync) == 1 and staleness_of(hybrid) == 10
    assert staleness_of(RunSpec(system="persia-hybrid", data_dir="d", staleness=4)) == 4
    assert example_settings(sync).staleness == 1


def test_launcher_command_follows_the_local_mode_contract():
    spec = RunSpec(system="persia-hybrid", data_dir="/data/x", num_ps=2, num_embedding_workers=2, seed=2, mlp="ffnn")
    argv, env = synthetic_command(spec, "persia-launcher")
    assert argv[:2] == ["persia-launcher", "local"]
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert flags["--num-ps"] == "2" and flags["--num-embedding-workers"] == "2"
    assert flags["--num-nn-workers"] == "1" and flags["--num-data-loaders"] == "1"
    assert flags["--nn-worker"].endswith("train.py") and flags["--data-loader"].endswith("data_loader.py")
    assert flags["--embedding-config"].endswith("embedding_config.yml")
    assert env["SYNTHETIC_CTR_DATA"] == "/data/x" and env["SYNTHETIC_CTR_SEED"] == "2"
    assert env["SYNTHETIC_CTR_MLP"] == "ffnn" and env["EMBEDDING_STALENESS"] == "10"
    assert launcher_argv("L", __import__("pathlib").Path("ex"), 1, 1)[-1] == "1"


def test_baselines_run_as_python_modules_and_persia_needs_the_launcher():
    argv, _ = command_for(RunSpec(system="torch", data_dir="d"), None)
    assert argv[1:3] == ["-m", "bench.torch_baseline"]
    assert RunSpec.model_validate_json(argv[-1]).system == "torch"
    with pytest.raises(ValueError, match="persia-launcher"):
        command_for(RunSpec(system="persia-sync", data_dir="d"), None)


def test_run_spec_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="batch_size"):
        RunSpec(system="torch", data_dir="d", batch_size=70000)
    with pytest.raises(ValueError, match="system"):
        RunSpec(system="tensorflow", data_dir="d")


def test_unusable_launcher_is_reported_with_its_error(tmp_path, monkeypatch):
    import bench.persia_local as persia_local

    fake = tmp_path / "persia-launcher"
    fake.write_text("#!/bin/sh\necho 'local: no such subcommand' >&2\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setattr(persia_local, "find_launcher", lambda: str(fake))
    assert persia_local.launcher_unavailable_reason() == "persia-launcher local --help exited 2: local: no such subcommand"
    monkeypatch.setattr(persia_local, "find_launcher", lambda: None)
    assert persia_local.launcher_unavailable_reason() == "persia-launcher is not installed"


@pytest.fixture
def working_launcher(tmp_path, monkeypatch):
    """``bench.persia_local`` with a launcher that answers ``local --help``."""
    import bench.persia_local as persia_local

    fine = tmp_path / "persia-launcher"
    fine.write_text("#!/bin/sh\nexit 0\n")
    fine.chmod(0o755)
    monkeypatch.setattr(persia_local, "find_launcher", lambda: str(fine))
    assert persia_local.launcher_unavailable_reason() is None  # the kernels built here are current
    return persia_local


def test_a_stale_ps_kernel_stops_our_runs_naming_it(working_launcher, monkeypatch):
    # the PS would fall back to numpy, logging it only: figures that are not our system's
    from persia.embedding_ps import kernels

    persia_local = working_launcher
    monkeypatch.setattr(kernels, "_kernels", None)
    monkeypatch.setattr(kernels, "_STALE", kernels.stale_reason(type("Old", (), {})()))
    assert "interface 1, this code needs" in persia_local.launcher_unavailable_reason()
    monkeypatch.setattr(kernels, "_STALE", None)
    assert "is not built" in persia_local.launcher_unavailable_reason()


def test_an_unbuilt_dedup_kernel_stops_our_runs_naming_it(working_launcher, monkeypatch):
    # the embedding worker would dedup with numpy, as it does in a source tree without a build
    from persia import unique

    monkeypatch.setattr(unique, "_unique", None)
    assert "persia._unique is not built" in working_launcher.launcher_unavailable_reason()


def test_labels_name_the_staleness_bound_and_thread_setting():
    assert RunSpec(system="persia-hybrid", data_dir="d").label == "persia-hybrid st=10 ps=1 ew=1"
    assert RunSpec(system="persia-hybrid", data_dir="d", staleness=2, nn_threads=2).label == "persia-hybrid st=2 ps=1 ew=1 nn-threads=2"
    assert RunSpec(system="persia-sync", data_dir="d", num_ps=2, num_embedding_workers=2).label == "persia-sync ps=2 ew=2"
    assert RunSpec(system="torch", data_dir="d", threads=1).label == "torch threads=1"
    with pytest.raises(ValueError, match="not of system='torch'"):
        staleness_of(RunSpec(system="torch", data_dir="d"))


def test_nn_threads_reach_the_launcher_only_when_set():
    argv, _ = synthetic_command(RunSpec(system="persia-hybrid", data_dir="d", nn_threads=2), "persia-launcher")
    assert argv[argv.index("--nn-threads") + 1] == "2"
    argv, _ = synthetic_command(RunSpec(system="persia-hybrid", data_dir="d"), "persia-launcher")
    assert "--nn-threads" not in argv  # the launcher's own thread budget
    with pytest.raises(ValueError, match="nn_threads"):
        RunSpec(system="persia-hybrid", data_dir="d", nn_threads=0)


def test_cpu_placement_is_the_launchers_default_and_off_is_passed_and_labelled():
    spec = RunSpec(system="persia-hybrid", data_dir="d")
    argv, _ = synthetic_command(spec, "persia-launcher")
    assert "--cpu-placement" not in argv and "placement" not in spec.label
    off = RunSpec(system="persia-hybrid", data_dir="d", cpu_placement="off")
    argv, _ = synthetic_command(off, "persia-launcher")
    assert argv[argv.index("--cpu-placement") + 1] == "off"
    assert off.label == spec.label + " placement=off"
    with pytest.raises(ValueError, match="cpu_placement"):
        RunSpec(system="persia-hybrid", data_dir="d", cpu_placement="on")


def test_the_example_data_loader_imports_no_torch():
    """Its settings and batches are torch-free, so each data loader process skips torch's import
    (about 1.8 s of start-up on 2 cores) and its memory."""
    import subprocess
    import sys
    import textwrap

    from bench._paths import EXAMPLE_DIR, child_env

    code = textwrap.dedent("""
        import runpy, sys
        runpy.run_path(sys.argv[1], run_name="not_main")  # the script's imports, not its stream
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:3]
        print("ok")
    """)
    got = subprocess.run([sys.executable, "-c", code, str(EXAMPLE_DIR / "data_loader.py")], env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-2000:]
