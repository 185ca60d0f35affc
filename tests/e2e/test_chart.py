"""Recovery after ``helm install`` (issue 13): the chart's operator and checkpoint daemons,
run by the sim's process kubelet, carry a TrainingJob made from examples/trainingjob-elastic.yaml
through a node failure (SpareSwap from the peer copy), a crashed trainer (InPlace), the loss of
every daemon of its supernode (Reschedule from tier 3) and a killed operator (restarted by its
kubelet), and run another to completion (Succeeded). The identities of the chart's announcers and
device plugins write only what their admission policies allow (issue 31, findings 6 and 7)."""

from __future__ import annotations

import copy
import json
import os
import signal
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from matrixpool.api import labels
from matrixpool.devcluster import certs, trainer
from matrixpool.deviceplugin import kube, pairing
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import daemonleases
from tests.integration import framework
from tests.integration.chart import RELEASE, REPO, SHARED, SYSTEM, Installed

JOB = "finetune-elastic"
EXAMPLES = REPO / "examples"


def example_job(name: str = JOB, **env: str) -> dict[str, Any]:
    """examples/trainingjob-elastic.yaml, with the simulated trainer as its container (the
    example names an image of its own), 4 ranks (2 at least) and tier 3 under the shared
    persistentPath; checkpoints every 2 steps in memory, every 4 on tier 3."""
    body = yaml.safe_load((EXAMPLES / "trainingjob-elastic.yaml").read_text())
    body["metadata"]["name"] = name
    spec = body["spec"]
    spec.update(replicas=4, minReplicas=2)
    spec["template"]["spec"]["containers"] = [trainer.container(0.2, **env)]
    spec["checkpoint"] = {
        "memory": {"everySteps": 2, "peerReplicas": 1},
        "persistent": {"everySteps": 4, "uri": f"file://{SHARED}/{name}"},
    }
    return body


def apply_supernodes(cluster: framework.TestCluster) -> None:
    """The examples' SuperNodes sn-0 and sn-1, one spare each."""
    for name in ("supernode-cloudmatrix384.yaml", "supernode-cloudmatrix384-b.yaml"):
        cluster.kubectl("apply", "-f", str(EXAMPLES / name))


def status(cluster: framework.TestCluster, namespace: str, name: str = JOB) -> dict[str, Any]:
    body = cluster.api.custom.get_namespaced_custom_object(
        "matrixpool.dev", "v1alpha1", namespace, "trainingjobs", name
    )
    return dict(body.get("status") or {})


def placed(cluster: framework.TestCluster, namespace: str, name: str = JOB) -> dict[int, Any]:
    """Rank → its live pod."""
    items = cluster.api.core.list_namespaced_pod(
        namespace, label_selector=f"matrixpool.dev/job={name}"
    ).items
    return {
        int(p.metadata.labels["matrixpool.dev/rank"]): p
        for p in items
        if not p.metadata.deletion_timestamp
    }


def training(cluster: framework.TestCluster, namespace: str, past: int) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        now = status(cluster, namespace)
        step = (now.get("checkpoints") or {}).get("memory")
        running = now.get("phase") == "Running" and not now.get("recovering")
        return now if running and isinstance(step, int) and step > past else None

    return framework.eventually(probe, timeout=120, what=f"{JOB} running past step {past}")


def recovered(cluster: framework.TestCluster, namespace: str, count: int) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        now = status(cluster, namespace)
        entries = now.get("recoveries") or []
        done = len(entries) >= count and now.get("phase") == "Running"
        return entries[count - 1] if done and not now.get("recovering") else None

    return framework.eventually(probe, timeout=150, what=f"recovery {count} of {JOB}")


def restores(
    installed: Installed, namespace: str, entry: dict[str, Any], ranks: int
) -> dict[int, dict[str, Any]]:
    """Every rank's trainer reloaded the entry's step with the bytes it saved."""
    found = {}
    for rank in range(ranks):

        def line(rank: int = rank) -> dict[str, Any] | None:
            lines = [
                x
                for x in installed.sim.trainer_lines(namespace, f"{JOB}-{rank}")
                if x.get("recovery") == entry["id"] and "restored" in x
            ]
            return lines[-1] if lines else None

        got = framework.eventually(line, timeout=60, what=f"rank {rank} restores {entry['id']}")
        assert got["restored"] == entry["restoredStep"], got
        assert got["intact"] is True, got
        found[rank] = got
    return found


