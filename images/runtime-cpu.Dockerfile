# PERSIA runtime for CPU roles (embedding PS, embedding workers, data loaders, CPU NN workers).
# `make images` builds it (images/build.py: Docker where a daemon runs, buildah otherwise), or
# from the repository root:
#   docker build -f images/runtime-cpu.Dockerfile -t persiaml/persia-cpu-runtime:latest .
# BASE_IMAGE: any Debian-based image with python3 (3.11) and its venv module. The default is the
# public one; without a registry `make images` passes a debootstrapped Debian bookworm.
ARG BASE_IMAGE=python:3.11-slim

# ---- builder: the compiler, the project's wheel (with the embedding PS's C kernel) and a venv
# with the wheel and its pinned dependencies. Only /opt/venv leaves this stage.
FROM ${BASE_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
# PyTorch's CPU wheel index (torch's dependencies come from PyPI). torch is pinned with its +cpu
# label, so no index can hand over the CUDA build; offline, `make images` stages the wheel.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Only for builds that need the host's CA bundle to reach PyPI (buildah mounts it); no secret.
ARG PIP_CERT
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# python:3.11-slim carries Python's headers; Debian's python3 needs python3-dev for them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! python3 -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
         apt-get install -y --no-install-recommends python3-dev; fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY images/requirements/runtime.txt images/requirements/
# Wheels staged by `make images` (torch's CPU wheel where the index cannot be reached); may be empty.
COPY images/wheelhouse/ /wheelhouse/
RUN pip install --constraint images/requirements/runtime.txt --find-links /wheelhouse \
        --extra-index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+cpu"
COPY pyproject.toml setup.py README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN pip wheel --no-deps --wheel-dir /dist . \
    && pip install --constraint images/requirements/runtime.txt "$(ls /dist/persia_k8s-*.whl)[runtime]" \
    && python -c "import torch, persia.embedding_ps._kernels, persia._unique; assert torch.__version__ == '${TORCH_VERSION}+cpu', torch.__version__" \
    && mkdir -p /opt/persia && pip freeze --all > /opt/persia/pip-freeze.txt

# ---- the runtime: Python, the venv, the examples; no compiler, no pip caches, no secrets.
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TMPDIR=/tmp
# Non-root; its home is /tmp, the one place the runtime writes to besides the directories a job
# configures (checkpoints, incremental updates, profiles), so the root filesystem can be read-only.
RUN groupadd --gid 65532 persia \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin persia
COPY --from=builder /opt/venv /opt/venv
# The versions installed (pip freeze), for audits; docs/images.md lists them too.
COPY --from=builder /opt/persia/pip-freeze.txt /opt/persia/
# PERSIA's images carried the adult-income example; examples/adult-income/persiajob.yaml uses it.
COPY examples/adult-income/ /opt/persia/examples/adult-income/
WORKDIR /tmp
USER 65532:65532
# Every role serves Prometheus metrics here (PERSIA_METRICS_PORT).
EXPOSE 9090
ENTRYPOINT ["persia-launcher"]
CMD ["--help"]
