"""`persia-operator render|crd`, the process configuration and how a rejected one is shown."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from operator_testkit import EXAMPLE, REPO, job_body

from persia_operator.cli import main, option_source
from persia_operator.config import OperatorConfig
from persia_operator.crdgen import crd_yaml
from persia_operator.handlers import run_kwargs
from persia_operator.job import PersiaJob
from persia_operator.render import render
from persia_operator.spec import SpecError, parse_spec, validate_job


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_render_prints_the_children_of_the_seed_manifest():
    code, out, err = run_cli("render", "-f", str(EXAMPLE))
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    meta, spec = validate_job(yaml.safe_load(EXAMPLE.read_text()))
    assert docs == render(PersiaJob(metadata=meta, spec=spec))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_render_namespace_override(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_body()))
    code, out, _ = run_cli("render", "-f", str(path), "-n", "team-a")
    assert code == 0
    docs = list(yaml.safe_load_all(out))
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    assert any(e.get("value") == "nats://demo-nats.team-a.svc:4222"
               for d in docs if d["kind"] == "Job" for e in d["spec"]["template"]["spec"]["containers"][0]["env"])  # fmt: skip


def test_render_reports_the_operators_validation_errors(tmp_path):
    body = job_body()
    body["spec"]["nnWorker"]["replicas"] = 0
    body["spec"]["nats"] = {"maxPayload": 10**9}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    code, out, err = run_cli("render", "-f", str(path))
    assert code == 1 and out == ""
    with pytest.raises(SpecError) as expected:
        parse_spec(body["spec"])
    for problem in expected.value.problems:  # the same messages as the operator's InvalidSpec
        assert problem in err
    assert "spec.nnWorker.replicas" in err and "spec.nats.maxPayload" in err


@pytest.mark.parametrize(
    "content, message",
    [("a: [unclosed", "is not valid YAML"), ("", "no PersiaJob found"), ("- 1\n- 2\n", "not a mapping")],
)
def test_render_rejects_unreadable_input(tmp_path, content, message):
    path = tmp_path / "x.yaml"
    path.write_text(content)
    code, _, err = run_cli("render", "-f", str(path))
    assert code == 1 and message in err


def test_render_missing_file():
    code, _, err = run_cli("render", "-f", "does-not-exist.yaml")
    assert code == 2 and "cannot read does-not-exist.yaml" in err


def test_crd_command_prints_the_crd():
    code, out, _ = run_cli("crd")
    assert code == 0 and out == crd_yaml()


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "persia_operator", "render", "-f", str(EXAMPLE)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "adult-income-nn-worker" in result.stdout


def test_config_from_environment():
    config = OperatorConfig.from_env(
        {"WATCH_NAMESPACE": "ml, ads", "PERSIA_OPERATOR_RECONCILE_INTERVAL": "2.5", "PERSIA_OPERATOR_LIVENESS": ""}
    )
    assert config.namespaces == ["ml", "ads"] and not config.clusterwide
    assert config.reconcile_interval == 2.5 and config.liveness is None
    kwargs = run_kwargs(config)
    assert kwargs["namespaces"] == ["ml", "ads"] and kwargs["clusterwide"] is False
    assert kwargs["standalone"] is True and kwargs["liveness_endpoint"] is None
    cluster = OperatorConfig.from_env({})
    assert cluster.clusterwide and run_kwargs(cluster)["clusterwide"] is True
    assert cluster.watch_client_timeout > cluster.watch_server_timeout > 0
    with pytest.raises(ValueError, match="reconcile_interval"):
        OperatorConfig.from_env({"PERSIA_OPERATOR_RECONCILE_INTERVAL": "-1"})


def test_operator_settings():
    import kopf

    from persia_operator import constants as C
    from persia_operator.handlers import apply_settings

    settings = kopf.OperatorSettings()
    apply_settings(settings, OperatorConfig(watch_server_timeout=120, watch_client_timeout=150))
    assert settings.persistence.finalizer == C.FINALIZER == "persia.com/finalizer"
    assert settings.persistence.progress_storage.prefix == "persia.com"
    assert settings.persistence.diffbase_storage.prefix == "persia.com"
    assert (settings.watching.server_timeout, settings.watching.client_timeout) == (120, 150)
    assert settings.watching.connect_timeout and settings.networking.request_timeout
    assert settings.scanning.disabled is True
    assert settings.peering.standalone is True


@pytest.mark.parametrize("env, args, expected", [
    ({"PERSIA_OPERATOR_RENEW_PERIOD": "20"}, ["run"],
     [("error: invalid configuration: renew_period (PERSIA_OPERATOR_RENEW_PERIOD) = 20 must be at most 2/3 of "
       "lease_duration (PERSIA_OPERATOR_LEASE_DURATION) = 15")]),
    ({"PERSIA_OPERATOR_RENEW_PERIOD": "abc", "PERSIA_OPERATOR_METRICS_PORT": "http"}, ["run"],
     ["error: PERSIA_OPERATOR_METRICS_PORT='http': Input should be a valid integer",
      "error: PERSIA_OPERATOR_RENEW_PERIOD='abc': Input should be a valid number"]),
    ({}, ["run", "--interval", "-1"], ["error: --interval=-1.0: Input should be greater than 0"]),
    ({"PERSIA_OPERATOR_RECONCILE_INTERVAL": "0"}, ["release-finalizers"],
     ["error: PERSIA_OPERATOR_RECONCILE_INTERVAL='0': Input should be greater than 0"]),
])  # fmt: skip
def test_a_rejected_configuration_is_one_line_per_problem_and_exit_status_2(monkeypatch, env, args, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, out, err = run_cli(*args)
    lines = err.splitlines()
    assert code == 2 and out == ""
    assert len(lines) == len(expected) and "Traceback" not in err and "pydantic" not in err
    for line, start in zip(sorted(lines), sorted(expected), strict=True):
        assert line.startswith(start), line


def test_a_rejected_configuration_from_the_entry_point_has_no_traceback():
    env = {**os.environ, "PERSIA_OPERATOR_RENEW_PERIOD": "20"}
    result = subprocess.run([sys.executable, "-m", "persia_operator"], capture_output=True, text=True,
                            timeout=60, cwd=REPO, env=env)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: invalid configuration: renew_period (PERSIA_OPERATOR_RENEW_PERIOD) = 20")
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


@pytest.mark.parametrize("field, flags, env, expected", [
    ("renew_period", set(), {}, "PERSIA_OPERATOR_RENEW_PERIOD"),
    ("reconcile_interval", {"reconcile_interval"}, {"PERSIA_OPERATOR_RECONCILE_INTERVAL": "3"}, "--interval"),
    ("namespaces", set(), {"WATCH_NAMESPACE": "a"}, "WATCH_NAMESPACE"),
    ("namespaces", set(), {"PERSIA_OPERATOR_NAMESPACES": "a", "WATCH_NAMESPACE": "b"}, "PERSIA_OPERATOR_NAMESPACES"),
    ("identity", set(), {"HOSTNAME": "pod-1"}, "HOSTNAME"),
    ("lease_namespace", set(), {"PERSIA_OPERATOR_LEASE_NAMESPACE": "ns"}, "PERSIA_OPERATOR_LEASE_NAMESPACE"),
])  # fmt: skip
def test_option_source(field, flags, env, expected):
    assert option_source(field, flags, env) == expected
