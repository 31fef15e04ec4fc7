"""Every engine test runs twice: on the compiled kernel and on the pure-numpy fallback, so the two
paths stay equivalent (stores pick their path from PERSIA_PS_PURE_NUMPY when they are made)."""

from __future__ import annotations

import pytest

from persia.embedding_ps import kernels


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def engine_path(request, monkeypatch) -> str:
    if request.param == "compiled":
        if not kernels.available():
            pytest.fail("persia.embedding_ps._kernels is not built: reinstall the package (pip install -e .)")
        monkeypatch.delenv(kernels.ENV_PURE_NUMPY, raising=False)
    else:
        monkeypatch.setenv(kernels.ENV_PURE_NUMPY, "1")
    return request.param
