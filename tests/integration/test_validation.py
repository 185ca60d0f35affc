"""The CRDs validate on the real kube-apiserver: every example is accepted, and every invalid
resource is rejected by the OpenAPI schema or a CEL rule with a message naming the field.

Each case deep-copies a valid example and changes one thing, then applies it with
``kubectl apply --dry-run=server`` (nothing is stored). The CRDs are installed by the session's
``cluster`` fixture from crds/.
"""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration import framework

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASES = {
    "SuperNode": "supernode-cloudmatrix384.yaml",
    "TrainingJob": "trainingjob-llm.yaml",
    "InferenceService": "inferenceservice-deepseek.yaml",
}
Manifest = dict[str, Any]
Change = Callable[[Manifest], None]


# --- builders: one change to a valid base, read as a sentence -----------------------------------
def _walk(manifest: Manifest, path: str) -> tuple[Any, str | int]:
    """The container of the last step of a path like ``spec.roles[1].name``, and that step."""
    steps: list[str | int] = []
    for part in path.split("."):
        name = part.partition("[")[0]
        steps += [name] if name else []
        steps += [int(i) for i in re.findall(r"\[(\d+)\]", part)]
    node: Any = manifest
    for step in steps[:-1]:
        node = node[step]
    return node, steps[-1]


def setting(path: str, value: Any) -> Change:
    def change(manifest: Manifest) -> None:
        parent, key = _walk(manifest, path)
        parent[key] = copy.deepcopy(value)

    return change


def both(first: Change, second: Change) -> Change:
    def change(manifest: Manifest) -> None:
        first(manifest)
        second(manifest)

    return change


def removing(path: str) -> Change:
    def change(manifest: Manifest) -> None:
        parent, key = _walk(manifest, path)
        del parent[key]

    return change


def appending(path: str, value: Any) -> Change:
    def change(manifest: Manifest) -> None:
        parent, key = _walk(manifest, path)
        parent[key].append(copy.deepcopy(value))

    return change


def windows(*spans: tuple[str, str]) -> Change:
    """Replace the time windows by ``(start, end)`` spans named w0, w1, ..."""
    return setting(
        "spec.timeSharing.windows",
        [
            {"name": f"w{i}", "start": start, "end": end, "inferenceCards": 8}
            for i, (start, end) in enumerate(spans)
        ],
    )


# Between one decode instance per five prefill instances and one per two.
DECODE_PER_PREFILL = {"role": "decode", "per": "prefill", "minPercent": 20, "maxPercent": 50}


def autoscaled(**fields: Any) -> Change:
    """Autoscaling to TTFT 2 s and TPOT 50 ms, with ``fields`` added; spec.ratio removed when a
    ratioRange is given (one of them)."""

    def change(manifest: Manifest) -> None:
        targets = {"ttftMilliseconds": 2000, "tpotMilliseconds": 50}
        manifest["spec"]["autoscaling"] = {"targets": targets, **copy.deepcopy(fields)}
        if "ratioRange" in fields:
            manifest["spec"].pop("ratio", None)

    return change


def role(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "replicas": 1, "cardsPerPod": 8, **fields}


def base(kind: str) -> Manifest:
    return dict(yaml.safe_load((EXAMPLES / BASES[kind]).read_text()))


