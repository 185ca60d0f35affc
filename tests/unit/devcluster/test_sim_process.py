"""A container the sim runs dies whole, as one in a PID namespace of its own does: what its
process started (torchrun's workers) ends when that process ends or is killed; a daemon's
children are left alone (not a container)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from matrixpool.devcluster import cgroups, kubelet, sim
from tests import ci


def started_child(
    folder: Path, inherit: bool, session: bool = False, group: Path | None = None
) -> tuple[sim.Process, int]:
    """A process that starts a long sleep in the background (in a session of its own, as
    torchrun starts its workers, with ``session``) and waits on it; in cgroup ``group``."""
    pid_file = folder / "child"
    sleep = "setsid sleep 300" if session else "sleep 300"
    argv = cgroups.enter(group, ["sh", "-c", f"{sleep} & echo $! > {pid_file}; wait"])
    process = sim._spawn(argv, folder / "log", {"PATH": os.defpath}, inherit)
    process.cgroup = group
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.02)
    return process, int(pid_file.read_text())


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def gone(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_killed_containers_children_die_with_it(tmp_path: Path) -> None:
    process, child = started_child(tmp_path, inherit=False)
    assert process.group
    process.kill()
    assert gone(child)


def test_a_container_whose_process_ended_leaves_nothing_running(tmp_path: Path) -> None:
    process, child = started_child(tmp_path, inherit=False)
    os.kill(process.popen.pid, 9)  # as a test kills a trainer by its pid file
    process.popen.wait()
    assert not process.alive()  # the sim sees it ended ...
    assert gone(child)  # ... and sweeps its group


def test_a_daemons_children_are_not_swept(tmp_path: Path) -> None:
    process, child = started_child(tmp_path, inherit=True)
    try:
        os.kill(process.popen.pid, 9)
        process.popen.wait()
        assert not process.alive()
        time.sleep(0.2)
        assert running(child)
    finally:
        os.kill(child, 9)


def test_a_killed_containers_children_die_with_it_even_in_a_session_of_their_own(
    tmp_path: Path,
) -> None:
    parent = cgroups.root()
    if parent is None:
        ci.cannot_run("no writable cgroup2 mount with cgroup.kill here")
    try:
        group = cgroups.make(parent, "container")
        assert group is not None
        process, child = started_child(tmp_path, inherit=False, session=True, group=group)
        assert str(child) in (group / "cgroup.procs").read_text().split()
        process.kill()
        assert gone(child)
        assert not group.exists()  # removed once empty
    finally:
        cgroups.remove(parent)
    assert not parent.exists()


class _Ended:
    """The part of the sim that :meth:`sim.Sim.terminate` calls once a pod's processes end."""

    def __init__(self) -> None:
        self.ended: list[sim.PodRun] = []

    def end_run(self, run: sim.PodRun) -> None:
        self.ended.append(run)


def test_a_prestop_sleep_delays_sigterm_within_the_grace_period(tmp_path: Path) -> None:
    """As a kubelet runs a container's preStop hook before its SIGTERM: a process that stops at
    once on SIGTERM (an engine) still runs through the sleep, then gets SIGTERM, not SIGKILL."""
    spec = {
        "containers": [
            {"name": "engine", "lifecycle": {"preStop": {"sleep": {"seconds": 1}}}},
            {"name": "other"},
        ]
    }
    assert kubelet.pre_stop_sleep(spec) == 1.0
    assert kubelet.pre_stop_sleep({"containers": [{"name": "x"}]}) == 0.0
    marker = tmp_path / "term"
    argv = ["sh", "-c", f"trap 'echo TERM > {marker}; exit 0' TERM; while :; do sleep 0.05; done"]
    process = sim._spawn(argv, tmp_path / "log", {"PATH": os.defpath}, inherit=False)
    run = sim.PodRun("uid", "ns", "pod", "node-0", tmp_path / "pod", grace=30.0)
    run.pre_stop = kubelet.pre_stop_sleep(spec)
    run.containers["engine"] = sim.Container("engine", process=process)
    owner = _Ended()
    started = time.monotonic()
    while not owner.ended:
        sim.Sim.terminate(owner, run, None)  # type: ignore[arg-type]
        if time.monotonic() - started < 0.9:
            assert process.alive(), "SIGTERM came before the preStop sleep ended"
        assert time.monotonic() - started < 10, "the process never ended"
        time.sleep(0.05)
    assert time.monotonic() - started >= 1.0
    assert marker.read_text().strip() == "TERM"  # a SIGTERM, not the SIGKILL of the grace's end
