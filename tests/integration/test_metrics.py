"""Prometheus metrics: a PS with PERSIA_METRICS_PORT set serves its store's counters on /metrics."""

import subprocess
import sys
import textwrap

import pytest

from persia.utils import find_free_port

pytestmark = pytest.mark.integration


def test_ps_serves_store_counters(tmp_path):
    # A separate process: the exporter and the Prometheus registry are per process.
    port = find_free_port()
    script = textwrap.dedent(
        f"""
        import os, urllib.request, numpy as np
        os.environ["PERSIA_METRICS_PORT"] = "{port}"
        from persia.config import load_global_config_from_dict
        from persia.embedding_ps.service import EmbeddingParameterServer
        ps = EmbeddingParameterServer(load_global_config_from_dict({{}}), 0, 1, port=0)
        ps.configure({{}})
        ps.lookup({{"train": True, "tables": [{{"dim": 4, "signs": np.arange(1, 6, dtype=np.uint64)}}]}})
        body = urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        print(body)
        ps.stop()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("persia_rows{")]
    assert lines and lines[0].endswith(" 5.0"), proc.stdout[-2000:]
