#!/usr/bin/env bash
# The e2e scenarios on a real kind cluster: images built and loaded, the chart installed with
# Helm, the adult-income example and PERSIA's k8s.train.yaml applied with kubectl.
# Needs docker, kind, kubectl and helm (or the repo's venv for helm_python). Where docker or
# kind is missing (as on the CI machine) it says so and exits 0: `make e2e` (stand-in
# cluster) is the test that runs everywhere.
set -euo pipefail
cd "$(dirname "$0")/../.."
missing=()
for tool in docker kind kubectl; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ ${#missing[@]} -eq 0 ] && ! docker info >/dev/null 2>&1; then missing+=("a running docker engine"); fi
if [ ${#missing[@]} -ne 0 ]; then
  echo "SKIPPED e2e/kind: needs docker, kind and kubectl; missing: ${missing[*]}. Run \`make e2e\` for the stand-in cluster."
  exit 0
fi
exec "${PYTHON:-.venv/bin/python}" -m e2e.kind "$@"
