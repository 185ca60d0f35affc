"""Time to first token of a real engine with the supernode's KV-cache pool, against the
engine's own prefix cache alone, on replicas that have not seen a prompt's shared prefix
(issue 33, item 4).

    .venv/bin/python benchmarks/serving_prefix_llamacpp.py [--seed 1]   (prints one JSON object)

The engine: ``llama-server`` (``tools/engine/build.sh``) serving the tiny random Llama model
of ``matrixpool.devcluster.engine`` (512 wide, 4 layers, f32 weights, f16 KV), ``REPLICAS``
processes on loopback ports, ``SLOTS`` slots and one CPU thread each. The load:
``matrixpool.serving.workload`` prompts (``LENGTHS``: lognormal lengths, median 1024 tokens,
clipped to 800..1400; a share ``SHARE`` of them start with one of ``PREFIXES`` common prefixes
of ``PREFIX_TOKENS`` tokens — a system prompt — then fresh tokens), ids sent as
``FIRST_BYTE + id % BYTES``, ``OUTPUT_TOKENS`` output tokens each; ``COUNT`` requests,
request ``i`` sent to replica ``i % REPLICAS`` (round robin), one at a time (closed loop: the
time to first token is the engine's work on the prompt, not a queue on this machine's cores),
each replica warmed first with one short prompt of its own. Both ways run on fresh processes
(nothing cached at the start), with their folders in ``/dev/shm`` (what an emptyDir of medium
Memory is in a pod), on the same requests:

- ``engine_cache``: straight to each ``llama-server``, ``cache_prompt`` on — its slots and its
  host-memory prompt cache (``--cache-ram``, 8 GiB by default), the engine's own prefix cache;
- ``pool``: each engine behind ``python -m matrixpool.serving.kvproxy`` over ``REPLICAS``
  daemons (``matrixpool-ckpt-daemon --kv-pool-bytes``), one per replica's "node", its own
  first, the service's quota ``QUOTA`` on each.

The measured set: the requests that start with a shared prefix, sent to a replica that has not
been sent a request with that prefix before in the run, when some other replica has been (so
the pool may hold it and the replica's own cache cannot). It depends only on the order and the
round robin, so both ways measure the same requests; the first request of each prefix is in
neither (no cache can hold it).

Figures: ``ttft_p50_pool_s`` and ``ttft_p50_engine_cache_s`` (median time to first token over
the measured set, at the client), their ``ttft_ratio`` and whether it meets the issue's goal
(``goal_met``: at most ``GOAL`` = 0.5); ``hit_rate``: pool hits (the proxies'
``matrixpool_kvproxy_hits_total``) over the requests with a shared prefix (``local_hits``:
requests whose slot already held their prefix); the prompt tokens the engines computed on the
measured set both ways (their own ``timings.prompt_n``) and how many of those requests reused
the whole prefix (``timings.cache_n``); the bytes restored; the proxies' mean time to look a
prompt up in the pool and to restore a slot file (``matrixpool_kvproxy_lookup_seconds``,
``..._restore_seconds``); the request counts; the machine's 1-minute load average before and
after (the cores may be shared with other work: a load above the core count stretches every
time, both ways, and the ratio with them); the median TTFT of every request both ways
(``ttft_p50_all_*``).

Left out: everything runs on one machine's cores (2 here), so the daemons, the proxies and
the engines share them, and a request's prompt is computed on one core; the network is
loopback, so moving a slot file (about 8 KiB per token here) costs a copy, not a wire, and a
real network would add its transfer time to the pool's side; the model is tiny and random, so
its prefill is a small model's on a CPU, not a large one's on an accelerator (where both
prefill and the KV per token are larger); the stores are made as the requests come, so a
request sent right after another with the same prefix may not find the store finished
(counted as a miss, as it would be in production).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from matrixpool.devcluster import engine
from matrixpool.serving import workload
from matrixpool_recovery import credentials, wire

REPLICAS = 4
SLOTS = 2  # per replica (--parallel)
COUNT = 64  # requests, both ways
SHARE = 0.75  # of the requests, starting with a shared prefix
PREFIXES = 8
PREFIX_TOKENS = 768
OUTPUT_TOKENS = 8
LENGTHS = workload.LengthModel(
    prompt=workload.Lognormal(1024, 0.15, 800, 1400),
    output=workload.Lognormal(OUTPUT_TOKENS, 0.0, OUTPUT_TOKENS, OUTPUT_TOKENS),
    shared_prefix_share=SHARE,
    prefix_count=PREFIXES,
    prefix_tokens=PREFIX_TOKENS,
)
MODEL_SHAPE = {"width": 512, "layers": 4, "feed_forward": 1536}
CONTEXT = 2048 * SLOTS  # tokens per engine: 2048 per slot
GOAL = 0.5  # TTFT with the pool over the engine's cache alone, at most
SECRET = "benchmark-secret"  # the daemons' cluster secret
SERVICE = "5e7a1c2d-0000-4000-8000-00000000b001"  # the InferenceService's UID
POOL_BYTES = "256Mi"  # each daemon's KV pool
QUOTA = 200 << 20  # the service's quota on each daemon
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=120)
START_DEADLINE = 60.0  # seconds a process may take to come up
SHM = Path("/dev/shm")  # the slot folders' and daemons' home: an emptyDir of medium Memory


@dataclass(frozen=True)
class Sent:
    """One request of the run."""

    prompt: list[int]  # token ids of the model's vocabulary
    prefix: int | None  # the shared prefix it starts with
    replica: int  # where the round robin sends it


@dataclass(frozen=True)
class Seen:
    """What one request saw."""

    ttft_s: float  # at the client: from sending to the first token's chunk
    computed: int  # prompt tokens the engine computed (timings.prompt_n)
    reused: int  # prompt tokens it took from a cache (timings.cache_n)


def requests(seed: int) -> list[Sent]:
    drawn = itertools.islice(
        workload.requests(workload.step_pattern([1.0], 1.0), LENGTHS, 3600.0, seed), COUNT
    )
    return [
        Sent([engine.FIRST_BYTE + t % engine.BYTES for t in r.prompt], r.prefix_id, i % REPLICAS)
        for i, r in enumerate(drawn)
    ]


def measured(sent: Sequence[Sent]) -> list[int]:
    """Indexes of the measured set (see the module's docstring)."""
    seen: dict[int, set[int]] = {}  # prefix -> replicas sent it so far
    chosen = []
    for index, request in enumerate(sent):
        if request.prefix is None:
            continue
        replicas = seen.setdefault(request.prefix, set())
        if replicas and request.replica not in replicas:
            chosen.append(index)
        replicas.add(request.replica)
    return chosen


# --- processes --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _spawn(stack: contextlib.ExitStack, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=out)

    def stop() -> None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    stack.callback(stop)
    return process


def _wait_file(path: Path, process: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise SystemExit(f"{path.name}: the process did not start:\n{log.read_text()[-2000:]}")


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError, http.client.HTTPException):
            if _get(url, "/health").startswith("200"):
                return
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer /health")


def _host_port(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


def _get(url: str, path: str) -> str:
    """'<status> <body>' of a GET (urllib would raise on a 503 while the model loads)."""
    conn = http.client.HTTPConnection(*_host_port(url), timeout=10)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return f"{answer.status} {answer.read().decode()}"
    finally:
        conn.close()


def daemons(stack: contextlib.ExitStack, root: Path) -> list[str]:
    """One daemon per replica's node, with a KV pool and the service's quota."""
    secret = root / "secret"
    secret.touch(mode=0o600)
    secret.write_text(SECRET)
    addresses = []
    for node in range(REPLICAS):
        ready = root / f"daemon{node}.ready"
        args = [sys.executable, "-m", "matrixpool_recovery.daemon", "--listen", "127.0.0.1:0"]
        args += ["--node", f"n{node}", "--secret-file", str(secret), "--ready-file", str(ready)]
        args += ["--memory-dir", str(root / f"n{node}" / "memory")]
        args += ["--data-dir", str(root / f"n{node}" / "disk"), "--memory-bytes", "512Mi"]
        args += ["--memory-headroom", "16Mi"]
        args += ["--persistent-root", str(root / "persistent"), "--kv-pool-bytes", POOL_BYTES]
        args += ["--log-level", "WARNING"]
        log = root / f"daemon{node}.log"
        address = _wait_file(ready, _spawn(stack, args, log), log)
        operator = wire.Endpoint(address, credentials.operator_token(SECRET))
        wire.request(operator, "PUT", f"/v1/kv/{SERVICE}/quota", {"bytes": QUOTA})
        addresses.append(address)
    return addresses


@contextlib.contextmanager
def fleet(binary: Path, model: Path, root: Path, pooled: bool) -> Iterator[list[str]]:
    """The replicas' URLs: the engines', or their proxies' over the pool."""
    with contextlib.ExitStack() as stack:
        pool = daemons(stack, root) if pooled else []
        token = root / "token"
        token.write_text(credentials.service_token(SECRET, SERVICE))
        urls = []
        for index in range(REPLICAS):
            slots = root / f"slots{index}"
            slots.mkdir()
            port = _free_port()
            argv = engine.command(
                str(model), host="127.0.0.1", port=port, slots=SLOTS, context=CONTEXT
            )
            argv = [str(binary), *argv[1:], "--slot-save-path", str(slots)]
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, _spawn(stack, argv, root / f"engine{index}.log"))
            if pooled:
                url = _proxy(stack, root, index, url, pool[index:] + pool[:index], token)
            urls.append(url)
        yield urls


def _proxy(
    stack: contextlib.ExitStack,
    root: Path,
    index: int,
    engine_url: str,
    pool: list[str],
    token: Path,
) -> str:
    port = _free_port()
    args = [sys.executable, "-m", "matrixpool.serving.kvproxy", "--engine", engine_url]
    args += ["--listen", f"127.0.0.1:{port}", "--slots", str(SLOTS)]
    args += ["--slot-dir", str(root / f"slots{index}"), "--kv-service", SERVICE]
    args += ["--kv-token-file", str(token), "--kv-daemons", ",".join(pool)]
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, _spawn(stack, args, root / f"proxy{index}.log"))
    return url


