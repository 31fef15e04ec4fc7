# PERSIA runtime for GPU NN workers (and any other role). Build from the repository root:
#   docker build -f images/runtime-cuda.Dockerfile -t persiaml/persia-cuda-runtime:latest .
# The CUDA version of the base image and of the torch wheel must match (ARGs below).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
# PyTorch's wheel index for the CUDA build matching the base image (cu128 = CUDA 12.8).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
# torch==2.13.0 is already satisfied by the CUDA wheel above.
RUN pip install ".[runtime]" && rm -rf /src

# PERSIA's images carried the adult-income example; examples/adult-income/persiajob.yaml uses it.
COPY examples/adult-income/ /opt/persia/examples/adult-income/
WORKDIR /workspace
EXPOSE 9090
ENTRYPOINT []
CMD ["persia-launcher", "--help"]
