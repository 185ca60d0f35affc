"""``matrixpool export topology`` without a cluster: the Kueue Topology and ResourceFlavors and
the Volcano HyperNodes built from SuperNodes and node labels (matrixpool.interop.topology).

Kueue's own CRDs and webhooks judge the Kueue objects in tests/integration/test_peers.py, and
the API server judges the HyperNodes there by Volcano's CRD (generated from its Go types). Here
:func:`volcano_violations` checks them against Volcano v1.14's HyperNode schema (volcano.sh/apis,
topology/v1alpha1: ``tier`` required and ≥ 0, ``members`` ≥ 1 item, member ``type`` Node or
HyperNode, exactly one of ``exactMatch``/``regexMatch``/``labelMatch``, ``exactMatch.name`` a
DNS-1123 subdomain), its admission webhook's rule that a member selects by ``exactMatch`` or
``regexMatch`` (it refuses ``labelMatch``), and that the tiers form a tree.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from matrixpool.api import labels
from matrixpool.interop import topology as interop

CARD = "huawei.com/Ascend910"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
BLOCK = "example.com/block"


def node(name: str, **node_labels: str) -> dict[str, Any]:
    """A Node body as the API lists it: its name and labels (plus its hostname label)."""
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **node_labels}}}


def rack_nodes(
    supernode: str, racks: int, *, per_rack: int = 2, extra: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Nodes ``<sn>-node-<i>`` labelled with their supernode, rack ``<sn>-rack-<j>`` and
    ``extra``."""
    nodes = []
    for i in range(racks * per_rack):
        body = node(f"{supernode}-node-{i}")
        body["metadata"]["labels"].update(
            {
                labels.SUPERNODE: supernode,
                labels.RACK: f"{supernode}-rack-{i // per_rack}",
                **(extra or {}),
            }
        )
        nodes.append(body)
    return nodes


def supernode(
    name: str,
    keys: tuple[str, ...] = (labels.RACK,),
    *,
    selector: dict[str, Any] | None = None,
    card: str = CARD,
) -> dict[str, Any]:
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "SuperNode",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": selector or {"matchLabels": {labels.SUPERNODE: name}},
            "cardResource": card,
            "cardsPerNode": 8,
            "topologyKeys": list(keys),
        },
    }


def kinds(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(o["kind"], o["metadata"]["name"]) for o in objects]


# --- Kueue ------------------------------------------------------------------------------------
def test_kueue_one_topology_supernode_rack_hostname_and_a_flavor_per_supernode() -> None:
    pools = interop.pools(
        [supernode("sn-1"), supernode("sn-0")], rack_nodes("sn-0", 2) + rack_nodes("sn-1", 1)
    )
    result = interop.kueue(pools)
    assert result.warnings == []
    assert result.objects == [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "Topology",
            "metadata": {
                "name": "matrixpool-supernode-rack",
                "labels": {"app.kubernetes.io/managed-by": "matrixpool"},
            },
            "spec": {
                "levels": [
                    {"nodeLabel": labels.SUPERNODE},
                    {"nodeLabel": labels.RACK},
                    {"nodeLabel": "kubernetes.io/hostname"},
                ]
            },
        },
        *(
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "ResourceFlavor",
                "metadata": {
                    "name": f"matrixpool-{sn}",
                    "labels": {
                        "app.kubernetes.io/managed-by": "matrixpool",
                        labels.SUPERNODE: sn,
                    },
                    "annotations": {"matrixpool.dev/card-resource": CARD},
                },
                "spec": {
                    "nodeLabels": {labels.SUPERNODE: sn},
                    "topologyName": "matrixpool-supernode-rack",
                },
            }
            for sn in ("sn-0", "sn-1")
        ),
    ]


def test_kueue_a_topology_per_list_of_keys_with_the_hostname_once_and_last() -> None:
    """sn-a: block then rack; sn-b: rack only; sn-c names the hostname itself as a key."""
    nodes = (
        rack_nodes("sn-a", 1, extra={BLOCK: "b0"}) + rack_nodes("sn-b", 1) + rack_nodes("sn-c", 1)
    )
    pools = interop.pools(
        [
            supernode("sn-a", (BLOCK, labels.RACK)),
            supernode("sn-b"),
            supernode("sn-c", (labels.RACK, "kubernetes.io/hostname")),
        ],
        nodes,
    )
    result = interop.export("kueue", pools, prefix="ours")
    assert kinds(result.objects) == [
        ("Topology", "ours-supernode-block-rack"),
        ("ResourceFlavor", "ours-sn-a"),
        ("Topology", "ours-supernode-rack"),
        ("ResourceFlavor", "ours-sn-b"),
        ("ResourceFlavor", "ours-sn-c"),
    ]
    levels = [[lv["nodeLabel"] for lv in o["spec"]["levels"]] for o in result.objects[::2][:2]]
    assert levels == [
        [labels.SUPERNODE, BLOCK, labels.RACK, "kubernetes.io/hostname"],
        [labels.SUPERNODE, labels.RACK, "kubernetes.io/hostname"],
    ]
    assert result.objects[4]["spec"]["topologyName"] == "ours-supernode-rack"


