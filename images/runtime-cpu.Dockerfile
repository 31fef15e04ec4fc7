# PERSIA runtime for CPU roles (embedding PS, embedding workers, data loaders, CPU NN
# workers). Build from the repository root:
#   docker build -f images/runtime-cpu.Dockerfile -t persiaml/persia-cpu-runtime:latest .
FROM python:3.11-slim

# The CPU build of torch comes from PyTorch's CPU wheel index; the default wheel on
# PyPI pulls the CUDA libraries (gigabytes this image does not need).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
# torch==2.13.0 is already satisfied by the CPU wheel above.
RUN pip install ".[runtime]" && rm -rf /src

# PERSIA's images carried the adult-income example; examples/adult-income/persiajob.yaml uses it.
COPY examples/adult-income/ /opt/persia/examples/adult-income/
WORKDIR /workspace
# Every role serves Prometheus metrics here (PERSIA_METRICS_PORT).
EXPOSE 9090
ENTRYPOINT []
CMD ["persia-launcher", "--help"]
