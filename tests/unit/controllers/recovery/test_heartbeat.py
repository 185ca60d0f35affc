"""The kubelets' Leases on the operator's clock
(:mod:`matrixpool.controllers.recovery.heartbeat`): when a Lease is stale, when many stale at
once mean the API server, and how the Lease index reads one."""

from __future__ import annotations

from matrixpool.controllers.recovery import heartbeat
from matrixpool.k8s import nodeleases


def test_many_overdue_leases_at_once_mean_the_api_server_not_the_nodes() -> None:
    leases = {f"n{i}": (50.0 if i < 3 else 95.0, 40.0) for i in range(12)}  # a quarter overdue
    assert heartbeat.stale_leases(leases, now=100.0) == frozenset()


def test_lease_age_is_measured_from_when_its_renew_time_last_changed_on_the_operators_clock() -> (
    None
):
    leases = heartbeat.LeaseClock()
    fleet = {f"ok-{i}": (float(i), 40.0) for i in range(10)}
    skewed = {**fleet, "n1": (-3600.0, 40.0)}  # the kubelet's clock is an hour behind
    assert leases.observe(skewed, now=1000.0) == frozenset(), "a fresh start gives full grace"
    assert leases.observe({**fleet, "n1": (-3590.0, 40.0)}, now=1010.0) == frozenset()
    assert leases.observe({**fleet, "n1": (-3580.0, 40.0)}, now=1039.0) == frozenset()
    renewed_fleet = {n: (r + 60.0, d) for n, (r, d) in fleet.items()}
    silent = {**renewed_fleet, "n1": (-3580.0, 40.0)}  # n1 stops renewing at 1039
    assert leases.observe(silent, now=1068.0) == frozenset()  # 29 s < 30 s
    assert leases.observe(silent, now=1070.0) == {"n1"}  # 31 s without a change
    assert leases.observe({**renewed_fleet, "n1": (-3570.0, 40.0)}, now=1071.0) == frozenset()
    leases.observe(renewed_fleet, now=1072.0)
    assert "n1" not in leases.seen, "a node whose Lease went is forgotten"


def test_a_kubelet_lease_reads_renew_time_and_duration() -> None:
    spec = {"renewTime": "2026-11-30T05:00:00.000000Z", "leaseDurationSeconds": 40}
    assert nodeleases.parse("n3", spec) == (1796014800.0, 40.0)
    assert nodeleases.parse("n4", {}) is None
    assert nodeleases.parse("n5", {"renewTime": "2026-11-30T05:00:00Z"}) == (1796014800.0, 40.0)


def test_the_loop_says_once_which_kubelet_lease_went_overdue() -> None:
    from structlog.testing import capture_logs

    from matrixpool.controllers import loop

    state = loop.Controllers()
    fleet = {f"n{i}": (100.0, 40.0) for i in range(8)}
    assert loop.overdue(state, fleet, now=1000.0) == frozenset()
    renewed = {n: (110.0, 40.0) for n in fleet if n != "n3"}
    with capture_logs() as logs:
        assert loop.overdue(state, {**fleet, **renewed}, now=1031.0) == {"n3"}
        assert loop.overdue(state, {**fleet, **renewed}, now=1032.0) == {"n3"}  # said once
    said = [e for e in logs if e["event"].startswith("kubelet Lease overdue")]
    assert [e["node"] for e in said] == ["n3"]
    assert said[0]["unchanged_s"] == 31.0
    assert state.overdue == {"n3"}
