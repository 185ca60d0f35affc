"""The simulated inference server (matrixpool.serving.server and ``python -m
matrixpool.serving``), through aiohttp's test client.

Two kinds of test: on the real clock with a fast model (a prefill of 100 tokens takes 1 ms, a
decode step 2 ms), asserting only the order of what arrives; and on a clock the test holds,
where nothing moves until the test moves it, for counts and gauges at a known instant.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import test_utils, web
from prometheus_client.parser import text_string_to_metric_families

from matrixpool.serving import __main__ as entry
from matrixpool.serving import engine, latency, server

ROOT = Path(__file__).resolve().parents[3]
FAST = latency.LatencyModel(
    prefill_tokens_per_s_per_card=100_000,
    decode_base_s=0.002,
    decode_per_sequence_s=0.0001,
    attention_share=0.0,
    kv_bytes_per_token=1_000,
    local_bytes_per_s=1e9,
    remote_bytes_per_s=1e9,
)


class HeldClock:
    """A clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


Scenario = Callable[[test_utils.TestClient[web.Request, web.Application]], Awaitable[None]]


def run(app: web.Application, scenario: Scenario) -> None:
    async def main() -> None:
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            await scenario(client)

    asyncio.run(main())


def fast_app(**options: Any) -> web.Application:
    """The app around an engine on the fast model; options as Engine's keywords."""
    return server.create_app(engine.Engine(model=FAST, **options), model_name="m")


def held_app(clock: HeldClock, **options: Any) -> web.Application:
    return server.create_app(engine.Engine(model=FAST, **options), model_name="m", clock=clock)


def body(prompt: Any = (1, 2, 3), max_tokens: int = 5, stream: bool = False) -> dict[str, Any]:
    prompt = list(prompt) if isinstance(prompt, tuple) else prompt
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


async def read_events(response: aiohttp.ClientResponse) -> list[tuple[float, str]]:
    """The ``data:`` payloads of an SSE response, each with the loop time it arrived at."""
    loop = asyncio.get_running_loop()
    events = []
    async for line in response.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            events.append((loop.time(), text.removeprefix("data: ")))
    return events


