"""Time windows on the real control plane (first part of issue 6): the operator's scaled clock
drives SuperNode status.window and status.nextTransition across a day → night boundary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.integration import framework, manifests


def test_window_and_next_transition_follow_the_scaled_clock_across_a_boundary(
    cluster: framework.TestCluster, tmp_path: Path
) -> None:
    sn = manifests.supernode("sn-0").spares(1)
    sn.body["spec"]["timeSharing"] = {
        "timezone": "Asia/Shanghai",
        "windows": [
            {"name": "day", "start": "08:00", "end": "22:00", "inferenceCards": 320},
            {"name": "night", "start": "22:00", "end": "08:00", "inferenceCards": 64},
        ],
    }
    cluster.kubectl("apply", "-f", "-", input=sn.yaml())
    # 21:50 in Shanghai, 30x: the 22:00 boundary comes after about 20 real seconds, time for
    # an operator started on a loaded machine to report the day window first (21:58 left it 4 s,
    # and a CI run that shared the machine saw night first).
    operator = framework.Operator(
        cluster,
        tmp_path / "operator.log",
        env={
            "MATRIXPOOL_CLOCK_START": "2026-11-30T21:50:00+08:00",
            "MATRIXPOOL_CLOCK_SPEED": "30",
        },
    ).start()
    try:

        def status(window: str) -> dict[str, Any] | None:
            body = json.loads(cluster.kubectl("get", "sn", "sn-0", "-o", "json").stdout)
            current = body.get("status") or {}
            return current if current.get("window") == window else None

        day = framework.eventually(lambda: status("day"), timeout=20, what="window day")
        assert day["nextTransition"] == "2026-11-30T14:00:00Z"  # 22:00 +08:00
        night = framework.eventually(lambda: status("night"), timeout=60, what="window night")
        assert night["nextTransition"] == "2026-12-01T00:00:00Z"  # 08:00 +08:00
        row = cluster.kubectl("get", "sn", "sn-0", "--no-headers").stdout.split()
        assert "night" in row
    finally:
        operator.kill()
        cluster.kubectl("delete", "sn", "sn-0", check=False)
        print(operator.log()[-5000:])
