"""Host paths under ``matrixpool sim`` stay in the simulated node's folder, as a real node's stay
on that node (issue 31, finding 8: ``hostPath: /../../etc`` led to this machine's /etc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrixpool.devcluster import kubelet, sim


def a_sim(folder: Path) -> sim.Sim:
    """A Sim with its folders only (no API server: node_folder reads nothing else)."""
    made = object.__new__(sim.Sim)
    made.folder, made.shared_paths = folder, ("/var/lib/matrixpool/persistent",)
    return made


@pytest.mark.parametrize(
    ("path", "inside"),
    [
        ("/data", "nodes/n1/data"),
        ("/../../etc", "nodes/n1/etc"),  # resolved as on the node: its own /etc
        ("/data/../../../../etc/passwd", "nodes/n1/etc/passwd"),
        ("//var/lib/matrixpool/persistent/job", "shared/var/lib/matrixpool/persistent/job"),
        ("/var/lib/matrixpool/persistent/../../../../etc", "nodes/n1/etc"),
    ],
)
def test_a_host_path_is_a_folder_of_the_node(tmp_path: Path, path: str, inside: str) -> None:
    assert a_sim(tmp_path).node_folder("n1", path) == tmp_path / inside


def test_a_link_a_container_left_does_not_lead_out_of_the_node(tmp_path: Path) -> None:
    node = tmp_path / "nodes" / "n1"
    node.mkdir(parents=True)
    (node / "escape").symlink_to("/etc")
    with pytest.raises(kubelet.NotReadyError, match="FailedMount"):
        a_sim(tmp_path).node_folder("n1", "/escape")
