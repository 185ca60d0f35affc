"""Benchmark of the checkpoint data plane on one machine: the figures of docs/benchmarks.md.

Run from the repository root::

    .venv/bin/python benchmarks/checkpoint.py --json [--sizes 1Gi,4Gi] [--repeat 3]
    .venv-torch/bin/python benchmarks/checkpoint.py --json --rows dcp   # the DCP rows (torch)

For each state size it measures, in one run, the baselines and the data plane:

* memcpy: ``numpy.copyto`` of the same bytes into a warm buffer (best of 2);
* loopback: a raw TCP stream of the same bytes between two processes on 127.0.0.1, received
  with ``recv_into`` into a warm 256 MiB buffer, round and round (best of 2);
* stall: how long ``Checkpointer.save`` blocks the trainer;
* staged: time until the state is copied and hashed into the daemon's memory (the arrays are
  writable again), and tier-1 save: until the daemon holds it as a committed tier-1 shard;
* tier-1 save over HTTP: the same rank without the daemon's socket (a pod in a namespace of the
  ``baseline`` Pod Security level), its shard uploaded; until the daemon holds it (states of
  at most 1 GiB: the upload buffer is one more copy of the state);
* peer: replication of the shard from the node's daemon to a peer daemon (the daemon's clock);
* restore from peer: a trainer on a spare node (a third daemon with no copy) restoring from the
  peer's memory into its arrays, checksum verified.
* tier-2 save: a save of the same state to the node's disk only (the daemon's clock: copy,
  fsync, read back and checksum, rename, manifest), and of it the read-back verification
  (``verifySeconds`` in the daemon's answer; 0 from a daemon that does not verify). The data
  directory is in /dev/shm beside the memory one, so this is the verification's cost against
  the fastest possible disk.

Three daemons run as separate processes with their memory directory in /dev/shm. Repetition
0 is cold (fresh tmpfs pages, first mapping); later repetitions are the steady state, where a
rank's buffer comes back from the daemon's pool already in memory and mapped (between
repetitions the job is deleted so the pool hands the buffer back without a second copy of the
state held, which keeps peak memory at about four times the state). The figures reported are
the medians of the warm repetitions; the cold ones are printed beside them. The baselines are
measured again right before each repetition and every ratio is taken within its repetition, so
that load from other processes on a shared machine moves both sides of a ratio alike.

The DCP rows (``--rows dcp``, or ``data-plane,dcp``; need torch: ``tools/torch-venv.sh``) time
``torch.distributed.checkpoint`` on one rank (a one-process gloo group), the same state of 4
float32 tensors, in one run: ``dcp.save`` and ``dcp.async_save`` with DCP's own
``FileSystemWriter`` to a folder on the local disk (its defaults: one file per rank, fsync), then
with ``matrixpool_recovery.torch.StorageWriter`` to node a's daemon (tier 1 every step, no peer
copy: the local tiers of each side). For each: the stall (how long the call blocks the
training loop) and, for ``async_save``, until its future is done. ``async_stall_vs_fs_save``
is our async stall over the file writer's ``save``; the goal is at most 0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from matrixpool_recovery import Checkpointer, CheckpointSpec, credentials, wire
from matrixpool_recovery.daemon import parse_bytes

SECRET = "benchmark-secret"  # the daemons' cluster secret
TOKEN = credentials.job_token(SECRET, "bench")  # the trainer's: job "bench" only
OPERATOR = credentials.operator_token(SECRET)  # deletes the job between runs
PARTS = 4  # arrays per state, like a few large layers
SINK_BUFFER = 256 << 20  # bytes the loopback receiver writes into
GOALS = {
    "stall_vs_memcpy": ("<=", 0.10),
    "tier1_save_vs_memcpy": (">=", 0.5),
    "peer_vs_loopback": (">=", 0.5),
    "restore_peer_vs_loopback": (">=", 0.5),
}
DCP_GOALS = {"async_stall_vs_fs_save": ("<=", 0.10)}
ROWS = ("data-plane", "dcp")  # what --rows may name


HTTP_MAX = 1 << 30  # state sizes whose save over HTTP is measured too


def gbps(size: int, seconds: float) -> float:
    return size / seconds / 1e9


def make_state(size: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    part = size // PARTS
    return {f"layer{i}": rng.integers(0, 255, part, dtype=np.uint8) for i in range(PARTS)}


def memcpy_seconds(state: dict[str, Any], dest: dict[str, Any]) -> float:
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        for name, array in state.items():
            np.copyto(dest[name], array)
        best = min(best, time.perf_counter() - started)
    return best


# --- raw loopback TCP baseline ---


def sink(size: int) -> None:
    """Child process: receive `size` bytes per connection into a warm buffer, answer one byte.

    The buffer is at most SINK_BUFFER bytes, written round and round (a 4 GiB state would
    otherwise cost 4 GiB more memory); a connection closed before any byte ends the process.
    """
    buffer = np.ones(min(size, SINK_BUFFER), dtype=np.uint8)
    view = memoryview(buffer).cast("B")
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        for _ in range(1000):
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < size:
                    start = got % len(view)
                    n = conn.recv_into(view[start:], min(size - got, len(view) - start, 8 << 20))
                    if not n:
                        break
                    got += n
                if got < size:
                    return
                conn.sendall(b"k")


@contextmanager
def loopback(size: int) -> Iterator[int]:
    """A sink process; yields its port."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--sink", str(size)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        yield port
    finally:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
            pass
        child.wait(timeout=60)
        if child.stdout is not None:
            child.stdout.close()


