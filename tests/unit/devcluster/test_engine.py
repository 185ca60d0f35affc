"""The real engine of the serving tests (issue 33, item 1): the tiny model is a valid GGUF file of
the Llama architecture and a byte-level vocabulary; llama.cpp's server (built by ``make engine``,
or here when the cache lacks it) serves it on loopback, streams one chunk per token to the load
generator, and its ``/metrics`` read as llama.cpp's through ``matrixpool readings``."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from matrixpool import cli
from matrixpool.devcluster import engine
from matrixpool.serving import loadgen, readings, workload


def test_the_tiny_model_is_a_llama_gguf_of_the_ascii_bytes(tmp_path: Path) -> None:
    path = engine.write_model(tmp_path / "m.gguf", layers=2, width=64, feed_forward=96)
    model = gguf.GGUFReader(str(path))
    tokens = model.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[: engine.FIRST_BYTE] == list(engine.SPECIALS)
    assert tokens[engine.FIRST_BYTE] == "<0x00>"
    assert tokens[-1] == "<0x7F>"
    assert len(tokens) == engine.VOCAB
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in model.tensors}
    assert shapes["token_embd.weight"] == (64, engine.VOCAB)  # ggml's order: columns first
    assert shapes["blk.1.ffn_down.weight"] == (96, 64)
    assert len(shapes) == 3 + 2 * 9
    again = engine.write_model(tmp_path / "m.gguf", layers=3)
    assert again.stat().st_mtime_ns == path.stat().st_mtime_ns  # written once, kept


def test_the_engine_command_serves_the_pod_address_with_metrics() -> None:
    argv = engine.command("/m.gguf", host="$(POD_IP)", port=8081, slots=2)
    assert argv[0] == "llama-server"
    pairs = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert pairs["--model"] == "/m.gguf"
    assert pairs["--host"] == "$(POD_IP)"
    assert pairs["--port"] == "8081"
    assert pairs["--parallel"] == "2"
    assert "--metrics" in argv


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server on a loopback port, serving a small model."""
    folder = tmp_path_factory.mktemp("engine")
    model = engine.write_model(folder / "m.gguf", layers=2, width=128, feed_forward=256)
    port = _free_port()
    argv = engine.command(str(model), host="127.0.0.1", port=port, slots=2)
    argv[0] = str(engine.server())
    url = f"http://127.0.0.1:{port}"
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=1):
                        break
                except (urllib.error.URLError, OSError):
                    assert process.poll() is None, "llama-server exited"
                    assert time.monotonic() < deadline, "llama-server did not answer /health"
                    time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=10)


def test_the_engine_streams_one_chunk_per_token_to_the_load_generator(served: str) -> None:
    lengths = workload.LengthModel(
        prompt=workload.Lognormal(40, 0.1, 20, 60), output=workload.Lognormal(12, 0.1, 12, 12)
    )
    requests = workload.generate(workload.step_pattern([4.0], 2), lengths, 2, seed=1)
    options = loadgen.Options(
        urls=(served,), vocab=(engine.FIRST_BYTE, engine.BYTES), extra=(("ignore_eos", True),)
    )
    records = asyncio.run(loadgen.run(requests, options))
    assert len(records) == len(requests) > 3
    assert all(r.status == loadgen.Status.OK for r in records), records
    assert all(r.tokens == 12 for r in records), [r.tokens for r in records]  # not 13
    assert all(r.ttft is not None and r.tpot is not None for r in records)


def test_matrixpool_readings_reads_the_engine_as_llama_cpp(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def load() -> None:
        for _ in range(3):
            body = {"prompt": list(range(3, 60)), "max_tokens": 16, "ignore_eos": True}
            request = urllib.request.Request(
                f"{served}/v1/completions", data=json.dumps(body).encode()
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                assert json.loads(response.read())["usage"]["completion_tokens"] == 16

    load()
    with urllib.request.urlopen(f"{served}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert readings.detect(text) == readings.Engine.LLAMA_CPP
    reading = readings.parse(text, 0.0)
    assert reading.generated_tokens >= 48
    assert reading.prompt_tokens > 0
    assert reading.busy_seconds > 0
    assert {"kv_usage", "requests", "ttft", "itl"} <= reading.missing
    assert cli.main(["readings", f"{served}/metrics", "--interval", "0.1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["engine"] == "LlamaCpp"
    assert printed["running"] == 0
    assert printed["kv_usage"] is None  # llama.cpp exports none
