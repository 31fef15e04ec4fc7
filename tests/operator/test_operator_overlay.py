"""The pod-template overlay merge."""

from __future__ import annotations

import copy

from persia_operator.overlay import merge

BASE = {
    "metadata": {"labels": {"a": "1"}},
    "spec": {
        "containers": [{"name": "main", "image": "x", "env": [{"name": "A", "value": "1"}], "ports": [{"containerPort": 1}]}],
        "volumes": [{"name": "cfg", "configMap": {"name": "c"}}],
        "tolerations": [{"key": "old"}],
        "enableServiceLinks": False,
    },
}


def test_maps_merge_and_named_lists_merge_by_name():
    overlay = {
        "metadata": {"labels": {"b": "2"}},
        "spec": {
            "containers": [
                {"name": "main", "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]},
                {"name": "sidecar", "image": "s"},
            ],
            "volumes": [{"name": "data", "emptyDir": {}}],
        },
    }
    before = copy.deepcopy(BASE)
    merged = merge(BASE, overlay)
    assert BASE == before  # inputs untouched
    assert merged["metadata"]["labels"] == {"a": "1", "b": "2"}
    main, sidecar = merged["spec"]["containers"]
    assert main["image"] == "x" and main["env"] == [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]
    assert sidecar == {"name": "sidecar", "image": "s"}
    assert [v["name"] for v in merged["spec"]["volumes"]] == ["cfg", "data"]


def test_other_lists_replace_and_null_removes():
    merged = merge(BASE, {"spec": {"tolerations": [{"key": "new"}], "enableServiceLinks": None,
                                   "containers": [{"name": "main", "ports": [{"containerPort": 2}]}]}})  # fmt: skip
    assert merged["spec"]["tolerations"] == [{"key": "new"}]
    assert "enableServiceLinks" not in merged["spec"]
    # Unnamed ports cannot be matched by name: the overlay's list replaces the rendered one.
    assert merged["spec"]["containers"][0]["ports"] == [{"containerPort": 2}]
