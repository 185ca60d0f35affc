"""The checkpoint daemons' Leases (matrixpool.k8s.daemonleases): their shape, how the operator
reads them, and how an announcer creates and renews one (against a fake coordination API that
answers as the API server does: 404 for a missing Lease, 409 for one created meanwhile)."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import kubernetes
import pytest

from matrixpool.api import labels
from matrixpool.devcluster import sim
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import daemonleases

NOW = datetime.datetime(2026, 11, 30, 12, 0, 0, 250000, tzinfo=datetime.UTC)


def test_a_lease_names_its_node_and_endpoint_and_is_labelled() -> None:
    lease = daemonleases.body("sn-0-node-07", "10.0.0.7:7040", 40, NOW)
    assert lease["metadata"]["name"] == "matrixpool-daemon-sn-0-node-07"
    assert lease["metadata"]["labels"] == {labels.CKPT_DAEMON: "true"}
    assert lease["metadata"]["annotations"] == {labels.CKPT_ENDPOINT: "10.0.0.7:7040"}
    assert lease["spec"]["holderIdentity"] == "sn-0-node-07"
    assert lease["spec"]["renewTime"] == "2026-11-30T12:00:00.250000Z"
    meta = lease["metadata"]
    assert daemonleases.parse(
        meta["name"], meta["annotations"], lease["spec"]
    ) == daemonleases.Announced(
        "sn-0-node-07", "10.0.0.7:7040", NOW.timestamp(), 40.0, NOW.timestamp()
    )


@pytest.mark.parametrize(
    ("annotations", "spec"),
    [
        pytest.param(
            {}, {"holderIdentity": "n", "renewTime": "2026-11-30T12:00:00Z"}, id="no endpoint"
        ),
        pytest.param(
            {labels.CKPT_ENDPOINT: "a:1"}, {"renewTime": "2026-11-30T12:00:00Z"}, id="no node"
        ),
        pytest.param({labels.CKPT_ENDPOINT: "a:1"}, {"holderIdentity": "n"}, id="never renewed"),
    ],
)
def test_a_lease_missing_a_part_announces_nothing(
    annotations: dict[str, str], spec: dict[str, Any]
) -> None:
    assert daemonleases.parse("matrixpool-daemon-n", annotations, spec) is None


def test_a_lease_written_for_another_node_announces_nothing() -> None:
    """Issue 31, finding 6: node n2's announcer may write n2's Lease only; a Lease named for n2
    that says it is n1's daemon is ignored."""
    lease = daemonleases.body("n1", "10.0.0.2:7040", 40, NOW)
    assert (
        daemonleases.parse("matrixpool-daemon-n2", lease["metadata"]["annotations"], lease["spec"])
        is None
    )


@pytest.mark.parametrize(
    ("endpoint", "address", "believed"),
    [
        ("10.0.0.7:7040", "10.0.0.7", True),
        ("[fd00::7]:7040", "fd00::7", True),
        ("10.0.0.8:7040", "10.0.0.7", False),  # another host: it would get the operator's token
        ("evil.example:7040", "10.0.0.7", False),
        ("10.0.0.7:7040", "", False),  # a node without an InternalIP: nothing to compare
    ],
)
def test_an_endpoint_counts_only_at_its_nodes_internal_ip(
    endpoint: str, address: str, believed: bool
) -> None:
    assert daemonleases.on_node(endpoint, address) is believed


def test_the_loop_gives_a_node_only_an_endpoint_at_its_own_address() -> None:
    from matrixpool.controllers import loop
    from tests.unit import worlds

    nodes = list(worlds.fixed_world({}, []).nodes)[:2]
    mine, theirs = (
        dataclasses.replace(n, address=f"10.0.0.{i}", endpoint="") for i, n in enumerate(nodes)
    )
    announced = {
        mine.name: daemonleases.Announced(mine.name, "10.0.0.0:7040", 0.0, 40.0, 0.0),
        theirs.name: daemonleases.Announced(theirs.name, "10.9.9.9:7040", 0.0, 40.0, 0.0),
    }
    seen = {n.name: n.endpoint for n in loop.with_endpoints([mine, theirs], announced)}
    assert seen == {mine.name: "10.0.0.0:7040", theirs.name: ""}


def test_long_node_names_get_distinct_valid_lease_names() -> None:
    a, b = "x" * 250 + "a", "x" * 250 + "b"
    names = {daemonleases.lease_name(a), daemonleases.lease_name(b)}
    assert len(names) == 2
    assert all(len(n) <= 253 for n in names)