def loopback_seconds(state: dict[str, Any], port: int) -> float:
    best = float("inf")
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            started = time.perf_counter()
            for array in state.values():
                conn.sendall(memoryview(array).cast("B"))
            conn.recv(1)
            best = min(best, time.perf_counter() - started)
    return best


# --- daemons ---


@contextmanager
def daemons(root: Path, memory_bytes: int) -> Iterator[dict[str, str]]:
    """Nodes a (the trainer's), b (its peer) and c (a spare whose peer is b)."""
    processes: list[subprocess.Popen[bytes]] = []
    addresses: dict[str, str] = {}
    secret = root / "secret"
    root.mkdir(parents=True, exist_ok=True)
    secret.touch(mode=0o600)
    secret.write_text(SECRET)
    try:
        for node, peers in (("b", []), ("a", ["b"]), ("c", ["b"])):
            ready = root / f"{node}.ready"
            args = [sys.executable, "-m", "matrixpool_recovery.daemon", "--listen", "127.0.0.1:0"]
            args += ["--node", node, "--data-dir", str(root / node / "disk")]
            args += ["--memory-dir", str(root / node / "memory")]
            args += ["--memory-bytes", str(memory_bytes), "--secret-file", str(secret)]
            args += ["--keep", "1", "--persistent-root", str(root / "persistent")]
            args += ["--ready-file", str(ready), "--log-level", "WARNING"]
            args += [arg for peer in peers for arg in ("--peer", addresses[peer])]
            processes.append(subprocess.Popen(args))
            addresses[node] = wait_ready(ready)
        yield addresses
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def wait_ready(ready: Path) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ready.exists():
            return ready.read_text()
        time.sleep(0.02)
    raise SystemExit(f"daemon did not start: {ready}")


# --- one size ---


def one_save(
    trainer: Checkpointer,
    spare: Checkpointer,
    step: int,
    state: dict[str, Any],
    into: dict[str, Any],
) -> dict[str, float]:
    started = time.perf_counter()
    handle = trainer.save(step, state)
    stall = time.perf_counter() - started
    outcomes = handle.wait()
    restore_started = time.perf_counter()
    restored = spare.restore(into=into)
    restore = time.perf_counter() - restore_started
    if not restored.source.startswith("peer:") or restored.step != step:
        raise SystemExit(f"restored step {restored.step} from {restored.source}, not a peer")
    if not all(np.array_equal(into[name], array) for name, array in state.items()):
        raise SystemExit("restored bytes differ from the saved ones")
    return {
        "stall": stall,
        "staged": handle.times["staged"] - handle.started,
        "tier1": handle.times["memory"] - handle.started,
        "peer": float(outcomes["peers"]["seconds"]),
        "restore": restore,
    }


