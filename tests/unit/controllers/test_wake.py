"""The main loop's alarm (controllers.wake): which events bring the next pass forward."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import kopf
import pytest

from matrixpool import clock
from matrixpool.controllers import wake
from matrixpool.k8s import daemonleases, nodefaults


def test_a_new_job_a_new_spec_and_a_deletion_are_news_a_status_patch_is_not() -> None:
    alarm = wake.Wake()
    assert alarm.news("ADDED", "u1", 1)
    alarm.saw("ADDED", "u1", 1)
    assert not alarm.news("MODIFIED", "u1", 1)  # status patches keep the generation
    assert alarm.news("MODIFIED", "u1", 2)
    alarm.saw("MODIFIED", "u1", 2)
    assert not alarm.news("MODIFIED", "u1", 2)
    assert alarm.news("DELETED", "u1", 2)
    alarm.saw("DELETED", "u1", 2)
    assert alarm.generations == {}
    assert alarm.news(None, "u2", 1)  # the first listing: seen once, then quiet
    alarm.saw(None, "u2", 1)
    assert not alarm.news(None, "u2", 1)


def test_sleep_returns_when_rung_and_keeps_a_ring_that_comes_during_a_pass() -> None:
    async def scenario() -> list[bool]:
        alarm = wake.Wake()
        results = [await alarm.sleep(0.01)]  # nothing rang: the tick
        asyncio.get_running_loop().call_later(0.01, alarm.ring)
        results.append(await alarm.sleep(5))  # woken long before 5 s
        alarm.ring()  # rung while the pass ran
        alarm.ring()  # twice: still one pass
        results.append(await alarm.sleep(5))
        results.append(await alarm.sleep(0.01))
        return results

    assert asyncio.run(scenario()) == [False, True, True, False]


def test_the_handlers_ring_the_operators_alarm_and_log_nothing() -> None:
    memo = kopf.Memo()
    wake.install(memo=memo)
    alarm = wake.of(memo)
    assert alarm is not None
    body = kopf.Body({"metadata": {"uid": "u1", "generation": 3}})
    assert wake._workload_news(type="ADDED", body=body, memo=memo)
    asyncio.run(wake.workload_changed(type="ADDED", body=body, memo=memo))
    assert alarm.event.is_set()
    assert alarm.generations == {"u1": 3}
    assert not wake._workload_news(type="MODIFIED", body=body, memo=memo)
    alarm.event.clear()
    assert wake._gone(type="DELETED")
    assert not wake._gone(type="MODIFIED")
    asyncio.run(wake.pod_gone(memo=memo))
    assert alarm.event.is_set()
    assert wake.of(kopf.Memo()) is None
    assert wake.of(None) is None
    quiet = [f for f in logging.getLogger("kopf.objects").filters if isinstance(f, logging.Filter)]
    record = logging.LogRecord(
        "kopf.objects", logging.INFO, "", 0, "Handler 'pod_gone' succeeded.", None, None
    )
    assert not all(f.filter(record) for f in quiet)
    other = logging.LogRecord(
        "kopf.objects", logging.INFO, "", 0, "Handler 'x' succeeded.", None, None
    )
    assert all(f.filter(other) for f in quiet)


def node_body(ready: str = "True", unhealthy: str = "", beat: str = "t0") -> kopf.Body:
    annotations = {"matrixpool.dev/unhealthy-cards": unhealthy} if unhealthy else {}
    return kopf.Body(
        {
            "metadata": {
                "name": "n1",
                "labels": {"matrixpool.dev/rack": "r0"},
                "annotations": annotations,
            },
            "spec": {},
            "status": {
                "allocatable": {"huawei.com/Ascend910": "8"},
                "conditions": [{"type": "Ready", "status": ready, "lastHeartbeatTime": beat}],
            },
        }
    )


def test_a_node_wakes_the_loop_when_its_health_changes_not_on_a_heartbeat() -> None:
    memo = kopf.Memo()
    wake.install(memo=memo)
    alarm = wake.of(memo)
    assert alarm is not None

    def news(type: str | None, body: kopf.Body) -> bool:
        found = wake._node_news(type=type, name="n1", body=body, memo=memo)
        if found:
            asyncio.run(wake.node_changed(type=type, name="n1", body=body, memo=memo))
        return found

    assert news(None, node_body())  # first seen (the listing)
    assert not news("MODIFIED", node_body(beat="t1"))  # a heartbeat: nothing the loop reads
    assert news("MODIFIED", node_body(ready="False", beat="t2"))  # the fault
    assert not news("MODIFIED", node_body(ready="False", beat="t3"))
    assert news("MODIFIED", node_body(ready="False", unhealthy="3", beat="t4"))
    assert news("DELETED", node_body(ready="False", unhealthy="3"))
    assert not news("DELETED", node_body())  # gone already
    assert alarm.event.is_set()


def test_a_node_fault_is_stamped_when_the_watch_shows_it_and_makes_the_wake_urgent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Node watch on its thread (k8s.nodefaults) stamps; the alarm keeps the first stamp of
    each fault and forgets a fault the node no longer shows."""
    now = [50.0]
    monkeypatch.setattr(clock.SYSTEM, "monotonic", lambda: now[0])
    alarm = wake.Wake()
    watch = nodefaults.NodeFaults(alarm.node_faults)  # on the thread: via call_soon_threadsafe

    def event(type: str | None, body: kopf.Body) -> None:
        if type is None:
            watch._listed([body])
        else:
            watch._event(type, body)

    event(None, node_body())
    assert alarm.noticed == {}
    assert not alarm.urgent
    event("MODIFIED", node_body(ready="False", beat="t1"))
    assert set(alarm.noticed) == {("n1", "down")}
    assert alarm.urgent
    assert alarm.noticed["n1", "down"][0] == 50.0
    alarm.calm()
    now[0] = 51.0
    event("MODIFIED", node_body(ready="Unknown", unhealthy="3", beat="t2"))
    assert alarm.noticed["n1", "down"][0] == 50.0  # still down: the first stamp stays
    assert alarm.noticed["n1", "card:3"][0] == 51.0
    assert alarm.urgent
    alarm.calm()
    event("MODIFIED", node_body(unhealthy="3", beat="t3"))  # Ready again, card 3 still bad
    assert set(alarm.noticed) == {("n1", "card:3")}
    assert not alarm.urgent
    now[0] = 52.0
    event("DELETED", node_body(unhealthy="3"))
    assert set(alarm.noticed) == {("n1", "deleted")}
    assert alarm.urgent
    event(None, node_body())  # created again, healthy
    assert alarm.noticed == {}
    alarm.calm()
    now[0] = 53.0
    watch._listed([])  # a listing after 410 no longer has it: deleted while not watching
    assert set(alarm.noticed) == {("n1", "deleted")}
    assert alarm.noticed["n1", "deleted"][0] == 53.0


