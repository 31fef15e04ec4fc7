"""Generate the PersiaJob CustomResourceDefinition from the pydantic models.

    python -m persia_operator.crdgen > crds/persiajobs.persia.com.yaml
    python -m persia_operator.crdgen -o crds/persiajobs.persia.com.yaml \
        -o charts/persia-operator/crds/persiajobs.persia.com.yaml

pydantic's JSON schema is turned into a structural OpenAPI v3 schema: references are
inlined, Optional collapses to its type, free-form maps keep unknown fields, and the
CEL rules declared on the models come along as x-kubernetes-validations.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import yaml

from . import constants as C
from .job import JobStatus
from .spec import PersiaJobSpec

_KEEP = {
    "type", "description", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
    "required", "format", "minItems", "maxItems",
}  # fmt: skip

HEADER = (
    "# Generated from persia_operator's pydantic models by `python -m persia_operator.crdgen`.\n"
    "# Do not edit by hand: change operator/persia_operator/spec.py or job.py and regenerate.\n"
)

NAME_RULES = [
    {
        "rule": f"size(self.metadata.name) <= {C.MAX_JOB_NAME}",
        "message": (
            f"metadata.name must be at most {C.MAX_JOB_NAME} characters so that every child "
            f"name (<name>{C.LONGEST_WORKLOAD_SUFFIX}) fits in {C.MAX_WORKLOAD_NAME}"
        ),
    },
    {
        "rule": f"self.metadata.name.matches('{C.JOB_NAME_PATTERN}')",
        "message": "metadata.name must be a DNS-1035 label (it prefixes Service names)",
    },
    {
        "rule": " && ".join(f"!self.metadata.name.endsWith('{e}')" for e in C.CLASHING_NAME_ENDINGS),
        "message": (f"metadata.name must not end in {' or '.join(C.CLASHING_NAME_ENDINGS)}: a child of the job "
                    "would have the name of a child of the job named without it"),
    },
]


def _structural(node: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """Convert one pydantic JSON-schema node into a structural schema node."""
    node = copy.deepcopy(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        merged = {**copy.deepcopy(target), **node}  # field-level description etc. win
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {options} structurally")
        return _structural({**options[0], **node}, defs)
    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEEP}
    if "default" in node and not isinstance(node["default"], (dict, list)) and node["default"] is not None:
        out["default"] = node["default"]
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
    if node.get("type") == "object":
        props = node.get("properties")
        extra = node.get("additionalProperties")
        if props:
            out["properties"] = {k: _structural(v, defs) for k, v in props.items()}
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = _structural(extra, defs)
        elif extra is True or extra is None or extra == {}:
            out["x-kubernetes-preserve-unknown-fields"] = True
        if props and extra is True:
            out["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("type") == "array":
        out["items"] = _structural(node.get("items", {"type": "object"}), defs)
    return out


def model_schema(model: type, mode: str = "validation") -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode=mode)  # type: ignore[attr-defined]
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def spec_schema() -> dict[str, Any]:
    return model_schema(PersiaJobSpec)


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def status_schema() -> dict[str, Any]:
    """Only the operator writes status: no defaults, nothing required."""
    schema = _without_defaults(model_schema(JobStatus, mode="serialization"))
    schema.pop("required", None)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    refused = schema["properties"]["refusedWrites"]  # one per child (refusals.py)
    refused["x-kubernetes-list-type"] = "map"
    refused["x-kubernetes-list-map-keys"] = ["kind", "name"]
    return schema


def crd() -> dict[str, Any]:
    schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": NAME_RULES,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": C.CRD_NAME, "labels": {"app.kubernetes.io/name": "persia-operator"}},
        "spec": {
            "group": C.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": C.KIND,
                "listKind": C.LIST_KIND,
                "plural": C.PLURAL,
                "singular": C.SINGULAR,
                "shortNames": list(C.SHORT_NAMES),
                "categories": list(C.CATEGORIES),
            },
            "versions": [
                {
                    "name": C.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {
                            "name": "Ready",
                            "type": "string",
                            "description": "NN workers ready / desired",
                            "jsonPath": ".status.replicaStatuses.nnWorker.readyRatio",
                        },
                        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                        {
                            "name": "Succeeded",
                            "type": "string",
                            "priority": 1,
                            "jsonPath": '.status.conditions[?(@.type=="Succeeded")].status',
                        },
                        {"name": "Reason", "type": "string", "priority": 1, "jsonPath": ".status.reason"},
                    ],
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m persia_operator.crdgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", action="append", default=[], help="write here (repeatable); default stdout")
    args = parser.parse_args(argv)
    text = crd_yaml()
    if not args.output:
        sys.stdout.write(text)
    for path in args.output:
        with open(path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