def test_kueue_a_selector_by_expressions_takes_the_supernode_label_its_nodes_share() -> None:
    by_expression = {
        "matchExpressions": [{"key": "pool", "operator": "In", "values": ["big"]}],
    }
    pools = interop.pools(
        [supernode("sn-x", selector=by_expression)], rack_nodes("sn-x", 2, extra={"pool": "big"})
    )
    (flavor,) = [o for o in interop.kueue(pools).objects if o["kind"] == "ResourceFlavor"]
    assert flavor["spec"]["nodeLabels"] == {labels.SUPERNODE: "sn-x"}


def test_kueue_no_flavor_when_no_exact_label_selects_the_supernode_and_it_says_why() -> None:
    by_expression = {"matchExpressions": [{"key": "pool", "operator": "Exists"}]}
    nodes = rack_nodes("sn-x", 1, extra={"pool": "a"}) + rack_nodes("sn-y", 1, extra={"pool": "b"})
    result = interop.kueue(interop.pools([supernode("mixed", selector=by_expression)], nodes))
    assert kinds(result.objects) == [("Topology", "matrixpool-supernode-rack")]
    assert result.warnings == [
        "SuperNode mixed: no ResourceFlavor: its nodeSelector has no matchLabels and its nodes "
        "share no matrixpool.dev/supernode"
    ]


def test_kueue_warns_of_nodes_it_will_leave_out_and_of_a_supernode_without_nodes() -> None:
    nodes = rack_nodes("sn-0", 2)
    del nodes[1]["metadata"]["labels"][labels.RACK]
    result = interop.kueue(interop.pools([supernode("sn-0"), supernode("empty")], nodes))
    assert result.warnings == [
        "SuperNode empty: its nodeSelector matches no node",
        "SuperNode sn-0: 1 of 4 nodes lack the label matrixpool.dev/rack (sn-0-node-1); "
        "Kueue leaves them out",
    ]


# --- Volcano ----------------------------------------------------------------------------------
def test_volcano_a_hypernode_per_rack_holding_its_nodes_and_one_per_supernode() -> None:
    result = interop.volcano(interop.pools([supernode("sn-0")], rack_nodes("sn-0", 2)))
    assert result.warnings == []
    meta = {"app.kubernetes.io/managed-by": "matrixpool", labels.SUPERNODE: "sn-0"}

    def rack(name: str, *nodes: int) -> dict[str, Any]:
        return {
            "apiVersion": "topology.volcano.sh/v1alpha1",
            "kind": "HyperNode",
            "metadata": {"name": name, "labels": meta},
            "spec": {
                "tier": 1,
                "tierName": "rack",
                "members": [
                    {"type": "Node", "selector": {"exactMatch": {"name": f"sn-0-node-{n}"}}}
                    for n in nodes
                ],
            },
        }

    assert result.objects == [
        {
            "apiVersion": "topology.volcano.sh/v1alpha1",
            "kind": "HyperNode",
            "metadata": {"name": "sn-0", "labels": meta},
            "spec": {
                "tier": 2,
                "tierName": "supernode",
                "members": [
                    {"type": "HyperNode", "selector": {"exactMatch": {"name": f"sn-0-rack-{r}"}}}
                    for r in (0, 1)
                ],
            },
        },
        rack("sn-0-rack-0", 0, 1),
        rack("sn-0-rack-1", 2, 3),
    ]
    assert volcano_violations(result.objects) == []


def test_volcano_tiers_count_from_the_finest_and_supernodes_share_the_top_tier() -> None:
    """sn-a has blocks of racks (tiers 1, 2), sn-b racks only (tier 1): both supernodes on 3.
    Rack values that do not start with the supernode's name are prefixed with it."""
    nodes = [
        *rack_nodes("sn-a", 2, extra={BLOCK: "b0"}),
        {"metadata": {"name": "b-1", "labels": {labels.SUPERNODE: "sn-b", labels.RACK: "R_1"}}},
    ]
    pools = interop.pools([supernode("sn-a", (BLOCK, labels.RACK)), supernode("sn-b")], nodes)
    result = interop.export("volcano", pools)
    tiers = [
        (o["metadata"]["name"], o["spec"]["tier"], o["spec"]["tierName"]) for o in result.objects
    ]
    assert tiers == [
        ("sn-a", 3, "supernode"),
        ("sn-a-b0", 2, "block"),
        ("sn-a-rack-0", 1, "rack"),
        ("sn-a-rack-1", 1, "rack"),
        ("sn-b", 3, "supernode"),
        ("sn-b-r-1", 1, "rack"),
    ]
    block = result.objects[1]
    assert [m["selector"]["exactMatch"]["name"] for m in block["spec"]["members"]] == [
        "sn-a-rack-0",
        "sn-a-rack-1",
    ]
    rack = result.objects[5]["spec"]["members"]
    assert rack == [{"type": "Node", "selector": {"exactMatch": {"name": "b-1"}}}]
    assert volcano_violations(result.objects) == []


