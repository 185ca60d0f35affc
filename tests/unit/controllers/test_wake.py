"""The main loop's alarm (controllers.wake): which events bring the next pass forward."""

from __future__ import annotations

import asyncio
import logging

import kopf

from matrixpool.controllers import wake


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