def run_size(size: int, repeat: int, root: Path) -> dict[str, Any]:
    state = make_state(size)
    total = sum(a.nbytes for a in state.values())
    into = {name: np.ones_like(array) for name, array in state.items()}
    runs: list[dict[str, float]] = []
    spec = CheckpointSpec(memory_every=1, peer_replicas=1)
    with loopback(total) as port, daemons(root, total + (1 << 30)) as nodes:
        trainer = Checkpointer("bench", 0, 1, nodes["a"], TOKEN, spec=spec)
        spare = Checkpointer("bench", 0, 1, nodes["c"], TOKEN, spec=spec)
        # The same rank where the daemon's socket is not mounted (a baseline namespace); its
        # upload buffer is one more copy of the state, which 4 GiB states leave no room for.
        remote = Checkpointer("bench", 0, 1, nodes["a"], TOKEN, spec=spec, shared_memory=False)
        http = total <= HTTP_MAX
        try:
            for step in range(1, repeat + 2):
                baselines = {
                    "memcpy": memcpy_seconds(state, into),
                    "loopback": loopback_seconds(state, port),
                }
                runs.append(baselines | one_save(trainer, spare, step, state, into))
                clear(nodes)
                runs[-1] |= local_save(trainer, step, state)
                clear(nodes)
                if http:
                    runs[-1] |= http_save(remote, step, state)
                    clear(nodes)
        finally:
            trainer.close()
            spare.close()
            remote.close()
    return figures(total, runs)


def clear(nodes: dict[str, str]) -> None:
    for node in ("a", "b"):
        wire.request(wire.Endpoint(nodes[node], OPERATOR), "DELETE", "/v1/jobs/bench")


def local_save(trainer: Checkpointer, step: int, state: dict[str, Any]) -> dict[str, float]:
    """A save to tier 2 only; the daemon's time for it and for its read-back."""
    outcome = trainer.save(step, state, tiers=("local",)).wait()["local"]
    return {"local": float(outcome["seconds"]), "verify": float(outcome.get("verifySeconds", 0))}


def http_save(remote: Checkpointer, step: int, state: dict[str, Any]) -> dict[str, float]:
    """A tier-1 save uploaded over HTTP: the trainer's time until the daemon holds it."""
    handle = remote.save(step, state, tiers=("memory",))
    handle.wait()
    return {"tier1_http": handle.times["memory"] - handle.started}


def figures(size: int, runs: list[dict[str, float]]) -> dict[str, Any]:
    def ratios(run: dict[str, float]) -> dict[str, float]:
        memcpy, loopback = run["memcpy"], run["loopback"]
        return {
            "memcpy_gbps": gbps(size, memcpy),
            "loopback_gbps": gbps(size, loopback),
            "stall_s": run["stall"],
            "stall_vs_memcpy": run["stall"] / memcpy,
            "staged_gbps": gbps(size, run["staged"]),
            "staged_vs_memcpy": memcpy / run["staged"],
            "tier1_save_gbps": gbps(size, run["tier1"]),
            "tier1_save_vs_memcpy": memcpy / run["tier1"],
            **(
                {
                    "tier1_http_gbps": gbps(size, run["tier1_http"]),
                    "tier1_http_vs_memcpy": memcpy / run["tier1_http"],
                }
                if "tier1_http" in run
                else {}
            ),
            "peer_gbps": gbps(size, run["peer"]),
            "peer_vs_loopback": loopback / run["peer"],
            "restore_peer_gbps": gbps(size, run["restore"]),
            "restore_peer_vs_loopback": loopback / run["restore"],
            "local_save_gbps": gbps(size, run["local"]),
            "local_verify_s": run["verify"],
            "local_verify_share": run["verify"] / run["local"],
        }

    warm = [ratios(run) for run in runs[1:]]
    median = {key: statistics.median(r[key] for r in warm) for key in warm[0]}
    return {
        "bytes": size,
        **median,
        "warm_runs": len(warm),
        "cold": ratios(runs[0]),
        "goals_met": {key: met(key, median[key]) for key in GOALS},
    }


def met(key: str, value: float, goals: dict[str, tuple[str, float]] = GOALS) -> bool:
    sense, bound = goals[key]
    return value <= bound if sense == "<=" else value >= bound


# --- torch.distributed.checkpoint: our storage writer against DCP's FileSystemWriter ---