def pid_of(installed: Installed, pod: Any) -> int:
    path = (
        installed.sim.folder
        / "trainers"
        / (f"{pod.spec.node_name}.{pod.metadata.namespace}.{pod.metadata.name}.pid")
    )
    return int(path.read_text())


def test_the_chart_installs_an_operator_and_daemons_that_run_under_their_kubelet(
    installed: Installed,
) -> None:
    cluster = installed.cluster
    operator = installed.operator_pod()
    assert operator["spec"]["serviceAccountName"] == "matrixpool"
    log = installed.log_of(operator)
    assert '"main loop started"' in log or "main loop started" in log
    daemons = installed.pods("checkpoint-daemon")
    assert len(daemons) == 16
    endpoints = framework.daemon_endpoints(cluster, SYSTEM)
    for pod in daemons:
        node = pod["spec"]["nodeName"]
        assert endpoints[node] == f"{pod['status']['hostIP']}:{installed.ports['daemon']}"

    # A daemon killed is started again by its kubelet (restartPolicy Always), and answers.
    victim = daemons[0]
    pid = int(installed.container_file(victim, ".pid").read_text())
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        pods = {p["metadata"]["uid"]: p for p in installed.pods("checkpoint-daemon")}
        statuses = pods[victim["metadata"]["uid"]]["status"].get("containerStatuses") or []
        daemon = next((s for s in statuses if s["name"] == "daemon"), {})
        return daemon if daemon.get("restartCount") and "running" in daemon["state"] else None

    state = framework.eventually(restarted, timeout=60, what="the daemon restarted")
    assert state["lastState"]["terminated"]["exitCode"] == 137, state  # 128 + SIGKILL
    endpoint = endpoints[victim["spec"]["nodeName"]]
    framework.eventually(
        lambda: _answers(endpoint), timeout=30, what="the restarted daemon answering"
    )