def samples(text: str) -> dict[str, float]:
    """Metric samples by name (and a label besides model_name, if any) from /metrics."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == "m", sample
            extra = [f"{k}={v}" for k, v in sample.labels.items() if k != "model_name"]
            found[sample.name + "".join(f"{{{e}}}" for e in extra)] = sample.value
    return found


# --- completions ------------------------------------------------------------------------------
def test_a_stream_sends_one_chunk_per_token_as_they_come_then_done() -> None:
    async def scenario(client: Any) -> None:
        sent = asyncio.get_running_loop().time()
        response = await client.post("/v1/completions", json=body(max_tokens=20, stream=True))
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        events = await read_events(response)
        chunks = [json.loads(data) for _, data in events[:-1]]
        assert events[-1][1] == "[DONE]"
        assert [c["choices"][0]["text"] for c in chunks] == [f" t{i}" for i in range(20)]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 19 + ["length"]
        assert events[0][0] < events[-2][0]
        # the last token is not sent before the engine's time for it: 19 steps of 2.1 ms
        assert events[-2][0] - sent >= 19 * 0.0021

    run(fast_app(), scenario)


def test_a_whole_answer_reports_usage() -> None:
    async def scenario(client: Any) -> None:
        response = await client.post("/v1/completions", json=body(prompt=[5] * 40, max_tokens=4))
        answer = await response.json()
        assert response.status == 200
        assert answer["usage"] == {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44}
        assert answer["choices"][0]["text"] == " t0 t1 t2 t3"
        text = await client.post("/v1/completions", json=body(prompt="nine char", max_tokens=1))
        assert (await text.json())["usage"]["prompt_tokens"] == 3  # 9 characters / 4, rounded up

    run(fast_app(), scenario)


def test_a_prefill_instance_answers_with_the_first_token_only() -> None:
    async def scenario(client: Any) -> None:
        response = await client.post("/v1/completions", json=body(max_tokens=50))
        assert (await response.json())["usage"]["completion_tokens"] == 1

    run(fast_app(role=engine.Role.PREFILL), scenario)


@pytest.mark.parametrize(
    "payload",
    [
        [1, 2],
        {"prompt": [1], "max_tokens": 1},
        {"model": "m", "prompt": [], "max_tokens": 1},
        {"model": "m", "prompt": ["a", "b"], "max_tokens": 1},
        {"model": "m", "prompt": [1], "max_tokens": 0},
        {"model": "m", "prompt": [1], "max_tokens": True},
        {"model": "m", "prompt": [1], "stream": "yes"},
        {"model": "m", "prompt": [1] * 300, "max_tokens": 1},
    ],
    ids=[
        "not an object",
        "no model",
        "an empty prompt",
        "a list of strings",
        "no token to make",
        "a boolean for max_tokens",
        "a string for stream",
        "more than the KV cache holds",
    ],
)
def test_a_bad_request_is_a_400_and_takes_nothing(payload: Any) -> None:
    async def scenario(client: Any) -> None:
        response = await client.post("/v1/completions", json=payload)
        assert response.status == 400
        assert (await response.json())["error"]["message"]
        assert client.app[server.STATE].engine.idle

    run(fast_app(kv_capacity_tokens=200), scenario)


def test_a_body_that_is_not_json_is_a_400() -> None:
    async def scenario(client: Any) -> None:
        response = await client.post("/v1/completions", data=b"{nope")
        assert response.status == 400

    run(fast_app(), scenario)


def test_prefix_hashes_of_a_token_prompt_reach_the_cache_hook() -> None:
    asked: list[str] = []

    def cache(prefix_hash: str) -> engine.Hit | None:
        asked.append(prefix_hash)
        return None

    async def scenario(client: Any) -> None:
        prompt = list(range(40))
        await client.post("/v1/completions", json=body(prompt=prompt, max_tokens=1))
        assert asked == list(reversed(engine.block_hashes(prompt)))

    run(fast_app(prefix_cache=cache), scenario)


# --- metrics ----------------------------------------------------------------------------------
def test_metrics_carry_vllm_names_and_count_finished_requests() -> None:
    async def scenario(client: Any) -> None:
        for _ in range(2):
            await client.post("/v1/completions", json=body(prompt=[1] * 10, max_tokens=3))
        response = await client.get("/metrics")
        assert response.headers["Content-Type"].startswith("text/plain")
        found = samples(await response.text())
        assert found["vllm:num_requests_running"] == 0
        assert found["vllm:num_requests_waiting"] == 0
        assert found["vllm:kv_cache_usage_perc"] == 0
        assert found["vllm:request_success_total"] == 2
        assert found["vllm:prompt_tokens_total"] == 20
        assert found["vllm:generation_tokens_total"] == 6
        for name in ("time_to_first_token", "request_time_per_output_token", "e2e_request_latency"):
            assert found[f"vllm:{name}_seconds_count"] == 2
            assert found[f"vllm:{name}_seconds_sum"] > 0
        assert found["matrixpool_serving_busy_seconds_total"] > 0

    run(fast_app(), scenario)


def test_gauges_show_a_request_in_flight() -> None:
    """With the clock held at the arrival, the request is prefilling: running, KV reserved."""
    clock = HeldClock()

    async def scenario(client: Any) -> None:
        answer = asyncio.create_task(client.post("/v1/completions", json=body(max_tokens=7)))
        found: dict[str, float] = {}
        for _ in range(500):  # until the server has taken the request
            found = samples(await (await client.get("/metrics")).text())
            if found["vllm:num_requests_running"] == 1:
                break
        assert found["vllm:kv_cache_usage_perc"] == pytest.approx((3 + 7) / 1_000)
        assert found["vllm:request_success_total"] == 0
        clock.now = 1.0
        client.app[server.STATE].wake()
        assert (await (await answer).json())["usage"]["completion_tokens"] == 7

    run(held_app(clock, kv_capacity_tokens=1_000), scenario)


def test_each_app_has_its_own_registry() -> None:
    """Two apps in one process: no duplicate-metric error and separate counts."""
    first, second = fast_app(), fast_app()

    async def scenario(client: Any) -> None:
        await client.post("/v1/completions", json=body(max_tokens=1))

    run(first, scenario)
    assert first[server.STATE].metrics.text() != second[server.STATE].metrics.text()
    assert samples(second[server.STATE].metrics.text().decode())["vllm:request_success_total"] == 0


# --- drain ------------------------------------------------------------------------------------
def test_a_drained_instance_refuses_new_requests_and_finishes_the_accepted_one() -> None:
    clock = HeldClock()

    async def scenario(client: Any) -> None:
        streamed = await client.post("/v1/completions", json=body(max_tokens=5, stream=True))
        assert (await client.get("/healthz")).status == 200
        drained = await client.post("/drain")
        assert await drained.json() == {"draining": True, "running": 1, "waiting": 0}
        refused = await client.post("/v1/completions", json=body())
        assert refused.status == 503
        assert refused.headers["Retry-After"] == "1"
        assert (await client.get("/healthz")).status == 503
        serving = client.app[server.STATE]
        assert not await serving.wait_idle(0.05)
        clock.now = 1.0
        serving.wake()
        events = await read_events(streamed)
        assert len(events) == 6
        assert events[-1][1] == "[DONE]"
        assert await serving.wait_idle(1.0)

    run(held_app(clock), scenario)


def test_stopping_drains_then_closes_the_port() -> None:
    """What SIGTERM does in __main__: the stream in flight gets every token, then the port
    closes."""

    async def main() -> None:
        runner = await server.start(fast_app(), "127.0.0.1", 0)
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}/v1/completions"
        async with aiohttp.ClientSession() as session:
            response = await session.post(url, json=body(max_tokens=30, stream=True))
            first = await response.content.readline()
            assert first.startswith(b"data: ")
            stopping = asyncio.create_task(server.drain_and_stop(runner, drain_seconds=10))
            rest = await read_events(response)
            assert [data for _, data in rest][-1] == "[DONE]"
            assert len(rest) == 30  # 29 more tokens and [DONE]
            assert await stopping
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.post(url, json=body())

    asyncio.run(main())


def test_a_stopping_server_lingers_answering_503_before_it_closes() -> None:
    """A client whose list still names the pod is sent elsewhere (503), not refused, for the
    linger time after SIGTERM, even when nothing was in flight."""

    async def main() -> None:
        runner = await server.start(fast_app(), "127.0.0.1", 0)
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}/v1/completions"
        stopping = asyncio.create_task(
            server.drain_and_stop(runner, drain_seconds=10, linger_seconds=0.5)
        )
        await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as session:
            answer = await session.post(url, json=body())
            assert answer.status == 503
            assert answer.headers["Retry-After"]
            assert await stopping
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.post(url, json=body())

    asyncio.run(main())


# --- the entry point --------------------------------------------------------------------------
def test_help_works(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        entry.main(["--help"], environ={})
    assert exit_.value.code == 0
    assert "--drain-seconds" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, (8000, engine.Role.BOTH, 1, 30.0)),
        (
            [],
            {
                "MATRIXPOOL_SERVE_PORT": "9000",
                "MATRIXPOOL_ROLE": "decode",
                "MATRIXPOOL_CARDS": "4,5",
            },
            (9000, engine.Role.DECODE, 2, 30.0),
        ),
        (
            ["--port", "1", "--role", "prefill", "--cards", "8", "--drain-seconds", "5"],
            {"MATRIXPOOL_SERVE_PORT": "9000", "MATRIXPOOL_ROLE": "decode", "MATRIXPOOL_CARDS": "0"},
            (1, engine.Role.PREFILL, 8, 5.0),
        ),
    ],
    ids=["defaults", "the pod's environment, cards counted", "flags over the environment"],
)
def test_settings_come_from_flags_then_environment(
    argv: list[str], environ: dict[str, str], expected: tuple[int, engine.Role, int, float]
) -> None:
    args = entry.parser(environ).parse_args(argv)
    assert (args.port, args.role, args.cards, args.drain_seconds) == expected


@pytest.mark.parametrize(
    ("environ", "host", "role"),
    [
        ({}, "0.0.0.0", engine.Role.BOTH),
        ({"MATRIXPOOL_POD_IP": "127.200.0.7", "MATRIXPOOL_ROLE": "prefill"}, "127.200.0.7",
         engine.Role.PREFILL),
        ({"MATRIXPOOL_ROLE": "chat"}, "0.0.0.0", engine.Role.BOTH),
    ],
    ids=["every address", "the pod's own address", "another role name serves both phases"],
)  # fmt: skip
def test_a_pod_binds_its_own_address_and_serves_its_role(
    environ: dict[str, str], host: str, role: engine.Role
) -> None:
    args = entry.parser(environ).parse_args([])
    assert (args.host, args.role) == (host, role)


def test_sigterm_stops_the_server_process() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}"}
    command = [sys.executable, "-m", "matrixpool.serving", "--host", "127.0.0.1"]
    command += ["--linger-seconds", "0"]
    process = subprocess.Popen(
        [*command, "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for_health(port, process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        _, stderr = process.communicate()
    assert "every request finished" in stderr


def _wait_for_health(port: int, process: subprocess.Popen[str]) -> None:
    """Poll /healthz until it answers, with a deadline."""

    async def poll() -> None:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline and process.poll() is None:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
        raise AssertionError("the server did not come up")

    asyncio.run(poll())
