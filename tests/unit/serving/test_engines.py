"""The autoscaler reads each serving engine in its own names (issue 33, item 2): /metrics texts
written from each engine's documented names (vLLM's V1 engine before and after 0.11, SGLang
with --enable-metrics, llama.cpp's server with --metrics), told apart by their names, and
``matrixpool readings`` printing what the autoscaler reads from a file or a URL."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from matrixpool import cli
from matrixpool.serving import readings


def histogram(name: str, labels: str, buckets: dict[float, int]) -> str:
    """A Prometheus histogram's lines: cumulative ``buckets`` by upper bound, +Inf last."""
    lines = [f"# HELP {name} h", f"# TYPE {name} histogram"]
    total = 0
    for le, count in sorted(buckets.items()):
        total = count
        bound = "+Inf" if le == float("inf") else repr(le)
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {count}')
    lines += [f"{name}_count{{{labels}}} {total}", f"{name}_sum{{{labels}}} 1.0"]
    return "\n".join(lines)


def metric(name: str, kind: str, value: float, labels: str = "") -> str:
    """One series as the engines print it (a counter's HELP and TYPE name it with _total)."""
    shown = f"{name}_total" if kind == "counter" else name
    return f"# HELP {shown} m\n# TYPE {shown} {kind}\n{shown}{{{labels}}} {value}"


VLLM_LABELS = 'engine="0",model_name="m"'
LATENCY = {0.01: 0, 0.02: 8, 0.05: 10, float("inf"): 10}  # 8 of 10 at most 20 ms
FIRST = {0.1: 5, 0.5: 10, float("inf"): 10}
STOPPED = 'finished_reason="stop"'


def vllm(*, newer: bool = True, tokens: int = 500, requests: int = 10) -> str:
    """vLLM V1: since 0.11 inter_token_latency_seconds and kv_cache_usage_perc; before it
    time_per_output_token_seconds and gpu_cache_usage_perc."""
    itl = "vllm:inter_token_latency_seconds" if newer else "vllm:time_per_output_token_seconds"
    kv = "vllm:kv_cache_usage_perc" if newer else "vllm:gpu_cache_usage_perc"
    return "\n".join(
        [
            metric("vllm:num_requests_running", "gauge", 3, VLLM_LABELS),
            metric("vllm:num_requests_waiting", "gauge", 2, VLLM_LABELS),
            metric(kv, "gauge", 0.25, VLLM_LABELS),
            metric("vllm:prompt_tokens", "counter", 2000, VLLM_LABELS),
            metric("vllm:generation_tokens", "counter", tokens, VLLM_LABELS),
            metric("vllm:request_success", "counter", requests, f"{VLLM_LABELS},{STOPPED}"),
            histogram("vllm:time_to_first_token_seconds", VLLM_LABELS, FIRST),
            histogram(itl, VLLM_LABELS, LATENCY),
        ]
    )  # fmt: skip


def sglang() -> str:
    labels = 'model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    return "\n".join(
        [
            metric("sglang:num_running_reqs", "gauge", 4, labels),
            metric("sglang:num_queue_reqs", "gauge", 1, labels),
            metric("sglang:token_usage", "gauge", 0.28, labels),
            metric("sglang:prompt_tokens", "counter", 900, labels),
            metric("sglang:generation_tokens", "counter", 300, labels),
            metric("sglang:num_requests", "counter", 6, labels),
            histogram("sglang:time_to_first_token_seconds", labels, {0.2: 6, float("inf"): 6}),
            histogram("sglang:inter_token_latency_seconds", labels, LATENCY),
            histogram("sglang:e2e_request_latency_seconds", labels, {1.0: 6, float("inf"): 6}),
        ]
    )


def llama_cpp(*, predicted: int = 100, seconds: float = 2.0, prompt_seconds: float = 1.0) -> str:
    """llama.cpp's server with --metrics: counters and gauges, no histogram, no labels."""
    return "\n".join(
        [
            metric("llamacpp:prompt_tokens", "counter", 4000),
            metric("llamacpp:prompt_seconds", "counter", prompt_seconds),
            metric("llamacpp:tokens_predicted", "counter", predicted),
            metric("llamacpp:tokens_predicted_seconds", "counter", seconds),
            metric("llamacpp:n_decode", "counter", 90),
            metric("llamacpp:n_busy_slots_per_decode", "gauge", 1.5),
            metric("llamacpp:prompt_tokens_seconds", "gauge", 2000),
            metric("llamacpp:predicted_tokens_seconds", "gauge", 50),
            metric("llamacpp:requests_processing", "gauge", 2),
            metric("llamacpp:requests_deferred", "gauge", 5),
            metric("llamacpp:n_tokens_max", "counter", 512),
        ]
    )


@pytest.mark.parametrize(
    ("text", "engine"),
    [
        (vllm(), readings.Engine.VLLM),
        (vllm(newer=False), readings.Engine.VLLM),
        (sglang(), readings.Engine.SGLANG),
        (llama_cpp(), readings.Engine.LLAMA_CPP),
        ("", readings.Engine.VLLM),  # nothing known: vLLM's names, as our server exports
    ],
)
def test_an_engine_is_told_by_its_names(text: str, engine: readings.Engine) -> None:
    assert readings.detect(text) == engine
    assert readings.parse(text, 0.0).engine == engine


