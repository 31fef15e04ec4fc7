"""The Dockerfiles cannot be built here (no Docker); check what can drift instead:
the torch pin matches pyproject.toml, the extras installed, and the copied paths."""

from __future__ import annotations

import re
import tomllib

import pytest
from operator_testkit import REPO

IMAGES = REPO / "images"


def dockerfile(name: str) -> str:
    return (IMAGES / f"{name}.Dockerfile").read_text()


def torch_pin() -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["optional-dependencies"]["runtime"] if d.replace(" ", "").startswith("torch==")]
    assert len(pins) == 1
    return pins[0].split("==")[1]


@pytest.mark.parametrize("name, extra", [("operator", "operator"), ("runtime-cpu", "runtime"), ("runtime-cuda", "runtime")])
def test_installs_the_project_with_its_extra(name, extra):
    text = dockerfile(name)
    assert f'pip install ".[{extra}]"' in text
    for source in re.findall(r"^COPY (\S+)", text, flags=re.M):
        assert (REPO / source.rstrip("/")).exists(), f"{name}: COPY {source} does not exist"


@pytest.mark.parametrize("name, index", [("runtime-cpu", "/whl/cpu"), ("runtime-cuda", "/whl/cu")])
def test_runtime_images_pin_the_projects_torch(name, index):
    text = dockerfile(name)
    assert f"ARG TORCH_VERSION={torch_pin()}" in text
    assert index in text  # the CPU or CUDA wheel, not whatever PyPI's default is


def test_cuda_image_is_based_on_nvidia_cuda():
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+", dockerfile("runtime-cuda"), flags=re.M)


def test_operator_image_runs_the_operator_as_non_root():
    text = dockerfile("operator")
    assert 'ENTRYPOINT ["persia-operator"]' in text and "USER 65532" in text
    assert "torch==" not in text
