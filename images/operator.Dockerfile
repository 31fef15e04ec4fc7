# The PersiaJob operator. `make images` builds it (images/build.py: Docker where a daemon runs,
# buildah otherwise), or from the repository root:
#   docker build -f images/operator.Dockerfile -t persiaml/persia-operator:0.1.0 .
# BASE_IMAGE: any Debian-based image with python3 (3.11) and its venv module. The default is the
# public one; without a registry `make images` passes a debootstrapped Debian bookworm.
ARG BASE_IMAGE=python:3.11-slim

# ---- builder: the project's wheel (it carries the runtime's C kernel too, hence the compiler)
# and a venv with the operator extra (kopf, the kubernetes client; no torch).
FROM ${BASE_IMAGE} AS builder
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
COPY images/requirements/operator.txt images/requirements/
COPY pyproject.toml setup.py README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN pip wheel --no-deps --wheel-dir /dist . \
    && pip install --constraint images/requirements/operator.txt "$(ls /dist/persia_k8s-*.whl)[operator]" \
    && python -c "import importlib.util, persia_operator; assert importlib.util.find_spec('torch') is None" \
    && mkdir -p /opt/persia && pip freeze --all > /opt/persia/pip-freeze.txt

# ---- the operator: Python and the venv; no compiler, no pip caches, no secrets.
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TMPDIR=/tmp
# Non-root with a read-only root filesystem: it writes only to /tmp (the chart mounts an emptyDir).
RUN groupadd --gid 65532 persia \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin persia
COPY --from=builder /opt/venv /opt/venv
# The versions installed (pip freeze), for audits; docs/images.md lists them too.
COPY --from=builder /opt/persia/pip-freeze.txt /opt/persia/
WORKDIR /tmp
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["persia-operator"]
CMD ["run", "--all-namespaces"]
