"""Every PersiaJob manifest shipped in examples/ validates and renders to valid Kubernetes objects."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from persia_operator.job import PersiaJob
from persia_operator.render import render
from persia_operator.spec import validate_job

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted(ROOT.glob("examples/**/persiajob*.yaml")) + sorted(ROOT.glob("examples/k8s/*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_manifest_renders_valid_children(path):
    body = yaml.safe_load(path.read_text())
    body.setdefault("metadata", {}).setdefault("namespace", "default")
    meta, spec = validate_job(body)
    children = render(PersiaJob(metadata=meta, spec=spec))
    roles = {c["metadata"]["labels"].get("persia.com/role") for c in children}
    assert {"embedding-ps", "embedding-worker", "nn-worker", "dataloader"} <= roles, roles
    for child in children:
        kubernetes_validate.validate(child, "1.30", strict=True)


def test_adult_income_manifest_points_at_the_example_in_the_image():
    spec = yaml.safe_load((ROOT / "examples/adult-income/persiajob.yaml").read_text())["spec"]
    for key, rel in (("PERSIA_NN_WORKER_ENTRY", "train.py"), ("PERSIA_DATALOADER_ENTRY", "data_loader.py")):
        assert spec["persiaEnv"][key] == f"/opt/persia/examples/adult-income/{rel}"
        assert (ROOT / "examples/adult-income" / rel).exists()
    dockerfile = (ROOT / "images/runtime-cpu.Dockerfile").read_text()
    assert "COPY examples/adult-income/ /opt/persia/examples/adult-income/" in dockerfile