# --- the table ------------------------------------------------------------------------------------
# (sentence, kind, change, substrings the API server's error must contain)
# fmt: off
INVALID: list[tuple[str, str, Change, tuple[str, ...]]] = [
    # SuperNode
    ("cardsPerNode of zero is rejected", "SuperNode",
     setting("spec.cardsPerNode", 0), ("spec.cardsPerNode",)),
    ("cardsPerNode above 64 is rejected", "SuperNode",
     setting("spec.cardsPerNode", 65), ("spec.cardsPerNode",)),
    ("a supernode without nodeSelector is rejected", "SuperNode",
     removing("spec.nodeSelector"), ("spec.nodeSelector: Required value",)),
    ("an empty nodeSelector is rejected", "SuperNode",
     setting("spec.nodeSelector", {}), ("spec.nodeSelector must select by at least one label",)),
    ("an In expression without values is rejected", "SuperNode",
     setting("spec.nodeSelector", {"matchExpressions": [{"key": "a", "operator": "In"}]}),
     ("matchExpressions[].values must be non-empty",)),
    ("a cardResource without a domain is rejected", "SuperNode",
     setting("spec.cardResource", "gpu"), ("spec.cardResource",)),
    ("negative spare nodes are rejected", "SuperNode",
     setting("spec.spares.nodes", -1), ("spec.spares.nodes",)),
    ("a topology key listed twice is rejected", "SuperNode",
     setting("spec.topologyKeys", ["matrixpool.dev/rack", "matrixpool.dev/rack"]),
     ("spec.topologyKeys[1]: Duplicate value",)),
    ("a card index at cardsPerNode is rejected", "SuperNode",
     setting("spec.cardGroups", [[0, 1, 2, 3], [4, 5, 6, 8]]),
     ("spec.cardGroups card indices must be below spec.cardsPerNode",)),
    ("a negative card index is rejected", "SuperNode",
     setting("spec.cardGroups", [[-1]]), ("spec.cardGroups[0][0]",)),
    ("a card in two groups is rejected", "SuperNode",
     setting("spec.cardGroups", [[0, 1, 2, 3], [3, 4, 5]]),
     ("spec.cardGroups must not hold a card in two groups",)),
    ("a card listed twice in one group is rejected", "SuperNode",
     setting("spec.cardGroups", [[0, 1, 1]]), ("spec.cardGroups[0][2]: Duplicate value",)),
    ("a window starting at 24:00 is rejected", "SuperNode",
     setting("spec.timeSharing.windows[0].start", "24:00"),
     ("spec.timeSharing.windows[0].start",)),
    ("a window ending at minute 60 is rejected", "SuperNode",
     setting("spec.timeSharing.windows[0].end", "22:60"), ("spec.timeSharing.windows[0].end",)),
    ("a window time without a leading zero is rejected", "SuperNode",
     setting("spec.timeSharing.windows[1].start", "8:00"),
     ("spec.timeSharing.windows[1].start",)),
    ("windows leaving a gap are rejected", "SuperNode",
     windows(("08:00", "20:00"), ("22:00", "08:00")),
     ("spec.timeSharing.windows must cover the 24 hours exactly once",)),
    ("overlapping windows are rejected", "SuperNode",
     windows(("08:00", "23:00"), ("22:00", "08:00")),
     ("spec.timeSharing.windows must cover the 24 hours exactly once",)),
    ("windows covering the day twice are rejected", "SuperNode",
     windows(("00:00", "12:00"), ("12:00", "00:00"), ("06:00", "18:00"), ("18:00", "06:00")),
     ("spec.timeSharing.windows must cover the 24 hours exactly once",)),
    ("an all-day window beside another window is rejected", "SuperNode",
     windows(("08:00", "08:00"), ("22:00", "08:00")),
     ("spec.timeSharing.windows must cover the 24 hours exactly once",)),
    ("two windows with one name are rejected", "SuperNode",
     setting("spec.timeSharing.windows[1].name", "day"),
     ("spec.timeSharing.windows[1]: Duplicate value",)),
    ("no windows at all is rejected", "SuperNode",
     setting("spec.timeSharing.windows", []), ("spec.timeSharing.windows",)),
    ("an empty timezone is rejected", "SuperNode",
     setting("spec.timeSharing.timezone", ""), ("spec.timeSharing.timezone",)),
    ("a timezone with spaces is rejected", "SuperNode",
     setting("spec.timeSharing.timezone", "Asia / Shanghai"), ("spec.timeSharing.timezone",)),
    ("negative inferenceCards are rejected", "SuperNode",
     setting("spec.timeSharing.windows[0].inferenceCards", -8),
     ("spec.timeSharing.windows[0].inferenceCards",)),
    ("a negative checkpointGraceSeconds is rejected", "SuperNode",
     setting("spec.timeSharing.checkpointGraceSeconds", -1),
     ("spec.timeSharing.checkpointGraceSeconds",)),
    ("a name longer than a label value is rejected", "SuperNode",
     setting("metadata.name", "sn-" + "x" * 61), ("metadata.name",)),
    # TrainingJob
    ("a job name that cannot name its Service is rejected", "TrainingJob",
     setting("metadata.name", "7b-llm"), ("metadata.name must be a DNS-1035 label",)),
    ("a job name too long for its pods' hostnames is rejected", "TrainingJob",
     setting("metadata.name", "x" * 57), ("metadata.name must be a DNS-1035 label",)),
    ("a rendezvous port of 0 is rejected", "TrainingJob",
     setting("spec.rendezvous", {"port": 0}), ("spec.rendezvous.port",)),
    ("zero processes per replica are rejected", "TrainingJob",
     setting("spec.rendezvous", {"procsPerReplica": 0}), ("spec.rendezvous.procsPerReplica",)),
    ("an unknown recovery restart is rejected", "TrainingJob",
     setting("spec.recovery", {"restart": "Everything"}), ("spec.recovery.restart",)),
    ("zero replicas are rejected", "TrainingJob",
     setting("spec.replicas", 0), ("spec.replicas",)),
    ("a job without replicas is rejected", "TrainingJob",
     removing("spec.replicas"), ("spec.replicas: Required value",)),
    ("minReplicas above replicas is rejected", "TrainingJob",
     setting("spec.minReplicas", 33), ("spec.minReplicas must be <= spec.replicas",)),
    ("minReplicas of zero is rejected", "TrainingJob",
     setting("spec.minReplicas", 0), ("spec.minReplicas",)),
    ("zero cardsPerReplica are rejected", "TrainingJob",
     setting("spec.cardsPerReplica", 0), ("spec.cardsPerReplica",)),
    ("a negative priority is rejected", "TrainingJob",
     setting("spec.priority", -1), ("spec.priority",)),
    ("an unknown superNodeAffinity is rejected", "TrainingJob",
     setting("spec.placement.superNodeAffinity", "Sometimes"),
     ("spec.placement.superNodeAffinity",)),
    ("a groupSize of zero is rejected", "TrainingJob",
     setting("spec.placement.groupSize", 0), ("spec.placement.groupSize",)),
    ("a groupSize above replicas is rejected", "TrainingJob",
     setting("spec.placement.groupSize", 64),
     ("spec.placement.groupSize must be <= spec.replicas",)),
    ("an invalid superNode name is rejected", "TrainingJob",
     setting("spec.superNode", "SN_0"), ("spec.superNode",)),
    ("a window listed twice is rejected", "TrainingJob",
     setting("spec.windows", ["night", "night"]), ("spec.windows[1]: Duplicate value",)),
    ("a template that is not an object is rejected", "TrainingJob",
     setting("spec.template", "pod"), ("spec.template",)),
    ("memory checkpoints every zero steps are rejected", "TrainingJob",
     setting("spec.checkpoint.memory.everySteps", 0), ("spec.checkpoint.memory.everySteps",)),
    ("negative peerReplicas are rejected", "TrainingJob",
     setting("spec.checkpoint.memory.peerReplicas", -1),
     ("spec.checkpoint.memory.peerReplicas",)),
    ("a persistent uri without a scheme is rejected", "TrainingJob",
     setting("spec.checkpoint.persistent.uri", "/mnt/ckpt/llm"),
     ("spec.checkpoint.persistent.uri",)),
    ("a persistent uri the daemons cannot write is rejected, naming the scheme they write",
     "TrainingJob",
     setting("spec.checkpoint.persistent.uri", "s3://bucket/llm"),
     ("spec.checkpoint.persistent.uri must be a file:/// URI", "not s3://")),
    ("a persistent tier without uri is rejected", "TrainingJob",
     removing("spec.checkpoint.persistent.uri"),
     ("spec.checkpoint.persistent.uri: Required value",)),
    ("an unknown recovery level is rejected", "TrainingJob",
     setting("spec.recovery.levels", ["InPlace", "Pray"]), ("spec.recovery.levels[1]",)),
    ("a recovery level listed twice is rejected", "TrainingJob",
     setting("spec.recovery.levels", ["InPlace", "InPlace"]),
     ("spec.recovery.levels[1]: Duplicate value",)),
    ("negative maxRecoveries are rejected", "TrainingJob",
     setting("spec.recovery.maxRecoveries", -1), ("spec.recovery.maxRecoveries",)),
    # InferenceService
    ("a service without roles is rejected", "InferenceService",
     setting("spec.roles", []), ("spec.roles",)),
    ("nine roles are rejected", "InferenceService",
     setting("spec.roles", [role(f"r{i}") for i in range(9)]), ("spec.roles: Too many",)),
    ("two roles with one name are rejected", "InferenceService",
     setting("spec.roles[1].name", "prefill"), ("spec.roles[1]: Duplicate value",)),
    ("an uppercase role name is rejected", "InferenceService",
     setting("spec.roles[0].name", "Prefill"), ("spec.roles[0].name",)),
    ("a ratio naming an unknown role is rejected", "InferenceService",
     setting("spec.ratio", {"prefill": 4, "encode": 1}),
     ("spec.ratio keys must name roles of spec.roles",)),
    ("a ratio weight of zero is rejected", "InferenceService",
     setting("spec.ratio.decode", 0), ("spec.ratio.decode",)),
    ("experts not matching the decode cards are rejected", "InferenceService",
     setting("spec.roles[1].expertParallel.redundantExperts", 31),
     ("spec.roles[1].expertParallel", "experts + redundantExperts must equal")),
    ("zero experts are rejected", "InferenceService",
     setting("spec.roles[1].expertParallel.experts", 0),
     ("spec.roles[1].expertParallel.experts",)),
    ("negative redundant experts are rejected", "InferenceService",
     setting("spec.roles[1].expertParallel.redundantExperts", -1),
     ("spec.roles[1].expertParallel.redundantExperts",)),
    ("a role minReplicas above its replicas is rejected", "InferenceService",
     setting("spec.roles[0].minReplicas", 5),
     ("spec.roles[0].minReplicas", "spec.roles[].minReplicas must be <= spec.roles[].replicas")),
    ("a negative role minReplicas is rejected", "InferenceService",
     setting("spec.roles[0].minReplicas", -1), ("spec.roles[0].minReplicas",)),
    ("zero cardsPerPod are rejected", "InferenceService",
     setting("spec.roles[0].cardsPerPod", 0), ("spec.roles[0].cardsPerPod",)),
    ("zero podsPerReplica are rejected", "InferenceService",
     setting("spec.roles[0].podsPerReplica", 0), ("spec.roles[0].podsPerReplica",)),
    ("a role without cardsPerPod is rejected", "InferenceService",
     appending("spec.roles", {"name": "embed", "replicas": 1}),
     ("spec.roles[2].cardsPerPod: Required value",)),
    ("a negative inference priority is rejected", "InferenceService",
     setting("spec.priority", -5), ("spec.priority",)),
    ("an unknown autoscaling mode is rejected", "InferenceService",
     autoscaled(mode="Sometimes"), ("spec.autoscaling.mode",)),
    ("an engine the autoscaler cannot read is rejected", "InferenceService",
     autoscaled(engine="TGI"), ("spec.autoscaling.engine", "vLLM", "SGLang", "LlamaCpp")),
    ("autoscaling without targets is rejected", "InferenceService",
     lambda m: m["spec"].update(autoscaling={"mode": "Advisory"}),
     ("spec.autoscaling.targets: Required value",)),
    ("a TTFT target of zero is rejected", "InferenceService",
     lambda m: m["spec"].update(
         autoscaling={"targets": {"ttftMilliseconds": 0, "tpotMilliseconds": 50}}),
     ("spec.autoscaling.targets.ttftMilliseconds",)),
    ("an attainment above 100 percent is rejected", "InferenceService",
     lambda m: m["spec"].update(autoscaling={"targets": {
         "ttftMilliseconds": 2000, "tpotMilliseconds": 50, "attainmentPercent": 101}}),
     ("spec.autoscaling.targets.attainmentPercent",)),
    ("an autoscaling range for an unknown role is rejected", "InferenceService",
     autoscaled(roles=[{"name": "encode", "maxReplicas": 2}]),
     ("spec.autoscaling.roles[].name must name a role of spec.roles",)),
    ("an autoscaling minReplicas above its maxReplicas is rejected", "InferenceService",
     autoscaled(roles=[{"name": "prefill", "minReplicas": 3, "maxReplicas": 2}]),
     ("spec.autoscaling.roles[].minReplicas must be <= spec.autoscaling.roles[].maxReplicas",)),
    ("an autoscaling maxReplicas of zero is rejected", "InferenceService",
     autoscaled(roles=[{"name": "prefill", "maxReplicas": 0}]),
     ("spec.autoscaling.roles[0].maxReplicas",)),
    ("a ratio range beside a fixed ratio is rejected", "InferenceService",
     lambda m: m["spec"].update(autoscaling={
         "targets": {"ttftMilliseconds": 2000, "tpotMilliseconds": 50},
         "ratioRange": DECODE_PER_PREFILL}),
     ("spec.autoscaling.ratioRange replaces spec.ratio",)),
    ("a ratio range with min above max is rejected", "InferenceService",
     autoscaled(ratioRange={"role": "decode", "per": "prefill", "minPercent": 60,
                            "maxPercent": 50}),
     ("spec.autoscaling.ratioRange.minPercent must be <=",)),
    ("a ratio range of a role against itself is rejected", "InferenceService",
     autoscaled(ratioRange={"role": "decode", "per": "decode", "minPercent": 20,
                            "maxPercent": 50}),
     ("spec.autoscaling.ratioRange.per must name another role",)),
    ("a ratio range naming an unknown role is rejected", "InferenceService",
     autoscaled(ratioRange={"role": "decode", "per": "encode", "minPercent": 20,
                            "maxPercent": 50}),
     ("spec.autoscaling.ratioRange.role and .per must name roles of spec.roles",)),
    ("an autoscaling capacity stating no figure is rejected", "InferenceService",
     autoscaled(capacity={}),
     ("spec.autoscaling.capacity must state prefillTokensPerSecond or decodeTokensPerSecond",)),
    ("a prefill capacity of zero tokens/s is rejected", "InferenceService",
     autoscaled(capacity={"prefillTokensPerSecond": 0}),
     ("spec.autoscaling.capacity.prefillTokensPerSecond",)),
    ("a decode capacity above 100M tokens/s is rejected", "InferenceService",
     autoscaled(capacity={"decodeTokensPerSecond": 100_000_001}),
     ("spec.autoscaling.capacity.decodeTokensPerSecond",)),
    ("a stabilization window above an hour is rejected", "InferenceService",
     autoscaled(scaleDownStabilizationSeconds=3601),
     ("spec.autoscaling.scaleDownStabilizationSeconds",)),
    ("a KV cache of 1.5Gi is rejected", "InferenceService",
     setting("spec.kvCache", {"bytes": "1.5Gi"}), ("spec.kvCache.bytes",)),
    ("a KV cache in millibytes is rejected", "InferenceService",
     setting("spec.kvCache", {"bytes": "100m"}), ("spec.kvCache.bytes",)),
    ("a KV cache without a SuperNode is rejected", "InferenceService",
     both(removing("spec.superNode"), setting("spec.kvCache", {"bytes": "64Gi"})),
     ("spec.kvCache needs spec.superNode",)),
    ("a memory pool of a negative size is rejected", "SuperNode",
     setting("spec.memoryPool", {"perNode": "-1Gi"}), ("spec.memoryPool.perNode",)),
    ("a memory pool without perNode is rejected", "SuperNode",
     setting("spec.memoryPool", {}), ("spec.memoryPool.perNode: Required value",)),
    # The operator's own keys in a template (issue 31, finding 3): forged cards, node, restore
    # or job identity never reach a pod.
    ("a template annotating its own cards is rejected", "TrainingJob",
     setting("spec.template.metadata", {"annotations": {"matrixpool.dev/cards": "0,1"}}),
     ("spec.template.metadata.annotations: matrixpool.dev/cards is a key the operator writes",)),
    ("a template asking for a restore is rejected", "TrainingJob",
     setting("spec.template.metadata", {"annotations": {"a": "b", "matrixpool.dev/restore": "{}"}}),
     ("spec.template.metadata.annotations: matrixpool.dev/restore",)),
    ("a template labelled as another job's pod is rejected", "TrainingJob",
     setting("spec.template.metadata", {"labels": {"matrixpool.dev/job-uid": "theirs"}}),
     ("spec.template.metadata.labels: matrixpool.dev/job-uid",)),
    ("a template giving itself the device plugin's cards is rejected", "TrainingJob",
     setting("spec.template.metadata",
             {"annotations": {"deviceplugin.matrixpool.dev/allocated-cards": "0"}}),
     ("spec.template.metadata.annotations: deviceplugin.matrixpool.dev/allocated-cards",)),
    ("a template label that is not a string is rejected", "TrainingJob",
     setting("spec.template.metadata", {"labels": {"team": 7}}),
     ("spec.template.metadata.labels.team",)),
    ("a training template the kubelet would restart in its old run is rejected", "TrainingJob",
     setting("spec.template.spec.restartPolicy", "OnFailure"),
     ("spec.template.spec.restartPolicy: Unsupported value: \"OnFailure\"",)),
    ("a serving template labelled as the operator's is rejected", "InferenceService",
     setting("spec.roles[0].template.metadata", {"labels": {"matrixpool.dev/role": "decode"}}),
     ("spec.roles[].template.metadata.labels: matrixpool.dev/role",)),
]
# fmt: on