class Coordination:
    """Leases by name, answering as the API server does."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.race = False  # a create answered 409: another announcer made it first

    def patch_namespaced_lease(self, name: str, namespace: str, patch: dict[str, Any]) -> None:
        self.calls.append("patch")
        if name not in self.leases:
            raise kubernetes.client.ApiException(status=404)
        lease = self.leases[name]
        lease["spec"].update(patch.get("spec", {}))
        annotations = lease["metadata"]["annotations"]
        for key, value in ((patch.get("metadata") or {}).get("annotations") or {}).items():
            if value is None:
                annotations.pop(key, None)  # a merge patch's null removes the key
            else:
                annotations[key] = value

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append("create")
        if self.race:
            self.leases[body["metadata"]["name"]] = daemonleases.body("n1", "old:1", 40, NOW)
            raise kubernetes.client.ApiException(status=409)
        self.leases[body["metadata"]["name"]] = body

    def delete_namespaced_lease(self, name: str, namespace: str) -> None:
        self.calls.append("delete")
        if self.leases.pop(name, None) is None:
            raise kubernetes.client.ApiException(status=404)


def api(coordination: Coordination) -> k8s_client.Api:
    return k8s_client.Api(None, None, None, None, coordination)


def test_an_announcer_creates_the_lease_then_renews_only_its_time() -> None:
    fake = Coordination()
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=NOW, first=True)
    assert fake.calls == ["patch", "create"]
    later = NOW + datetime.timedelta(seconds=10)
    fake.leases["matrixpool-daemon-n1"]["metadata"]["annotations"][labels.CKPT_ENDPOINT] = "p:9"
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=later)
    lease = fake.leases["matrixpool-daemon-n1"]
    assert lease["spec"]["renewTime"] == "2026-11-30T12:00:10.250000Z"
    assert lease["metadata"]["annotations"][labels.CKPT_ENDPOINT] == "p:9", "left as it was"


def test_a_restarted_announcer_writes_its_endpoint_again_and_a_lost_race_renews() -> None:
    fake = Coordination()
    fake.race = True
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=NOW, first=True)
    assert fake.calls == ["patch", "create", "patch"]
    lease = fake.leases["matrixpool-daemon-n1"]
    assert lease["metadata"]["annotations"][labels.CKPT_ENDPOINT] == "10.0.0.1:7040"


def test_a_daemon_that_starts_again_moves_acquire_time_and_a_renewal_does_not() -> None:
    fake = Coordination()
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=NOW, first=True)
    lease = fake.leases["matrixpool-daemon-n1"]
    later = NOW + datetime.timedelta(seconds=10)
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=later)
    assert lease["spec"]["acquireTime"] == "2026-11-30T12:00:00.250000Z"
    again = NOW + datetime.timedelta(seconds=60)
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=again, first=True)
    seen = daemonleases.parse(
        lease["metadata"]["name"], lease["metadata"]["annotations"], lease["spec"]
    )
    assert seen is not None
    assert seen.started == again.timestamp()


def test_a_stopped_sim_withdraws_its_daemons_lease_and_a_second_withdrawal_is_no_error() -> None:
    fake = Coordination()
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=NOW, first=True)
    sim.withdraw_lease(api(fake), "ops", "n1")
    sim.withdraw_lease(api(fake), "ops", "n1")
    assert fake.leases == {}
    assert fake.calls[-2:] == ["delete", "delete"]


def test_a_daemon_stopped_on_purpose_is_restarting_for_the_grace_until_the_next_one_announces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = Coordination()
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=NOW, first=True)
    lease = fake.leases["matrixpool-daemon-n1"]

    def seen() -> daemonleases.Announced:
        parsed = daemonleases.parse(
            lease["metadata"]["name"], lease["metadata"]["annotations"], lease["spec"]
        )
        assert parsed is not None
        return parsed

    assert seen().stopping is None
    assert daemonleases.restarting({"n1": seen()}, NOW.timestamp()) == frozenset()
    # SIGTERM (the pod deleted by a rollout): the announcer's loop ends and marks the Lease
    monkeypatch.setattr(daemonleases, "healthy", lambda endpoint: True)
    said: list[str] = []
    stops = iter([False, True, True, True])
    daemonleases.run(api(fake), "ops", "n1", "10.0.0.1:7040", duration=4,
                     stopped=lambda: next(stops), log=said.append)  # fmt: skip
    stopped_at = seen().stopping
    assert stopped_at is not None
    assert said == ["announce: matrixpool-daemon-n1 marked stopping"]
    assert lease["spec"]["holderIdentity"] == "n1"  # what the daemons' Lease policy requires
    grace = daemonleases.RESTART_GRACE_SECONDS
    assert daemonleases.restarting({"n1": seen()}, stopped_at + 1) == {"n1"}
    assert daemonleases.restarting({"n1": seen()}, stopped_at + grace + 1) == frozenset()
    # The next daemon's first renewal: no longer stopping
    later = NOW + datetime.timedelta(seconds=30)
    daemonleases.announce(api(fake), "ops", "n1", "10.0.0.1:7040", now=later, first=True)
    assert seen().stopping is None
    assert labels.CKPT_STOPPING not in lease["metadata"]["annotations"]


def test_a_daemon_that_crashed_is_not_marked_stopping(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Coordination()
    monkeypatch.setattr(daemonleases, "healthy", lambda endpoint: True)

    class CrashError(Exception):
        pass

    def stopped() -> bool:
        if fake.calls:  # killed after its first renewal, not by SIGTERM
            raise CrashError
        return False

    with pytest.raises(CrashError):
        daemonleases.run(api(fake), "ops", "n1", "10.0.0.1:7040", duration=4, stopped=stopped)
    lease = fake.leases["matrixpool-daemon-n1"]
    assert labels.CKPT_STOPPING not in lease["metadata"]["annotations"]


def test_the_loop_counts_a_daemon_stopped_on_purpose_as_restarting_if_its_kubelet_renews() -> None:
    from matrixpool.controllers import loop

    now = NOW.timestamp()
    announced = {
        "rolled": daemonleases.Announced("rolled", "10.0.0.1:7040", now - 5, 40.0, 0.0, now - 3),
        "crashed": daemonleases.Announced("crashed", "10.0.0.2:7040", now - 5, 40.0, 0.0),
        "cut": daemonleases.Announced("cut", "10.0.0.3:7040", now - 5, 40.0, 0.0, now - 3),
        "long": daemonleases.Announced("long", "10.0.0.4:7040", now - 5, 40.0, 0.0, now - 600),
    }
    silent = frozenset(announced)
    unreachable, restarting = loop.daemons_down(silent, announced, frozenset({"cut"}), now)
    assert restarting == {"rolled"}
    assert unreachable == {"crashed", "cut", "long"}  # a crash, a lost node, a daemon gone for good
