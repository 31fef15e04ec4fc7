# The PersiaJob operator. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t persiaml/persia-operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
# Only the operator extra: kopf and the kubernetes client (no torch).
RUN pip install ".[operator]" && rm -rf /src

# Non-root, read-only root filesystem friendly (the chart mounts an emptyDir at /tmp).
USER 65532:65532
WORKDIR /
EXPOSE 8080
ENTRYPOINT ["persia-operator"]
CMD ["run", "--all-namespaces"]