def test_helm_test_passes_on_the_operators_health_and_every_daemons_lease(
    installed: Installed,
) -> None:
    """``helm test``: the chart's test pod (templates/tests/release-check.yaml) runs under the
    sim like any pod of the image, on its own ServiceAccount's token. Without ``--logs``: helm
    reads those from the kubelet's port, which the sim does not serve; the log is read from
    the sim's folder instead."""
    result = installed.cluster.helm("test", RELEASE, "-n", SYSTEM, "--timeout", "180s", check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Phase:          Succeeded" in result.stdout, result.stdout
    [pod] = installed.pods("release-check")
    log = installed.log_of(pod)
    assert "operator healthy, every daemon announced" in log, log


def test_a_job_from_the_examples_recovers_through_the_charts_daemons(
    installed: Installed, namespace: str
) -> None:
    cluster = installed.cluster
    apply_supernodes(cluster)
    body = example_job()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    training(cluster, namespace, past=6)
    operator_node = installed.operator_pod()["spec"]["nodeName"]

    # 1. A node down under a rank: the rank moves to the spare, from its peer copy.
    pods = placed(cluster, namespace)
    nodes = {rank: pod.spec.node_name for rank, pod in pods.items()}
    rank = next(r for r, n in sorted(nodes.items()) if n != operator_node and r > 0)
    victim = nodes[rank]
    cluster.matrixpool("cluster", "fault", "node-down", victim)
    try:
        entry = recovered(cluster, namespace, 1)
    finally:
        cluster.matrixpool("cluster", "fault", "node-up", victim)
    assert entry["level"] == "SpareSwap", entry
    assert entry["ranks"] == [rank], entry
    lines = restores(installed, namespace, entry, 4)
    assert lines[rank]["source"].startswith("peer"), lines[rank]  # its node's memory is gone

    # 2. A trainer crashes: its rank restarts in place from its node's memory.
    training(cluster, namespace, past=entry["restoredStep"] + 2)
    pods = placed(cluster, namespace)
    os.kill(pid_of(installed, pods[0]), signal.SIGKILL)
    entry = recovered(cluster, namespace, 2)
    assert entry["level"] == "InPlace", entry
    assert entry["ranks"] == [0], entry
    restores(installed, namespace, entry, 4)

    # 3. The operator is killed: its kubelet starts it again, and the job trains on.
    operator = installed.operator_pod()
    path = (
        installed.sim.folder
        / "trainers"
        / (f"{operator['spec']['nodeName']}.{SYSTEM}.{operator['metadata']['name']}.pid")
    )
    os.kill(int(path.read_text()), signal.SIGKILL)
    restarted = framework.eventually(
        lambda: (
            (s := (installed.operator_pod()["status"].get("containerStatuses") or [{}])[0]).get(
                "restartCount"
            )
            and "running" in s.get("state", {})
            and s
        ),
        timeout=60,
        what="the operator restarted by its kubelet",
    )
    assert restarted["restartCount"] == 1, restarted
    before = status(cluster, namespace)["checkpoints"]["memory"]
    training(cluster, namespace, past=before + 2)

    # 4. Every daemon of the job's supernode down: the gang goes to the other supernode and
    #    restores from tier 3 (the daemons' shared persistentPath, read by the operator too).
    first = framework.eventually(
        lambda: (
            (s := status(cluster, namespace))["checkpoints"].get("persistent")
            and s["placement"]["superNode"]
        ),
        timeout=60,
        what="a tier-3 checkpoint",
    )
    members = [
        n.metadata.name
        for n in cluster.api.core.list_node(
            label_selector=f"matrixpool.dev/supernode={first}"
        ).items
    ]
    cluster.matrixpool("cluster", "fault", "daemon-down", *members)
    try:
        entry = recovered(cluster, namespace, 3)
        after = status(cluster, namespace)
    finally:
        cluster.matrixpool("cluster", "fault", "daemon-up", *members)
    assert entry["level"] == "Reschedule", entry
    assert entry["cause"].startswith("DaemonUnreachable"), entry
    assert after["placement"]["superNode"] != first
    lines = restores(installed, namespace, entry, 4)
    assert {line["source"] for line in lines.values()} == {"persistent"}


def test_a_job_run_to_its_end_succeeds(installed: Installed, namespace: str) -> None:
    cluster = installed.cluster
    apply_supernodes(cluster)
    body = example_job("short", MATRIXPOOL_SIM_STEPS="8")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    done = framework.eventually(
        lambda: (s := status(cluster, namespace, "short")).get("phase") == "Succeeded" and s,
        timeout=120,
        what="short Succeeded",
    )
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in done["conditions"])
    for pod in placed(cluster, namespace, "short").values():
        assert pod.status.phase == "Succeeded"
        [state] = pod.status.container_statuses
        assert state.state.terminated.exit_code == 0