def test_volcano_racks_in_number_order() -> None:
    result = interop.volcano(interop.pools([supernode("sn-0")], rack_nodes("sn-0", 11, per_rack=1)))
    members = [m["selector"]["exactMatch"]["name"] for m in result.objects[0]["spec"]["members"]]
    assert members == [f"sn-0-rack-{r}" for r in range(11)]
    assert [o["metadata"]["name"] for o in result.objects[1:]] == members


def test_volcano_a_supernode_selected_by_expressions_holds_only_its_own_nodes() -> None:
    by_expression = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["big"]}]}
    nodes = rack_nodes("sn-x", 1, extra={"pool": "big"}) + rack_nodes("other", 1)
    result = interop.volcano(interop.pools([supernode("sn-x", selector=by_expression)], nodes))
    rack = result.objects[1]
    assert rack["spec"]["members"] == [
        {"type": "Node", "selector": {"exactMatch": {"name": "sn-x-node-0"}}},
        {"type": "Node", "selector": {"exactMatch": {"name": "sn-x-node-1"}}},
    ]
    assert volcano_violations(result.objects) == []


@pytest.mark.parametrize(
    ("keys", "nodes", "expected"),
    [
        pytest.param(
            (), rack_nodes("sn-0", 1), [("sn-0", 1)], id="no keys: the supernode holds its nodes"
        ),
        pytest.param((labels.RACK,), [], [], id="no nodes: no empty HyperNode"),
    ],
)
def test_volcano_edges(
    keys: tuple[str, ...], nodes: list[dict[str, Any]], expected: list[tuple[str, int]]
) -> None:
    result = interop.volcano(interop.pools([supernode("sn-0", keys)], nodes))
    assert [(o["metadata"]["name"], o["spec"]["tier"]) for o in result.objects] == expected
    assert volcano_violations(result.objects) == []


def test_names_wanted_twice_get_a_hash_each() -> None:
    """Rack "x" of supernode "a-b" and rack "b-x" of supernode "a" both want "a-b-x"."""
    nodes = [
        {"metadata": {"name": "n1", "labels": {labels.SUPERNODE: "a-b", labels.RACK: "x"}}},
        {"metadata": {"name": "n2", "labels": {labels.SUPERNODE: "a", labels.RACK: "b-x"}}},
    ]
    result = interop.volcano(interop.pools([supernode("a-b"), supernode("a")], nodes))
    names = [o["metadata"]["name"] for o in result.objects]
    assert len(set(names)) == len(names) == 4
    assert [n for n in names if n.startswith("a-b-x")] == [n for n in names if len(n) == 12]
    assert volcano_violations(result.objects) == []


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="kueue, volcano"):
        interop.export("slurm", [])


def volcano_violations(objects: list[dict[str, Any]]) -> list[str]:
    """What Volcano v1.14's HyperNode CRD would refuse, and members that break the tree."""
    problems = []
    tiers = {o["metadata"]["name"]: o["spec"]["tier"] for o in objects}
    for body in objects:
        name, spec = body["metadata"]["name"], body["spec"]
        if body["apiVersion"] != "topology.volcano.sh/v1alpha1" or body["kind"] != "HyperNode":
            problems.append(f"{name}: not a topology.volcano.sh/v1alpha1 HyperNode")
        if not DNS_SUBDOMAIN.match(name) or len(name) > 253:
            problems.append(f"{name}: not a DNS-1123 subdomain")
        if not isinstance(spec.get("tier"), int) or spec["tier"] < 0:
            problems.append(f"{name}: spec.tier must be an integer >= 0")
        if len(spec.get("tierName", "")) > 253:
            problems.append(f"{name}: spec.tierName longer than 253")
        if len(spec.get("members", [])) < 1:
            problems.append(f"{name}: spec.members needs at least 1 item")
        for member in spec.get("members", []):
            problems += _member_violations(name, member, spec["tier"], tiers)
    return problems


def _member_violations(
    name: str, member: dict[str, Any], tier: int, tiers: dict[str, int]
) -> list[str]:
    selector = member.get("selector", {})
    chosen = [k for k in ("exactMatch", "regexMatch", "labelMatch") if k in selector]
    if member.get("type") not in ("Node", "HyperNode") or len(chosen) != 1:
        return [f"{name}: member {member}: type Node|HyperNode and exactly one selector"]
    if chosen == ["labelMatch"]:
        return [f"{name}: Volcano's webhook wants exactMatch or regexMatch, not labelMatch"]
    if chosen == ["exactMatch"]:
        target = selector["exactMatch"].get("name", "")
        if not DNS_SUBDOMAIN.match(target):
            return [f"{name}: exactMatch.name {target!r} is not a DNS-1123 subdomain"]
        if member["type"] == "HyperNode" and tiers.get(target, tier) >= tier:
            return [f"{name}: member {target} is not an exported HyperNode of a lower tier"]
    return []