def test_a_stamp_is_when_the_watch_thread_saw_the_event_not_when_the_loop_got_to_it() -> None:
    """The thread hands the stamp it took to the alarm on the event loop; a loop busy for a
    while still dates the fault by the thread's stamp."""

    async def scenario() -> tuple[float, float, float]:
        alarm, loop = wake.Wake(), asyncio.get_running_loop()

        def report(name: str, faults: list[str], stamp: nodefaults.Stamp) -> None:
            loop.call_soon_threadsafe(alarm.node_faults, name, faults, stamp)

        watch = nodefaults.NodeFaults(report)
        thread = threading.Thread(target=watch._event, args=("MODIFIED", node_body("False")))
        before = clock.SYSTEM.monotonic()
        thread.start()
        thread.join()
        time.sleep(0.2)  # the loop is busy: it cannot run the handover yet
        assert alarm.noticed == {}
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return before, alarm.noticed["n1", "down"][0], clock.SYSTEM.monotonic()

    before, stamped, after = asyncio.run(scenario())
    assert before <= stamped < before + 0.1
    assert after - stamped >= 0.2


def test_a_daemon_lease_wakes_the_loop_when_it_appears_restarts_or_goes_not_on_renewal() -> None:
    memo = kopf.Memo()
    wake.install(memo=memo)

    def lease(renewed: str, acquired: str = "2026-12-05T08:00:00.000000Z") -> kopf.Body:
        return kopf.Body(
            {
                "metadata": {
                    "name": daemonleases.lease_name("n1"),
                    "annotations": {"matrixpool.dev/ckpt-endpoint": "127.1.0.1:7070"},
                },
                "spec": {
                    "holderIdentity": "n1",
                    "leaseDurationSeconds": 10,
                    "acquireTime": acquired,
                    "renewTime": renewed,
                },
            }
        )

    def news(type: str | None, body: kopf.Body, namespace: str = "default") -> bool:
        name = daemonleases.lease_name("n1")
        found = wake._lease_news(type=type, name=name, namespace=namespace, body=body, memo=memo)
        if found:
            asyncio.run(wake.daemon_lease_changed(type=type, name=name, body=body, memo=memo))
        return found

    first = lease("2026-12-05T08:00:00.000000Z")
    assert not news("ADDED", kopf.Body({"metadata": {"name": "x"}, "spec": {}}))  # says nothing
    assert not news("ADDED", first, namespace="elsewhere")  # not the operator's namespace
    assert news("ADDED", first)
    assert not news("MODIFIED", lease("2026-12-05T08:00:05.000000Z"))  # a renewal
    restarted = lease("2026-12-05T08:01:00.000000Z", acquired="2026-12-05T08:01:00.000000Z")
    assert news("MODIFIED", restarted)
    assert news("DELETED", restarted)
