"""``matrixpool demo --fast`` end to end (issue 7 acceptance): it runs to its summary and exits 0,
and what the summary says matches the cluster it ran, read independently while the demo holds it
up (``--keep``): recoveries equal each TrainingJob's ``status.recoveries``, the newest transition
equals sn-0's ``status.transition`` and every transition has its TransitionDone Event, the
placements equal the bound pods' cards. The operator's and a checkpoint daemon's ``/metrics``
are scraped there too and parsed with prometheus-client's parser: the recovery and time-sharing
series count what the summary reports, and every name follows Prometheus conventions.

The demo brings up its own control plane (its own folder and ports), so this test does not use
the session's cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.integration import framework

NAMESPACE = "matrixpool-demo"
SUMMARY_DEADLINE = 420  # seconds: the demo's budget is under 5 minutes when the binaries exist
NAME = re.compile(r"^matrixpool_[a-z0-9]+(_[a-z0-9]+)*$")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def test_fast_demo_runs_to_a_summary_that_matches_the_cluster(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    output = tmp_path / "demo.out"
    env = {**os.environ, "MATRIXPOOL_CLUSTER_DIR": str(tmp_path / "cluster")}
    argv = [sys.executable, "-m", "matrixpool.cli", "demo", "--fast", "--keep"]
    argv += ["--summary-json", str(summary_file)]
    started = time.monotonic()
    with open(output, "wb") as out:
        demo = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        framework.eventually(
            lambda: summary_file.exists() or demo.poll() is not None,
            timeout=SUMMARY_DEADLINE,
            interval=1,
            what="the demo's summary",
        )
        assert summary_file.exists(), f"demo exited {demo.returncode}:\n{_tail(output)}"
        print(f"summary after {time.monotonic() - started:.0f} s")
        summary = json.loads(summary_file.read_text())
        kubeconfig = Path(summary["kubeconfig"])
        check_recoveries(summary, kubeconfig)
        check_transitions(summary, kubeconfig)
        check_placements(summary, kubeconfig)
        check_operator_metrics(summary)
        check_daemon_metrics(kubeconfig)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGINT)  # --keep holds until Ctrl-C
        code = demo.wait(timeout=90)
        print(_tail(output, 120))
    assert code == 0, _tail(output)
    text = output.read_text()
    assert "==> summary" in text
    printed = text.split("==> summary", 1)[1].splitlines()
    for entry in summary["recoveries"]:  # the printed table shows what the JSON holds
        row = next(line for line in printed if entry["id"] in line).split()
        assert [entry["level"], str(entry["restoredStep"]), str(entry["lostSteps"])] == [
            row[2],
            row[-3],
            row[-2],
        ], row
    assert not (tmp_path / "cluster" / "state.json").exists(), "the demo left its cluster up"


def check_recoveries(summary: dict[str, Any], kubeconfig: Path) -> None:
    jobs = get(kubeconfig, "trainingjobs", "-n", NAMESPACE)["items"]
    recorded = [
        {"job": job["metadata"]["name"], **entry}
        for job in jobs
        for entry in (job.get("status") or {}).get("recoveries") or []
    ]
    assert summary["recoveries"] == recorded
    causes = [entry["cause"].split()[0] for entry in recorded]
    assert causes == ["NodeDown", "CardsUnhealthy"], recorded
    for entry in recorded:
        assert entry["level"] in ("InPlace", "SpareSwap", "Reschedule"), entry
        assert entry["lostSteps"] is not None, entry
        assert entry["restoredStep"] is not None, entry
        assert entry["recoveredAt"] >= entry["detectedAt"], entry
    assert [f["job"] for f in summary["faults"]] == [e["job"] for e in recorded]


def _seconds_in(message: str) -> float:
    """The seconds of "... in place 1.77 s ..." in a TransitionDone message."""
    return float(message.split(" in place ", 1)[1].split(" ", 1)[0])


def check_transitions(summary: dict[str, Any], kubeconfig: Path) -> None:
    moves = summary["transitions"]
    windows = [m["window"] for m in moves]
    assert _subsequence(["day", "night", "day"], windows), windows
    status = get(kubeconfig, "supernode", "sn-0")["status"]
    newest = {k: v for k, v in moves[-1].items() if k != "supernode"}
    assert newest == status["transition"]
    events = [
        e
        for e in get(kubeconfig, "events", "-A", "--field-selector", "involvedObject.name=sn-0")[
            "items"
        ]
        if e["reason"] == "TransitionDone"
    ]
    assert len(events) == len(moves), [e["message"] for e in events]
    messages = Counter(e["message"] for e in events)
    for move in moves:
        wanted = (
            f"window {move['window']}: inference ",
            f"→ {move['inferenceCards']} cards, training ",
            f"→ {move['trainingCards']} cards, in place ",
        )
        # The Event prints the unrounded seconds to 2 places, status keeps 3: 1.765 may read
        # 1.77 in the Event and 1.76 formatted here.
        found = [
            m
            for m in messages
            if messages[m] > 0
            and all(part in m for part in wanted)
            and abs(_seconds_in(m) - float(move["seconds"])) <= 0.006
        ]
        assert found, (move, list(messages))
        messages[found[0]] -= 1
        if not messages[found[0]]:
            del messages[found[0]]


def check_placements(summary: dict[str, Any], kubeconfig: Path) -> None:
    pods = get(kubeconfig, "pods", "-n", NAMESPACE, "-l", "matrixpool.dev/job")["items"]
    cards: Counter[str] = Counter()
    for pod in pods:
        if pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
            held = pod["metadata"]["annotations"].get("matrixpool.dev/cards", "")
            cards[pod["metadata"]["labels"]["matrixpool.dev/job"]] += len(held.split(","))
    shown = {row["name"]: row["cards"] for row in summary["placements"]}
    assert shown == {name: cards[name] for name in shown}, (shown, cards)
    assert shown["deepseek"] == 352  # the day window: prefill 4 × 8 + decode EP320
    assert {p["phase"] for p in summary["phases"]} == {"day", "night", "day again"}
    night = next(p for p in summary["phases"] if p["phase"] == "night")["workloads"]
    assert next(w for w in night if w["name"] == "nightly-distill")["cards"] > 0


def check_operator_metrics(summary: dict[str, Any]) -> None:
    found = scrape(summary["metrics"])
    levels = Counter(e["level"] for e in summary["recoveries"])
    for level, count in levels.items():
        assert found[("matrixpool_recoveries_total", (("level", level),))] == count
        key = ("matrixpool_recovery_duration_seconds_count", (("level", level),))
        assert found[key] == count
    transitions = sum(
        value
        for (name, _), value in found.items()
        if name == "matrixpool_timeshare_transitions_total"
    )
    assert transitions == len(summary["transitions"])
    phases = {
        dict(labels).get("phase")
        for name, labels in found
        if name == "matrixpool_timeshare_transition_seconds_count"
    }
    assert {"total", "checkpoint", "eviction", "placement"} <= phases
    assert found[("matrixpool_faults_detected_total", (("kind", "NodeDown"),))] >= 1
    conventions(found)


def check_daemon_metrics(kubeconfig: Path) -> None:
    """The daemon of a node where a training rank runs counts the bytes it saved (a daemon
    that restarted with its node counts from zero, and one whose node the demo took down does
    not answer while a rank's pod there still shows Running: any one of the ranks' nodes will
    do)."""
    pods = get(kubeconfig, "pods", "-n", NAMESPACE, "-l", "matrixpool.dev/kind=TrainingJob")
    nodes = sorted(
        {
            p["spec"]["nodeName"]
            for p in pods["items"]
            if p["spec"].get("nodeName") and p["status"].get("phase") == "Running"
        }
    )
    assert nodes, "no training rank runs"
    seen: dict[str, Any] = {}
    for node in nodes:
        lease = get(kubeconfig, "lease", "-n", "matrixpool-system", f"matrixpool-daemon-{node}")
        endpoint = lease["metadata"]["annotations"]["matrixpool.dev/ckpt-endpoint"]
        try:
            found = scrape(f"http://{endpoint}/metrics")
        except OSError as err:  # URLError: refused, reset, timed out
            seen[node] = f"{endpoint} unreachable: {err}"
            continue
        saved = [
            value
            for (name, labels), value in found.items()
            if name == "matrixpool_ckpt_bytes_total" and dict(labels).get("operation") == "save"
        ]
        seen[node] = saved
        if saved and max(saved) > 0:
            conventions(found)
            return
    raise AssertionError(f"no daemon of the ranks' nodes counts a save: {seen}")


def conventions(found: Samples) -> None:
    """Lower-case snake names with the matrixpool_ prefix, base units, _total on counters."""
    ours = {name for name, _ in found if name.startswith("matrixpool_")}
    assert ours
    for name in ours:
        assert NAME.match(name), name
        assert not re.search(r"_(ms|milliseconds|kb|mb|percent)(_|$)", name), name


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers.get("Content-Type", "").startswith("text/plain")
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def get(kubeconfig: Path, *args: str) -> dict[str, Any]:
    from matrixpool.devcluster import cluster

    result = subprocess.run(
        [cluster.kubectl_path(), f"--kubeconfig={kubeconfig}", "get", *args, "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    body: dict[str, Any] = json.loads(result.stdout)
    return body


def _subsequence(wanted: list[str], seen: list[str]) -> bool:
    it = iter(seen)
    return all(any(w == s for s in it) for w in wanted)


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
