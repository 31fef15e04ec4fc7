# PERSIA runtime for GPU NN workers (and any other role). `make images` builds it where Docker
# (or buildah with registry access) can pull its base; offline it is linted with hadolint instead
# (docs/images.md). From the repository root:
#   docker build -f images/runtime-cuda.Dockerfile -t persiaml/persia-cuda-runtime:latest .
# The CUDA version of the base image and of the torch wheel must match (CUDA_IMAGE, TORCH_CUDA).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---- builder: the compiler, the project's wheel (with the embedding PS's C kernel) and a venv
# with the wheel and its pinned dependencies. Only /opt/venv leaves this stage.
FROM ${CUDA_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
# PyTorch's wheel index for the CUDA build matching the base image (cu128 = CUDA 12.8); torch is
# pinned with that +cu128 label, so no other build can be installed.
ARG TORCH_CUDA=cu128
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_CUDA}
# Only for builds that need the host's CA bundle to reach PyPI (buildah mounts it); no secret.
ARG PIP_CERT
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY images/requirements/runtime.txt images/requirements/
# Wheels staged by `make images`; may be empty.
COPY images/wheelhouse/ /wheelhouse/
RUN pip install --constraint images/requirements/runtime.txt --find-links /wheelhouse \
        --extra-index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+${TORCH_CUDA}"
COPY pyproject.toml setup.py README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN pip wheel --no-deps --wheel-dir /dist . \
    && pip install --constraint images/requirements/runtime.txt "$(ls /dist/persia_k8s-*.whl)[runtime]" \
    && python -c "import torch, persia.embedding_ps._kernels, persia._unique; assert torch.__version__ == '${TORCH_VERSION}+${TORCH_CUDA}', torch.__version__" \
    && mkdir -p /opt/persia && pip freeze --all > /opt/persia/pip-freeze.txt

# ---- the runtime: the CUDA runtime libraries, Python, the venv, the examples; no compiler.
FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TMPDIR=/tmp
# The venv's interpreter is the base's python3 (same image as the builder).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 persia \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin persia
COPY --from=builder /opt/venv /opt/venv
# The versions installed (pip freeze), for audits; docs/images.md lists the CPU image's.
COPY --from=builder /opt/persia/pip-freeze.txt /opt/persia/
# PERSIA's images carried the adult-income example; examples/adult-income/persiajob.yaml uses it.
COPY examples/adult-income/ /opt/persia/examples/adult-income/
WORKDIR /tmp
USER 65532:65532
EXPOSE 9090
ENTRYPOINT ["persia-launcher"]
CMD ["--help"]