def run_dcp(size: int, repeat: int, root: Path) -> dict[str, Any]:
    """The DCP rows of one size (torch imported here: the other rows do without it)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from matrixpool_recovery import torch as dcp_storage

    part = size // PARTS // 4
    state = {f"layer{i}": torch.rand(part, dtype=torch.float32) for i in range(PARTS)}
    total = sum(t.numel() * t.element_size() for t in state.values())
    disk = Path(tempfile.mkdtemp(prefix="mp-bench-dcp-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    spec = CheckpointSpec(memory_every=1, peer_replicas=0)
    runs: list[dict[str, float]] = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with daemons(root, 2 * total + (1 << 30)) as nodes:
            rank = dcp_storage.Rank(Checkpointer("bench", 0, 1, nodes["a"], TOKEN, spec=spec))

            def files(step: int) -> tuple[Any, str]:
                folder = str(disk / f"step-{step}")
                return dcp.FileSystemWriter(folder), folder

            def ours(step: int) -> tuple[Any, str]:
                return dcp_storage.StorageWriter(rank=rank), str(step)

            try:
                for step in range(1, repeat + 2):
                    run = dcp_timings(dcp, state, 2 * step, files, "fs")
                    shutil.rmtree(disk, ignore_errors=True)
                    run |= dcp_timings(dcp, state, 2 * step, ours, "ours", lambda: clear(nodes))
                    clear(nodes)
                    runs.append(run)
            finally:
                rank.checkpointer.close()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(disk, ignore_errors=True)
    return dcp_figures(total, runs)


def dcp_timings(
    dcp: Any,
    state: dict[str, Any],
    step: int,
    writer: Any,
    name: str,
    between: Any = None,
) -> dict[str, float]:
    """``dcp.save`` of `step` then ``dcp.async_save`` of the next, a fresh writer each
    (``writer(step)``: the writer and its checkpoint_id); ``between()`` runs between the two
    (the daemon drops the first: two 4 GiB copies would not fit beside the rest)."""
    saving, checkpoint = writer(step)
    started = time.perf_counter()
    dcp.save(state, checkpoint_id=checkpoint, storage_writer=saving)
    saved = time.perf_counter() - started
    if between is not None:
        between()
    saving, checkpoint = writer(step + 1)
    started = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=checkpoint, storage_writer=saving)
    stall = time.perf_counter() - started
    future.result()
    return {
        f"{name}_save_s": saved,
        f"{name}_async_stall_s": stall,
        f"{name}_async_done_s": time.perf_counter() - started,
    }


def dcp_figures(size: int, runs: list[dict[str, float]]) -> dict[str, Any]:
    def ratios(run: dict[str, float]) -> dict[str, float]:
        return run | {
            "fs_save_gbps": gbps(size, run["fs_save_s"]),
            "ours_save_gbps": gbps(size, run["ours_save_s"]),
            "async_stall_vs_fs_save": run["ours_async_stall_s"] / run["fs_save_s"],
            "fs_async_stall_vs_fs_save": run["fs_async_stall_s"] / run["fs_save_s"],
        }

    warm = [ratios(run) for run in runs[1:]]
    median = {key: statistics.median(r[key] for r in warm) for key in warm[0]}
    return {
        **median,
        "warm_runs": len(warm),
        "cold": ratios(runs[0]),
        "goals_met": {key: met(key, median[key], DCP_GOALS) for key in DCP_GOALS},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--sizes", default="1Gi,4Gi", help="state sizes, e.g. 256Mi,1Gi")
    parser.add_argument("--repeat", type=int, default=3, help="warm repetitions per size")
    parser.add_argument(
        "--rows", default="data-plane", help=f"comma-separated, of {', '.join(ROWS)}"
    )
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sink:
        sink(args.sink)
        return 0
    rows = args.rows.split(",")
    if not set(rows) <= set(ROWS):
        parser.error(f"--rows: {args.rows!r} names rows other than {', '.join(ROWS)}")
    root = Path(tempfile.mkdtemp(prefix="mp-bench-", dir="/dev/shm"))
    results: dict[str, dict[str, Any]] = {}
    try:
        for text in args.sizes.split(","):
            size, repeat = parse_bytes(text), max(1, args.repeat)
            results[text] = {"bytes": size}
            if "data-plane" in rows:
                results[text] |= run_size(size, repeat, root / text)
            if "dcp" in rows:
                results[text]["dcp"] = run_dcp(size, repeat, root / f"{text}-dcp")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    goals = {"data-plane": GOALS, "dcp": DCP_GOALS}
    report = {
        "machine": {"cpus": os.cpu_count()},
        "goals": {row: goals[row] for row in rows},
        "sizes": results,
    }
    print(json.dumps(report, indent=2 if not args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
