"""The TrainingJob CRD on the real kube-apiserver takes what the recovery handler writes for
large jobs and long runs: a status.recovering plan of 4,097 ranks (past the old 4,096 bound)
is accepted; status.recoveries holds at most ``KEPT_RECOVERIES`` entries, and the handler's
trimmed history (newest entries, ``recoveryCount`` counting all) is what the server keeps.

The status is written with ``kubectl patch --subresource=status``, as the operator's merge
patches are; no operator runs, and the job names a SuperNode that does not exist, so nothing
else writes its status meanwhile.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest

from matrixpool.api import common, trainingjob
from matrixpool.controllers.recovery import carry_out
from tests.integration import framework, manifests
from tests.unit.controllers.recovery.test_limits import reschedule_plan

pytestmark = pytest.mark.integration

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
BIG = 4097
KEPT = trainingjob.KEPT_RECOVERIES


def create_job(cluster: framework.TestCluster, namespace: str, name: str, ranks: int) -> None:
    job = manifests.training_job(name).replicas(ranks).cards(1).on("no-such-supernode")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())


def patch_status(
    cluster: framework.TestCluster,
    namespace: str,
    name: str,
    status: dict[str, Any],
    folder: Path,
    *,
    check: bool = True,
) -> str:
    """Merge-patch status through the status subresource; the patch goes in a file (it is
    large). Returns kubectl's stderr."""
    patch = folder / f"{name}-status.json"
    patch.write_text(json.dumps({"status": status}))
    result = cluster.kubectl(
        "patch", "trainingjob", name, "-n", namespace, "--subresource=status",
        "--type=merge", f"--patch-file={patch}", check=check,
    )  # fmt: skip
    return result.stderr


def status_of(cluster: framework.TestCluster, namespace: str, name: str) -> dict[str, Any]:
    body = json.loads(
        cluster.kubectl("get", "trainingjob", name, "-n", namespace, "-o", "json").stdout
    )
    return dict(body.get("status") or {})


def entry(i: int) -> dict[str, Any]:
    record = trainingjob.RecoveryRecord(
        id=f"r{i}",
        level=trainingjob.RecoveryLevel.IN_PLACE,
        cause="PodFailed",
        restored_step=i,
        detected_at=T0,
        recovered_at=T0 + datetime.timedelta(seconds=2),
    )
    return common.to_wire(record)


@pytest.mark.parametrize("ranks", [BIG, trainingjob.MAX_RANKS], ids=["4,097", "1,000,000"])
def test_a_recovering_plan_of_many_ranks_is_accepted(
    cluster: framework.TestCluster, namespace: str, tmp_path: Path, ranks: int
) -> None:
    create_job(cluster, namespace, "big", ranks)
    plan = reschedule_plan(ranks, namespace, "big")
    try:
        patch_status(
            cluster, namespace, "big", {"phase": "Recovering", "recovering": plan}, tmp_path
        )
        stored = status_of(cluster, namespace, "big")["recovering"]
    finally:  # an operator started by a later test must not find a job of a million ranks
        cluster.kubectl("delete", "trainingjob", "big", "-n", namespace, "--wait=true")
    assert stored["rankCount"] == ranks
    assert stored["ranks"] == list(range(trainingjob.RANKS_LISTED))
    parsed = trainingjob.parse_status({"recovering": stored}).recovering
    assert parsed is not None
    assert all(trainingjob.restore_for(parsed.restore, r) for r in (0, ranks // 2, ranks - 1))


def test_more_recoveries_than_kept_are_rejected_and_the_trimmed_history_is_kept(
    cluster: framework.TestCluster, namespace: str, tmp_path: Path
) -> None:
    create_job(cluster, namespace, "long", 4)
    overlong = {"recoveries": [entry(i) for i in range(KEPT + 1)]}
    error = patch_status(cluster, namespace, "long", overlong, tmp_path, check=False)
    assert f"must have at most {KEPT} items" in error, error
    full = {"recoveries": [entry(i) for i in range(KEPT)], "recoveryCount": 57}
    patch_status(cluster, namespace, "long", full, tmp_path)
    next_one = carry_out.recorded(status_of(cluster, namespace, "long"), entry(KEPT))
    patch_status(cluster, namespace, "long", next_one, tmp_path)
    stored = status_of(cluster, namespace, "long")
    assert [r["id"] for r in stored["recoveries"]] == [f"r{i}" for i in range(1, KEPT + 1)]
    assert stored["recoveryCount"] == 58
