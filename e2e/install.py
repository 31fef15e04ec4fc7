"""Install the operator the way a user does: the chart rendered by Helm (helm_python, Helm's
Go library), CRDs first (Helm's crds/), then the release's manifests, all through kubectl
(pre-install hooks before them, post-install hooks after; Helm would also wait for hooks
and delete them per their delete policy, which this does not).

The chart's Deployment then runs as a pod of the process kubelet: the operator is
`persia-operator run …` exactly as the chart writes it, its own process, logged in
through the kubeconfig the kubelet gives every pod.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .cluster import Cluster

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "persia-operator"
RELEASE = "persia"
NAMESPACE = "persia-system"


def render_chart(values: dict[str, Any], name: str = RELEASE, namespace: str = NAMESPACE,
                 phase: str = "install") -> str:  # fmt: skip
    """The chart's templates as one multi-document YAML (no CRDs: Helm installs crds/ apart).

    phase: "install" (the release's objects), "pre-install" or "post-install" (those
    hooks); other hooks (pre-delete, test, …) are not part of an install."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values=values, name=name, namespace=namespace, is_install=True)
    texts = [text for path, text in sorted(out.items()) if path.endswith(".yaml") and "/crds/" not in path and text.strip()]
    docs = [d for text in texts for d in yaml.safe_load_all(text) if d]

    def hooks(doc: dict[str, Any]) -> set[str]:
        value = ((doc.get("metadata") or {}).get("annotations") or {}).get("helm.sh/hook", "")
        return {h.strip() for h in value.split(",") if h.strip()}

    chosen = [d for d in docs if (not hooks(d) if phase == "install" else phase in hooks(d))]
    return yaml.safe_dump_all(chosen) if chosen else ""


def namespace_manifest(name: str) -> str:
    # `kubectl create namespace` sends protobuf, which the harness does not decode.
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def install_operator(cluster: Cluster, values: dict[str, Any] | None = None) -> str:
    """CRDs + chart through kubectl; returns kubectl's output."""
    out = cluster.kubectl("apply", "-f", str(CHART / "crds"))
    out += cluster.kubectl("apply", "-f", "-", stdin=namespace_manifest(NAMESPACE))
    for phase in ("pre-install", "install", "post-install"):
        manifest = render_chart(values or {}, phase=phase)
        if manifest:
            out += cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=manifest)
    return out
