"""The chart on real nodes: the operator, the checkpoint daemons and the device plugin run in
containers with the chart's security context, and the device plugin puts the cards on the real
nodes."""

from __future__ import annotations

import json

from tests.integration import framework
from tests.integration.chart import SYSTEM
from tests.realnodes.conftest import REAL_NODES, running

CARDS = "huawei.com/Ascend910"


def test_operator_and_daemons_run_in_containers_as_the_chart_says(
    installed: framework.TestCluster,
) -> None:
    operator = running(installed, "operator")[0]
    daemons = running(installed, "checkpoint-daemon")
    assert {d["spec"]["nodeName"] for d in daemons} == {f"real-{i}" for i in range(REAL_NODES)}
    for pod in [operator, *daemons]:
        for status in pod["status"]["containerStatuses"]:
            assert status["containerID"].startswith("containerd://"), status
    # What the container's process is, asked inside it: the chart's uid, a read-only root.
    probe = (
        "import os, errno\n"
        "try:\n"
        "    open('/probe', 'w')\n"
        "    print(os.getuid(), 'writable')\n"
        "except OSError as e:\n"
        "    print(os.getuid(), errno.errorcode[e.errno])\n"
    )
    for pod, container in [(operator, "operator"), *((d, "daemon") for d in daemons)]:
        out = installed.kubectl(
            "exec",
            "-n",
            SYSTEM,
            pod["metadata"]["name"],
            "-c",
            container,
            "--",
            "python",
            "-c",
            probe,
        )
        assert out.stdout.split() == ["65532", "EROFS"], (pod["metadata"]["name"], out.stdout)
        spec = next(c for c in pod["spec"]["containers"] if c["name"] == container)
        assert spec["securityContext"]["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_the_device_plugin_runs_alone_as_root_without_capabilities_or_a_writable_root(
    installed: framework.TestCluster,
) -> None:
    """Issue 31, finding 7: the plugin is a DaemonSet of its own (the daemons' pods hold the
    daemon and the announcer only), under its own ServiceAccount; root for the kubelet's
    folder, with no effective capability and a read-only root file system."""
    plugins = framework.eventually(
        lambda: (
            (found := running(installed, "device-plugin")) and len(found) == REAL_NODES and found
        ),
        timeout=300,
        what="a running device plugin pod on every real node",
    )
    for daemon in running(installed, "checkpoint-daemon"):
        assert [c["name"] for c in daemon["spec"]["containers"]] == ["daemon", "announce"]
    probe = (
        "import os, errno\n"
        "caps = next(l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff:'))\n"
        "try:\n"
        "    open('/probe', 'w')\n"
        "    print(os.getuid(), caps, 'writable')\n"
        "except OSError as e:\n"
        "    print(os.getuid(), caps, errno.errorcode[e.errno])\n"
    )
    for pod in plugins:
        assert pod["spec"]["serviceAccountName"] == "matrixpool-device-plugin"
        name = pod["metadata"]["name"]
        out = installed.kubectl(
            "exec", "-n", SYSTEM, name, "-c", "device-plugin", "--", "python", "-c", probe
        )
        assert out.stdout.split() == ["0", "0000000000000000", "EROFS"], (name, out.stdout)


def test_the_device_plugin_registers_the_cards_of_every_real_node(
    installed: framework.TestCluster,
) -> None:
    def capacities() -> dict[str, str] | None:
        out = installed.kubectl("get", "nodes", "-l", "type=real", "-o", "json")
        found = {
            n["metadata"]["name"]: n["status"].get("allocatable", {}).get(CARDS)
            for n in json.loads(out.stdout)["items"]
        }
        return found if all(v == "8" for v in found.values()) else None

    shown = framework.eventually(capacities, timeout=120, what="8 cards on every real node")
    assert len(shown) == REAL_NODES
    yaml_out = installed.kubectl("get", "node", "real-0", "-o", "yaml").stdout
    assert f'{CARDS}: "8"' in yaml_out


def test_each_container_gets_exactly_the_cards_of_its_annotation(
    installed: framework.TestCluster,
) -> None:
    """Two 4-card pods on one 8-card node; the first asks for the upper half (the kubelet's own
    choice would be the lowest free cards), so only the device plugin can make them agree."""
    framework.eventually(
        lambda: _allocatable(installed, "real-0") == "8", timeout=120, what="cards on real-0"
    )
    wanted = {"cards-upper": "4,5,6,7", "cards-lower": "0,1,2,3"}
    namespace = "default"
    for name, cards in wanted.items():  # one after the other: the kubelet admits in order
        installed.kubectl("apply", "-f", "-", input=json.dumps(_card_pod(name, cards)))
        framework.eventually(
            lambda name=name: _phase(installed, namespace, name) == "Running",
            timeout=90,
            what=f"{name} running",
        )
    try:
        uids = {}
        for name, cards in wanted.items():
            pod = json.loads(installed.kubectl("get", "pod", name, "-o", "json").stdout)
            uids[pod["metadata"]["uid"]] = cards
            annotations = pod["metadata"]["annotations"]
            assert annotations["deviceplugin.matrixpool.dev/allocated-cards"] == cards
            env = installed.kubectl("logs", name).stdout.split()
            assert env == [cards, cards, cards], (name, env)  # MATRIXPOOL_CARDS, ASCEND_, NVIDIA_
        # The kubelet's own ledger of what it handed out (its device-manager checkpoint).
        ledger = _kubelet_ledger(installed, "real-0")
        assert {uid: ",".join(sorted(ledger[uid])) for uid in uids} == uids
    finally:
        installed.kubectl("delete", "pod", *wanted, "--wait=false", check=False)


def _card_pod(name: str, cards: str) -> dict[str, object]:
    report = (
        "import os, time\n"
        "print(*(os.environ.get(k) for k in "
        "('MATRIXPOOL_CARDS', 'ASCEND_VISIBLE_DEVICES', 'NVIDIA_VISIBLE_DEVICES')), flush=True)\n"
        "time.sleep(3600)\n"
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {"matrixpool.dev/cards": cards}},
        "spec": {
            "nodeName": "real-0",
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "c",
                    "image": "matrixpool:dev",
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", report],
                    "resources": {"limits": {CARDS: "4"}},
                }
            ],
        },
    }


def _phase(cluster: framework.TestCluster, namespace: str, name: str) -> str | None:
    out = cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout)["status"].get("phase") if out.returncode == 0 else None


def _allocatable(cluster: framework.TestCluster, node: str) -> str | None:
    out = cluster.kubectl("get", "node", node, "-o", "json")
    return json.loads(out.stdout)["status"].get("allocatable", {}).get(CARDS)


def _kubelet_ledger(cluster: framework.TestCluster, node: str) -> dict[str, list[str]]:
    """Pod UID → device IDs, from the node's /var/lib/kubelet/device-plugins checkpoint."""
    path = (
        cluster.local.folder
        / "real"
        / node
        / "host"
        / "var-lib-kubelet"
        / "device-plugins"
        / "kubelet_internal_checkpoint"
    )
    data = json.loads(path.read_text())["Data"]["PodDeviceEntries"]
    return {
        entry["PodUID"]: [d for ids in entry["DeviceIDs"].values() for d in ids]
        for entry in data
        if entry["ResourceName"] == CARDS
    }
