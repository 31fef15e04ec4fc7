"""Role metrics' labels and ``metrics_config``: which name tells jobs apart (``persia_job``), what
persia-launcher passes on to the roles it starts, and families shared within a process."""

from __future__ import annotations

import subprocess
import sys

from persia.config import MetricsConfig
from persia.metrics import JOB_LABEL, JOB_NAME_ENV, configure_from, job_label
from tests.serving.test_metrics_catalog import sample


def test_the_job_label_is_not_job_which_prometheus_overwrites():
    assert JOB_LABEL == "persia_job"


def test_the_job_name_of_the_operator_wins_over_the_config():
    assert job_label({"PERSIA_JOB_NAME": "ctr-1", JOB_NAME_ENV: "from_config"}) == "ctr-1"
    assert job_label({JOB_NAME_ENV: "from_config"}) == "from_config"
    assert job_label({"PERSIA_JOB_NAME": "", JOB_NAME_ENV: "from_config"}) == "from_config"
    assert job_label({}) == "persia_default_jobname"  # PERSIA's default for metrics_config.job_name


def test_enable_metrics_sets_the_port_unless_one_is_set():
    env: dict[str, str] = {}
    configure_from(MetricsConfig(enable_metrics=True, job_name="j"), env)
    assert env == {"PERSIA_METRICS_PORT": "9090", JOB_NAME_ENV: "j"}
    env = {"PERSIA_METRICS_PORT": "7000", JOB_NAME_ENV: "set_before"}
    configure_from(MetricsConfig(enable_metrics=True, job_name="j"), env)
    assert env == {"PERSIA_METRICS_PORT": "7000", JOB_NAME_ENV: "set_before"}
    env = {}
    configure_from(MetricsConfig(), env)  # off: no port, but the label's name still goes on
    assert env == {JOB_NAME_ENV: "persia_default_jobname"}


TWO_CONTEXTS = r"""
import os, urllib.request
os.environ["PERSIA_METRICS_PORT"] = "0"
os.environ["PERSIA_BIND_ADDRESS"] = "127.0.0.1"
os.environ["PERSIA_JOB_NAME"] = "twice"
from persia.metrics import Metrics, start_exporter
port = start_exporter()
for _ in range(2):  # a DataCtx per epoch: each makes its Metrics, the series is one
    m = Metrics("data_loader", 1)
    m.inc("data_loader_batches_sent", 3)
    m.observe("data_loader_send_time_cost_sec", 0.01)
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
"""


def test_two_metrics_of_one_process_share_their_series():
    proc = subprocess.run([sys.executable, "-c", TWO_CONTEXTS], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    labels = {"role": "data_loader", "replica": "1", "persia_job": "twice"}
    assert sample(proc.stdout, "persia_data_loader_batches_sent", **labels) == 6
    assert sample(proc.stdout, "persia_data_loader_send_time_cost_sec_count", **labels) == 2
