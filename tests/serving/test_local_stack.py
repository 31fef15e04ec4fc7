"""The local inference stack's readiness wait (real PS, embedding worker and model server
processes): a model that never comes fails the wait at once when its source has exited."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from persia.serving.local_stack import InferenceStack
from tests.serving.roles.tiny_data import EMBEDDING_CONFIG

pytestmark = pytest.mark.integration


def test_the_wait_fails_at_once_when_the_models_source_exits(tmp_path):
    ec = tmp_path / "embedding_config.yml"
    ec.write_text(yaml.safe_dump(EMBEDDING_CONFIG))
    source = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])  # a training job that died
    stack = InferenceStack(tmp_path / "serving", str(ec), {}, model=str(tmp_path / "no-model-yet"), checkpoint=None)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="exited 3 before the model server was ready") as err:
            stack.wait_ready(deadline_s=120, upstream=source)
        assert time.monotonic() - t0 < 60, "the wait ran towards its deadline"
        assert "model-server.log" in str(err.value)  # the stack's logs come with the error
    finally:
        stack.stop()