@pytest.mark.parametrize("newer", [True, False], ids=["vLLM 0.11+", "vLLM before 0.11"])
def test_vllm_before_and_after_its_renames_reads_the_same(newer: bool) -> None:
    reading = readings.parse(vllm(newer=newer), 0.0)
    assert (reading.running, reading.waiting, reading.kv_usage) == (3, 2, 0.25)
    assert (reading.prompt_tokens, reading.generated_tokens, reading.requests) == (2000, 500, 10)
    assert reading.itl.quantile(0.9) == pytest.approx(0.035)
    assert reading.missing == {"busy_seconds", "decode_seconds", "batch"}


def test_a_vllm_011_exposition_without_time_per_output_token_still_gives_the_itl() -> None:
    text = vllm(newer=True)
    assert "time_per_output_token" not in text
    summary = readings.summary(readings.parse(text, 0.0))
    assert summary["itl_p90_s"] == pytest.approx(0.035)
    assert summary["ttft_p90_s"] == pytest.approx(0.42)


def test_sglang_reads_its_own_names() -> None:
    reading = readings.parse(sglang(), 0.0)
    assert (reading.running, reading.waiting, reading.kv_usage) == (4, 1, 0.28)
    assert (reading.prompt_tokens, reading.generated_tokens, reading.requests) == (900, 300, 6)
    assert reading.ttft.quantile(0.9) == pytest.approx(0.18)
    assert reading.itl.quantile(0.9) == pytest.approx(0.035)
    assert reading.missing == {"busy_seconds", "decode_seconds", "batch"}


def test_llama_cpp_gives_no_kv_usage_no_requests_and_a_mean_inter_token_latency() -> None:
    before = readings.parse(llama_cpp(predicted=100, seconds=2.0), 10.0)
    now = readings.parse(llama_cpp(predicted=300, seconds=8.0, prompt_seconds=3.0), 20.0)
    assert (now.running, now.waiting) == (2, 5)
    assert now.missing == {"kv_usage", "requests", "ttft", "itl"}
    summary = readings.summary(now, before)
    assert summary["itl_p90_s"] is None
    assert summary["itl_mean_s"] == pytest.approx(6.0 / 200)  # seconds per generated token
    assert summary["generation_tokens_per_s"] == pytest.approx(20.0)
    assert (summary["kv_usage"], summary["requests_per_s"], summary["ttft_p90_s"]) == (
        None,
        None,
        None,
    )
    prefill = readings.Instance(before, now, cards=8, decodes=False)
    decode = readings.Instance(before, now, cards=8, decodes=True)
    factors = readings.factors([prefill, decode])
    assert factors.tpot_p90_s == pytest.approx(0.03)  # the mean stands in for the p90
    assert factors.card_utilisation == pytest.approx(0.2)  # 2 s of prompt work in 10 s


def test_a_named_engine_reads_only_its_names() -> None:
    reading = readings.parse(vllm(), 0.0, readings.Engine.SGLANG)
    assert reading.engine == readings.Engine.SGLANG
    assert (reading.running, reading.prompt_tokens) == (0, 0)
    assert "running" in reading.missing


def test_the_cli_prints_what_the_autoscaler_reads_from_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "metrics.txt"
    saved.write_text(sglang())
    assert cli.main(["readings", str(saved)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["engine"] == "SGLang"
    assert (printed["running"], printed["waiting"], printed["kv_usage"]) == (4, 1, 0.28)
    assert printed["prompt_tokens_per_s"] is None  # one reading: no rate
    assert printed["itl_p90_s"] == pytest.approx(0.035)  # every request since the start
    assert printed["missing"] == ["batch", "busy_seconds", "decode_seconds"]


@pytest.fixture
def served() -> Iterator[tuple[str, list[str]]]:
    """A loopback /metrics that answers each text of the list in turn (the last one again)."""
    texts: list[str] = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (texts.pop(0) if len(texts) > 1 else texts[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics", texts
    finally:
        server.shutdown()
        server.server_close()


def test_the_cli_reads_a_url_twice_for_rates(
    served: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, texts = served
    texts += [vllm(tokens=500, requests=10), vllm(tokens=700, requests=14)]
    assert cli.main(["readings", url, "--interval", "0.2", "--engine", "vLLM"]) == 0
    printed = json.loads(capsys.readouterr().out)
    seconds = printed["seconds_between_readings"]
    assert seconds >= 0.2
    assert printed["generation_tokens_per_s"] == pytest.approx(200 / seconds, rel=0.01)
    assert printed["requests_per_s"] == pytest.approx(4 / seconds, rel=0.01)
    assert printed["itl_p90_s"] is None  # no request finished in between: no latency


def test_llama_cpp_decode_rate_is_its_tokens_over_its_slots_time_over_the_batch() -> None:
    """200 tokens generated in 6 s of slot time at 1.5 sequences a step: 4 s of decoding, 50
    tokens/s (a replica's decode rate at that batch); other engines give none."""
    before = readings.parse(llama_cpp(predicted=100, seconds=2.0), 10.0)
    now = readings.parse(llama_cpp(predicted=300, seconds=8.0), 20.0)
    alone = readings.Instance(before, now, cards=1, decodes=True)
    measured = readings.throughput([alone])
    assert measured.decode_busy_tokens_per_s == pytest.approx(200 / (6.0 / 1.5))
    assert measured.decode_tokens_per_s == pytest.approx(20.0)
    vllm_now = readings.parse(vllm(tokens=900), 20.0)
    other = readings.Instance(readings.parse(vllm(), 10.0), vllm_now, cards=1, decodes=True)
    assert readings.throughput([other]).decode_busy_tokens_per_s is None
