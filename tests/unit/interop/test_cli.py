"""``matrixpool export topology`` end to end without a cluster: the CLI reads SuperNodes and
Nodes from a stand-in API client and prints the objects (YAML documents, or one JSON List)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from matrixpool import cli
from matrixpool.api import labels
from matrixpool.k8s import client as k8s_client
from tests.unit.interop.test_topology import rack_nodes, supernode


class FakeApi:
    """Answers the two lists the export makes; remembers that it was closed."""

    def __init__(self, supernodes: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> None:
        self.custom = SimpleNamespace(list_cluster_custom_object=self.supernodes)
        self.core = SimpleNamespace(list_node=self.nodes)
        self.client = SimpleNamespace(close=self.close)
        self._supernodes, self._nodes, self.closed = supernodes, nodes, False

    def supernodes(self, group: str, version: str, plural: str) -> dict[str, Any]:
        assert (group, version, plural) == ("matrixpool.dev", "v1alpha1", "supernodes")
        return {"items": self._supernodes}

    def nodes(self, _preload_content: bool) -> SimpleNamespace:
        return SimpleNamespace(data=json.dumps({"items": self._nodes}).encode())

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    nodes = rack_nodes("sn-0", 2)
    del nodes[0]["metadata"]["labels"][labels.RACK]
    api = FakeApi([supernode("sn-0")], nodes)
    monkeypatch.setattr(k8s_client, "from_kubeconfig", lambda path: api)
    return api


def test_kueue_as_yaml_documents_and_the_warnings_on_stderr(
    fake: FakeApi, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["export", "topology", "--format", "kueue"]) == 0
    out, err = capsys.readouterr()
    documents = list(yaml.safe_load_all(out))
    assert [(d["kind"], d["metadata"]["name"]) for d in documents] == [
        ("Topology", "matrixpool-supernode-rack"),
        ("ResourceFlavor", "matrixpool-sn-0"),
    ]
    assert err == (
        "matrixpool: warning: SuperNode sn-0: 1 of 4 nodes lack the label matrixpool.dev/rack "
        "(sn-0-node-0); Kueue leaves them out\n"
    )
    assert fake.closed


def test_volcano_as_one_json_list(fake: FakeApi, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["export", "topology", "--format", "volcano", "-o", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert (body["apiVersion"], body["kind"]) == ("v1", "List")
    assert [i["metadata"]["name"] for i in body["items"]] == ["sn-0", "sn-0-rack-0", "sn-0-rack-1"]


def test_no_supernode_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(k8s_client, "from_kubeconfig", lambda path: FakeApi([], []))
    assert cli.main(["export", "topology", "--format", "volcano"]) == 1
    assert capsys.readouterr() == ("", "matrixpool: error: no SuperNode to export\n")