def _apply(
    cluster: framework.TestCluster, manifest: Manifest, namespace: str
) -> subprocess.CompletedProcess[str]:
    args = ["apply", "--dry-run=server", "-f", "-"]
    if manifest["kind"] != "SuperNode":
        args += ["-n", namespace]
    return cluster.kubectl(*args, input=yaml.safe_dump(manifest), check=False)


@pytest.mark.parametrize(
    ("kind", "change", "expected"),
    [
        pytest.param(kind, change, expected, id=sentence)
        for sentence, kind, change, expected in INVALID
    ],
)
def test_invalid_resource_is_rejected_naming_the_field(
    cluster: framework.TestCluster,
    namespace: str,
    kind: str,
    change: Change,
    expected: tuple[str, ...],
) -> None:
    manifest = base(kind)
    change(manifest)
    result = _apply(cluster, manifest, namespace)
    assert result.returncode != 0, f"accepted:\n{yaml.safe_dump(manifest)}"
    for text in expected:
        assert text in result.stderr, result.stderr


# fmt: off
VALID_VARIANTS: list[tuple[str, str, Change]] = [
    ("one all-day window is accepted", "SuperNode", windows(("06:00", "06:00"))),
    ("windows in any order wrapping midnight are accepted", "SuperNode",
     windows(("18:00", "02:00"), ("09:30", "18:00"), ("02:00", "09:30"))),
    ("24 one-hour windows are accepted", "SuperNode",
     windows(*[(f"{h:02d}:00", f"{(h + 1) % 24:02d}:00") for h in range(24)])),
    ("a supernode without time-sharing is accepted", "SuperNode", removing("spec.timeSharing")),
    ("singleton card groups of all 8 cards are accepted", "SuperNode",
     setting("spec.cardGroups", [[c] for c in range(8)])),
    ("64 singleton card groups on 64-card nodes are accepted", "SuperNode",
     lambda m: m["spec"].update(cardsPerNode=64, cardGroups=[[c] for c in range(64)])),
    ("one group of all 64 cards is accepted", "SuperNode",
     lambda m: m["spec"].update(cardsPerNode=64, cardGroups=[list(range(64))])),
    ("a selector by expression is accepted", "SuperNode",
     setting("spec.nodeSelector",
             {"matchExpressions": [{"key": "matrixpool.dev/supernode", "operator": "Exists"}]})),
    ("a job with only the required fields is accepted", "TrainingJob",
     lambda m: m.update(spec={"replicas": 1, "cardsPerReplica": 1})),
    ("minReplicas equal to replicas is accepted", "TrainingJob", setting("spec.minReplicas", 32)),
    ("a template with the user's own labels and annotations is accepted", "TrainingJob",
     setting("spec.template.metadata",
             {"labels": {"team": "a", "example.com/matrixpool.dev": "x"},
              "annotations": {"example.com/note": "matrixpool.dev/cards"}})),
    ("a service without ratio is accepted", "InferenceService", removing("spec.ratio")),
    ("advisory autoscaling with a ratio range is accepted", "InferenceService",
     autoscaled(mode="Advisory", ratioRange=DECODE_PER_PREFILL,
                roles=[{"name": "prefill", "minReplicas": 1, "maxReplicas": 4}])),
    ("autoscaling beside a fixed ratio is accepted", "InferenceService", autoscaled()),
    ("autoscaling that reads llama.cpp's server is accepted", "InferenceService",
     autoscaled(engine="LlamaCpp")),
    ("autoscaling with a stated prefill capacity is accepted", "InferenceService",
     autoscaled(capacity={"prefillTokensPerSecond": 20_000})),
    ("autoscaling with both capacities stated is accepted", "InferenceService",
     autoscaled(capacity={"prefillTokensPerSecond": 20_000, "decodeTokensPerSecond": 3_000})),
    ("a KV cache of 512Gi is accepted", "InferenceService",
     setting("spec.kvCache", {"bytes": "512Gi"})),
    ("a memory pool of 256Gi per node is accepted", "SuperNode",
     setting("spec.memoryPool", {"perNode": "256Gi"})),
]
# fmt: on