# --- requests ---------------------------------------------------------------------------------


async def send(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> Seen:
    """One streamed completion; TTFT at the first token's chunk, the engine's counts from the
    last one."""
    body = {"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "stream": True, "ignore_eos": True}
    body |= {"cache_prompt": True}
    started, first, last = time.perf_counter(), None, {}
    post = session.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT)
    async with post as response:
        if response.status != 200:
            raise SystemExit(f"{url}: {response.status} {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            first = first or time.perf_counter()
            last = json.loads(line[5:])
    if first is None or "timings" not in last:
        raise SystemExit(f"{url}: no token, or no timings in the last chunk")
    timings = last["timings"]
    return Seen(first - started, int(timings["prompt_n"]), int(timings["cache_n"]))


async def run(urls: Sequence[str], sent: Sequence[Sent]) -> list[Seen]:
    """Warm each replica with a short prompt of its own, then send the requests in order."""
    async with aiohttp.ClientSession() as session:
        for index, url in enumerate(urls):
            await send(session, url, [engine.FIRST_BYTE + index] * 16)
        return [await send(session, urls[r.replica], r.prompt) for r in sent]


def pool_counters(urls: Sequence[str]) -> dict[str, float]:
    """The proxies' matrixpool_kvproxy_* samples, summed over the replicas."""
    total: dict[str, float] = {}
    for url in urls:
        text = _get(url, "/metrics").split(" ", 1)[1]
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("matrixpool_kvproxy_"):
                    name = sample.name.removeprefix("matrixpool_kvproxy_")
                    total[name] = total.get(name, 0.0) + sample.value
    return total


def one_way(binary: Path, model: Path, sent: Sequence[Sent], pooled: bool) -> dict[str, Any]:
    with (
        TemporaryDirectory(prefix="kvbench-", dir=SHM if SHM.is_dir() else None) as folder,
        fleet(binary, model, Path(folder), pooled) as urls,
    ):
        started = time.monotonic()
        seen = asyncio.run(run(urls, sent))
        took = time.monotonic() - started
        if pooled:
            time.sleep(0.5)  # the last stores
        counters = pool_counters(urls) if pooled else {}
    return {"seen": seen, "seconds": took, "counters": counters}


def figures(seed: int = 1) -> dict[str, Any]:
    """Both ways on the same requests (see the module's docstring)."""
    binary = engine.server(lambda line: print(line, file=sys.stderr))
    folder = binary.parent.parent / "models"
    folder.mkdir(exist_ok=True)
    model = engine.write_model(folder / "tiny-512x4.gguf", **MODEL_SHAPE)
    sent = requests(seed)
    chosen = measured(sent)
    load_before = os.getloadavg()[0]
    alone = one_way(binary, model, sent, pooled=False)
    pooled = one_way(binary, model, sent, pooled=True)
    base = [alone["seen"][i] for i in chosen]
    with_pool = [pooled["seen"][i] for i in chosen]
    prefixed = sum(r.prefix is not None for r in sent)
    ratio = _p50(with_pool) / _p50(base) if chosen else None
    counters = pooled["counters"]
    return {
        "engine": "llama.cpp (llama-server, tiny random Llama 512x4, CPU, 1 thread)",
        "replicas": REPLICAS,
        "requests": len(sent),
        "requests_with_shared_prefix": prefixed,
        "measured_requests": len(chosen),
        "ttft_p50_pool_s": round(_p50(with_pool), 4) if chosen else None,
        "ttft_p50_engine_cache_s": round(_p50(base), 4) if chosen else None,
        "ttft_ratio": round(ratio, 3) if ratio is not None else None,
        "goal": f"ttft_ratio <= {GOAL}",
        "goal_met": ratio is not None and ratio <= GOAL,
        "hit_rate": round(counters.get("hits_total", 0.0) / prefixed, 3) if prefixed else None,
        "pool_hits": int(counters.get("hits_total", 0)),
        "pool_misses": int(counters.get("misses_total", 0)),
        "local_hits": int(counters.get("local_hits_total", 0)),
        "slot_files_stored": int(counters.get("stored_total", 0)),
        "restored_mib": round(counters.get("restored_bytes_total", 0.0) / 2**20, 1),
        "pool_lookup_ms_mean": _mean_ms(counters, "lookup_seconds"),
        "pool_restore_ms_mean": _mean_ms(counters, "restore_seconds"),
        "prompt_tokens_computed_on_measured": {
            "pool": sum(s.computed for s in with_pool),
            "engine_cache": sum(s.computed for s in base),
        },
        "prompt_tokens_on_measured": sum(len(sent[i].prompt) for i in chosen),
        "measured_reusing_the_prefix": {
            "pool": sum(s.reused >= PREFIX_TOKENS for s in with_pool),
            "engine_cache": sum(s.reused >= PREFIX_TOKENS for s in base),
        },
        "ttft_p50_all_pool_s": round(_p50(pooled["seen"]), 4),
        "ttft_p50_all_engine_cache_s": round(_p50(alone["seen"]), 4),
        "run_seconds": {
            "pool": round(pooled["seconds"], 1),
            "engine_cache": round(alone["seconds"], 1),
        },
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "seed": seed,
    }


def _mean_ms(counters: dict[str, float], histogram: str) -> float | None:
    count = counters.get(f"{histogram}_count", 0.0)
    return round(1000 * counters[f"{histogram}_sum"] / count, 1) if count else None


def _p50(seen: Sequence[Seen]) -> float:
    return statistics.median(s.ttft_s for s in seen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    print(json.dumps(figures(args.seed), indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