def test_a_rule_taken_from_the_operators_cluster_role_shows_in_the_condition_and_the_log(
    installed: Installed, namespace: str
) -> None:
    cluster = installed.cluster
    apply_supernodes(cluster)
    role = json.loads(cluster.kubectl("get", "clusterrole", "matrixpool", "-o", "json").stdout)
    original = copy.deepcopy(role)
    for meta in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        original["metadata"].pop(meta, None)
    rules = []
    for rule in role["rules"]:
        kept = [r for r in rule.get("resources", []) if r != "pods/binding"]
        if kept:
            rules.append({**rule, "resources": kept})
    assert rules != role["rules"], "the rule for pods/binding is in the ClusterRole"
    role["rules"] = rules
    cluster.kubectl("replace", "-f", "-", input=json.dumps(role))
    try:
        body = example_job("refused")
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))

        def refused() -> dict[str, Any] | None:
            conditions = status(cluster, namespace, "refused").get("conditions") or []
            found = [c for c in conditions if c["type"] == "Scheduled"]
            return found[0] if found and found[0]["reason"] == "Forbidden" else None

        condition = framework.eventually(refused, timeout=60, what="Scheduled=False Forbidden")
        assert condition["status"] == "False"
        assert 'cannot create resource "pods/binding"' in condition["message"], condition
        log = installed.log_of(installed.operator_pod())
        assert "forbidden by RBAC" in log
    finally:
        cluster.kubectl("replace", "-f", "-", input=json.dumps(original))
    framework.eventually(
        lambda: status(cluster, namespace, "refused").get("phase") == "Running",
        timeout=60,
        what="refused Running once the rule is back",
    )
    conditions = status(cluster, namespace, "refused")["conditions"]
    scheduled = next(c for c in conditions if c["type"] == "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("True", "GangBound"), scheduled


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/v1/healthz", timeout=2):
            return True
    except OSError:
        return False


def test_an_announcer_writes_its_own_nodes_lease_only(installed: Installed) -> None:
    """Issue 31, finding 6: the announcer's ServiceAccount may patch Leases in the namespace,
    and the chart's policy narrows that to its own node's, by the node claim of a token bound
    to its pod (as the kubelet, here the sim, mounts it). The same ServiceAccount's token bound
    to the pod on node A cannot point node B's Lease anywhere, nor can one bound to nothing.
    Patches are server-side dry runs: nothing changes."""
    cluster = installed.cluster
    daemons = installed.pods("checkpoint-daemon")
    mine, other = daemons[0], daemons[1]
    node, theirs = mine["spec"]["nodeName"], other["spec"]["nodeName"]
    account, meta = mine["spec"]["serviceAccountName"], mine["metadata"]
    server = cluster.local.status()["server"]
    tls = ssl.create_default_context(cafile=str(certs.paths(cluster.local.folder / "pki").ca_cert))

    def token(*bound: str) -> str:
        made = cluster.kubectl("create", "token", account, "-n", SYSTEM, *bound)
        return made.stdout.strip()

    def point(bearer: str, lease_node: str, holder: str) -> tuple[int, str]:
        """PATCH the Lease of ``lease_node`` to a foreign endpoint, held as ``holder``."""
        patch = {
            "metadata": {"annotations": {labels.CKPT_ENDPOINT: "203.0.113.9:7040"}},
            "spec": {"holderIdentity": holder},
        }
        path = f"/apis/coordination.k8s.io/v1/namespaces/{SYSTEM}/leases/"
        request = urllib.request.Request(
            f"{server}{path}{daemonleases.lease_name(lease_node)}?dryRun=All",
            data=json.dumps(patch).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {bearer}",
                "Content-Type": "application/merge-patch+json",
            },
        )
        try:
            with urllib.request.urlopen(request, context=tls, timeout=30) as answer:
                return answer.status, ""
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read().decode(errors="replace")

    bound = (
        "--bound-object-kind=Pod",
        f"--bound-object-name={meta['name']}",
        f"--bound-object-uid={meta['uid']}",
    )
    on_pod, unbound = token(*bound), token()
    assert point(on_pod, node, node) == (200, "")  # its own node's Lease
    for (status, said), expected in (
        (point(on_pod, theirs, theirs), f"an announcer on node {node} writes"),
        (point(on_pod, node, theirs), f"holding it as {node}"),
        (point(unbound, node, node), "with a token bound to a pod on its node"),
    ):
        assert status == 403, said
        assert expected in said, said
    endpoints = framework.daemon_endpoints(cluster, SYSTEM)  # the real announcers still write
    assert endpoints[theirs] == f"{other['status']['hostIP']}:{installed.ports['daemon']}"