@pytest.mark.parametrize(
    ("kind", "change"),
    [pytest.param(kind, change, id=sentence) for sentence, kind, change in VALID_VARIANTS],
)
def test_valid_variant_is_accepted(
    cluster: framework.TestCluster, namespace: str, kind: str, change: Change
) -> None:
    manifest = base(kind)
    change(manifest)
    result = _apply(cluster, manifest, namespace)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_is_accepted(cluster: framework.TestCluster, namespace: str, path: Path) -> None:
    for manifest in yaml.safe_load_all(path.read_text()):  # a job with its script's ConfigMap
        assert "namespace" not in manifest["metadata"], "examples must work with kubectl apply -n"
        result = _apply(cluster, manifest, namespace)
        assert result.returncode == 0, result.stderr


def test_defaults_are_filled_in_by_the_api_server(
    cluster: framework.TestCluster, namespace: str
) -> None:
    manifest = base("TrainingJob")
    manifest["spec"] = {"replicas": 2, "cardsPerReplica": 8}
    result = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-o", "yaml", "-f", "-",
        input=yaml.safe_dump(manifest),
    )  # fmt: skip
    spec = yaml.safe_load(result.stdout)["spec"]
    assert spec["priority"] == 100
    assert spec["placement"] == {"superNodeAffinity": "Required", "localityWaitSeconds": 0}
    assert spec["recovery"] == {
        "maxRecoveries": 10,
        "levels": ["InPlace", "SpareSwap", "Reschedule"],
        "restart": "Ranks",
    }
    assert spec["rendezvous"] == {"port": 29500, "procsPerReplica": 1}
    assert "minReplicas" not in spec  # defaulted to replicas by the model, not the CRD