def _card_less_pod(name: str, node: str) -> dict[str, Any]:
    """A pod bound to ``node`` that kwok runs (not the matrixpool image): the plugin's target."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}, "annotations": {"note": "kept"}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "pause"}]},
    }


def _as(cluster: framework.TestCluster, token: str, folder: Path) -> k8s_client.Api:
    """API clients that present ``token``, as the plugin's in-cluster config does."""
    ca = certs.paths(cluster.local.folder / "pki").ca_cert
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {
                    "server": cluster.local.status()["server"],
                    "certificate-authority": str(ca),
                },
            }
        ],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path = folder / f"kubeconfig-{len(list(folder.glob('kubeconfig-*')))}"
    path.write_text(json.dumps(config))
    return k8s_client.from_kubeconfig(path)


def _refused(call: Callable[[], Any]) -> tuple[int, str]:
    """(200, "") if ``call`` passes, else the API's status code and message."""
    try:
        call()
    except kubernetes.client.ApiException as error:
        return int(error.status), str(json.loads(error.body).get("message"))
    return 200, ""


def test_the_device_plugin_marks_the_pods_of_its_own_node_only(
    installed: Installed, namespace: str, tmp_path: Path
) -> None:
    """Issue 31, finding 7: the device plugin's own ServiceAccount may list and patch pods
    cluster-wide (RBAC cannot bound either to a node); the chart's policy narrows the patch to
    pods bound to its node (the node claim of a token bound to its pod, as its kubelet mounts
    it) and to its mark. The plugin's code (kube.KubeCluster) lists its node's pods and marks
    one; the same identity cannot mark a pod of another node, change a pod's image, labels or
    other annotations, create or delete a pod (refused by RBAC, and by the policy should an
    admin grant more), nor write with a token bound to nothing. Refusals are dry runs."""
    cluster, nodes = installed.cluster, installed.cluster.shape.node_count
    plugins = framework.eventually(
        lambda: (found := installed.pods("device-plugin")) and len(found) == nodes and found,
        timeout=60,
        what="a device plugin pod on every node",
    )
    mine = plugins[0]
    node, account, meta = (
        mine["spec"]["nodeName"],
        mine["spec"]["serviceAccountName"],
        mine["metadata"],
    )
    theirs = next(p["spec"]["nodeName"] for p in plugins if p["spec"]["nodeName"] != node)
    for name, on in (("here", node), ("there", theirs)):
        cluster.kubectl(
            "create", "-n", namespace, "-f", "-", input=json.dumps(_card_less_pod(name, on))
        )

    def token(*bound: str) -> str:
        return cluster.kubectl("create", "token", account, "-n", SYSTEM, *bound).stdout.strip()

    bound = (
        "--bound-object-kind=Pod",
        f"--bound-object-name={meta['name']}",
        f"--bound-object-uid={meta['uid']}",
    )
    api, unbound = _as(cluster, token(*bound), tmp_path), _as(cluster, token(), tmp_path)

    # 1. What the plugin does: list its node's pods, read its Node, mark the pod it allocated.
    plugin = kube.KubeCluster(api, node, "huawei.com/Ascend910")
    pods = {p.key: p for p in plugin.pods()}
    assert f"{namespace}/here" in pods
    assert f"{namespace}/there" not in pods
    assert api.core.list_node(field_selector=f"metadata.name={node}").items
    plugin.mark_allocated(pods[f"{namespace}/here"], frozenset({0, 1}))
    here = cluster.api.core.read_namespaced_pod("here", namespace)
    assert here.metadata.annotations == {"note": "kept", pairing.ALLOCATED: "0,1"}

    # 2. Anything else is refused, by the policy.
    def patch(client: k8s_client.Api, name: str, body: dict[str, Any]) -> tuple[int, str]:
        return _refused(
            lambda: client.core.patch_namespaced_pod(name, namespace, body, dry_run="All")
        )

    mark = {"metadata": {"annotations": {pairing.ALLOCATED: "2"}}}
    only = "allocated-cards annotation only"
    for (status, said), expected in (
        (patch(api, "there", mark), f"a device plugin on node {node} writes pods bound to {node}"),
        (
            patch(api, "here", {"spec": {"containers": [{"name": "c", "image": "other"}]}}),
            f"{only}, not the spec",
        ),
        (patch(api, "here", {"metadata": {"labels": {"app": "x"}}}), f"{only}, not the labels"),
        (
            patch(
                api,
                "here",
                {"metadata": {"annotations": {"note": None, **mark["metadata"]["annotations"]}}},
            ),
            f"{only}, not the other annotations",
        ),
        (patch(unbound, "here", mark), "with a token bound to a pod on its node"),
    ):
        assert status == 403, said
        assert expected in said, said
    assert patch(api, "here", mark) == (200, "")

    # 3. Creating and deleting pods: RBAC refuses; the policy too, should RBAC allow them.
    def create() -> tuple[int, str]:
        body = _card_less_pod("new", node)
        return _refused(lambda: api.core.create_namespaced_pod(namespace, body, dry_run="All"))

    def delete() -> tuple[int, str]:
        return _refused(lambda: api.core.delete_namespaced_pod("here", namespace, dry_run="All"))

    for (status, said), verb in ((create(), "create"), (delete(), "delete")):
        assert status == 403, said
        assert f'cannot {verb} resource "pods"' in said, said
    grant = f"{namespace}-grant"
    cluster.kubectl("create", "clusterrole", grant, "--verb=create,delete", "--resource=pods")
    try:
        cluster.kubectl(
            "create",
            "clusterrolebinding",
            grant,
            f"--clusterrole={grant}",
            f"--serviceaccount={SYSTEM}:{account}",
        )
        refusal = "the device plugin updates pods only; it creates and deletes none"
        for attempt in (create, delete):
            framework.eventually(
                lambda attempt=attempt: refusal in attempt()[1],
                timeout=30,
                what="the policy's refusal once RBAC allows",
            )
    finally:
        cluster.kubectl("delete", "clusterrolebinding", grant, check=False)
        cluster.kubectl("delete", "clusterrole", grant, check=False)


def test_the_operator_writes_only_its_own_configmaps_outside_its_namespace(
    installed: Installed, namespace: str, tmp_path: Path
) -> None:
    """Issue 31, least privilege: the operator's ClusterRole may create and update ConfigMaps
    in every namespace (rank tables, expert maps); the chart's configMapPolicy narrows that to
    those names, owned by a matrixpool.dev object. Server-side dry runs: nothing is stored."""
    cluster = installed.cluster
    account = installed.operator_pod()["spec"]["serviceAccountName"]
    token = cluster.kubectl("create", "token", account, "-n", SYSTEM).stdout.strip()
    operator = _as(cluster, token, tmp_path)
    uid = "0b1e5a3c-0000-4000-8000-000000000002"
    job = {"apiVersion": "matrixpool.dev/v1alpha1", "kind": "TrainingJob", "name": "j"}
    owner: list[dict[str, Any]] = [{**job, "uid": uid, "controller": True}]
    foreign: list[dict[str, Any]] = [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "d", "uid": uid}
    ]

    def create(name: str, owners: list[dict[str, Any]], where: str = namespace) -> tuple[int, str]:
        body = {"metadata": {"name": name, "ownerReferences": owners}, "data": {"a": "1"}}
        return _refused(
            lambda: operator.core.create_namespaced_config_map(where, body, dry_run="All")
        )

    assert create(labels.rank_table_config_map(uid), owner) == (200, "")
    assert create("svc-expert-map", owner) == (200, "")
    code, message = create("coredns", owner, "kube-system")
    assert code == 403, message
    assert "writes ConfigMaps matrixpool-hccl-<job UID>" in message, message
    code, message = create("svc-expert-map", foreign)
    assert code == 403, message
    assert "not owned by a matrixpool.dev object" in message, message
    cluster.kubectl(  # a user's ConfigMap of that name: the operator may not take it over
        "create", "configmap", "mine-expert-map", "-n", namespace, "--from-literal=a=2"
    )
    taken = {"metadata": {"name": "mine-expert-map", "ownerReferences": owner}, "data": {}}
    code, message = _refused(
        lambda: operator.core.replace_namespaced_config_map(
            "mine-expert-map", namespace, taken, dry_run="All"
        )
    )
    assert code == 403, message
    assert "not owned by a matrixpool.dev object" in message, message
