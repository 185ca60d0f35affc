"""The checkpoint DaemonSet of the chart (checkpointDaemon values), rendered with helm.

Off by default; when on: one daemon per node on the host network, tier 2 and tier 1 on host
folders, the tier-1 bound given both as the container's memory limit and as --memory-bytes,
tier 3 only under persistentPath, the cluster secret from a Secret the chart creates or one
that exists, mounted by the daemons and the operator. Uses the helm binary that
tools/k8s/build.sh builds and the Helm wrapper of test_chart.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.unit.chart import test_chart as chart

ENABLED = "checkpointDaemon.enabled=true"
OFF = "checkpointDaemon.enabled=false"
Manifest = dict[str, Any]


def daemonset(manifests: list[Manifest]) -> Manifest:
    return chart.only(manifests, "DaemonSet")


def pod(manifests: list[Manifest]) -> Manifest:
    spec: Manifest = daemonset(manifests)["spec"]["template"]["spec"]
    return spec


def container(manifests: list[Manifest], name: str = "daemon") -> Manifest:
    [found] = [c for c in pod(manifests)["containers"] if c["name"] == name]
    return found


def args(manifests: list[Manifest]) -> dict[str, str]:
    found: dict[str, str] = {}
    for arg in container(manifests)["args"]:
        key, _, value = arg.partition("=")
        found[key] = value
    return found


def volumes(manifests: list[Manifest]) -> dict[str, Manifest]:
    return {v["name"]: v for v in pod(manifests)["volumes"]}


def test_the_daemon_is_on_by_default_and_can_be_turned_off(helm: chart.Helm) -> None:
    assert {"DaemonSet", "Secret"} <= chart.kinds(helm.render())
    assert daemonset(helm.render()) == daemonset(helm.render(ENABLED))
    manifests = helm.render(OFF)
    assert "DaemonSet" not in chart.kinds(manifests)
    assert "Secret" not in chart.kinds(manifests)


def test_one_daemon_per_node_serves_on_the_node_address(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED)
    assert pod(manifests)["hostNetwork"] is True
    assert args(manifests)["--listen"] == "$(NODE_IP):7040"
    assert args(manifests)["--node"] == "$(NODE_NAME)"
    [port] = container(manifests)["ports"]
    assert (port["containerPort"], port["hostPort"]) == (7040, 7040)
    assert container(manifests)["command"] == ["matrixpool-ckpt-daemon"]
    assert container(manifests)["livenessProbe"]["httpGet"]["path"] == "/v1/healthz"


def test_tier_1_memory_is_the_limit_and_the_daemons_bound(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED, "checkpointDaemon.memory=64Gi")
    assert container(manifests)["resources"]["limits"]["memory"] == "64Gi"
    assert container(manifests)["resources"]["limits"]["cpu"] == "2"
    assert args(manifests)["--memory-bytes"] == "64Gi"


def test_tiers_1_and_2_live_in_host_folders(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED, "checkpointDaemon.hostPath=/mnt/nvme/ckpt")
    found = volumes(manifests)
    assert found["data"]["hostPath"] == {"path": "/mnt/nvme/ckpt", "type": "DirectoryOrCreate"}
    assert found["memory"]["hostPath"]["path"] == "/dev/shm/matrixpool"
    assert args(manifests)["--data-dir"] == "/data"
    mounts = {m["name"]: m["mountPath"] for m in container(manifests)["volumeMounts"]}
    assert mounts["memory"] == args(manifests)["--memory-dir"] == "/dev/shm/matrixpool"
    [init] = pod(manifests)["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}


def test_the_daemon_runs_unprivileged(helm: chart.Helm) -> None:
    security = container(helm.render(ENABLED))["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]


def operator(manifests: list[Manifest]) -> Manifest:
    [found] = chart.only(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(found)


def operator_secret(manifests: list[Manifest]) -> str | None:
    """The Secret the operator mounts where MATRIXPOOL_CKPT_SECRET_FILE points, or None."""
    env = {e["name"]: e.get("value") for e in operator(manifests)["env"]}
    path = env.get("MATRIXPOOL_CKPT_SECRET_FILE")
    if path is None:
        return None
    pod_spec = chart.only(manifests, "Deployment")["spec"]["template"]["spec"]
    [mount] = [m for m in operator(manifests)["volumeMounts"] if path.startswith(m["mountPath"])]
    [volume] = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    return str(volume["secret"]["secretName"])


def test_the_chart_creates_the_secret_the_daemon_and_the_operator_read(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED)
    secret = chart.only(manifests, "Secret")
    assert len(secret["data"]["token"]) >= 40
    assert volumes(manifests)["token"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert args(manifests)["--secret-file"] == "/etc/matrixpool-checkpoint/token"
    assert operator_secret(manifests) == secret["metadata"]["name"]


def test_no_secret_or_token_is_on_the_daemons_command_line(helm: chart.Helm) -> None:
    flags = set(args(helm.render(ENABLED)))
    assert "--token" not in flags
    assert "--token-file" not in flags


def test_the_operator_gets_no_checkpoint_secret_without_the_daemons(helm: chart.Helm) -> None:
    assert operator_secret(helm.render(OFF)) is None


def test_the_token_secret_is_kept_by_helm_and_not_regenerated_on_upgrade() -> None:
    """Rendered once, kept on uninstall (resource-policy keep); its value is reused through
    lookup (which `helm template` cannot do: GitOps users name an existing Secret)."""
    text = (chart.CHART / "templates" / "checkpoint-daemonset.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in text
    assert '$token = index $previous.data "token"' in text


def test_the_token_secret_carries_the_keep_policy(helm: chart.Helm) -> None:
    secret = chart.only(helm.render(ENABLED), "Secret")
    assert secret["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_an_existing_secret_is_used_as_it_is(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED, "checkpointDaemon.token.existingSecret=ckpt-token")
    assert "Secret" not in chart.kinds(manifests)
    assert volumes(manifests)["token"]["secret"]["secretName"] == "ckpt-token"
    assert operator_secret(manifests) == "ckpt-token"


def test_tier_3_is_confined_to_the_persistent_folder(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED, "checkpointDaemon.persistentPath=/mnt/ckpt")
    assert args(manifests)["--persistent-root"] == "/mnt/ckpt"
    assert volumes(manifests)["persistent"]["hostPath"]["path"] == "/mnt/ckpt"
    mounts = {m["name"]: m["mountPath"] for m in container(manifests)["volumeMounts"]}
    assert mounts["persistent"] == "/mnt/ckpt"


def test_daemon_pods_are_not_selected_by_the_operator_service(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED)
    labels = daemonset(manifests)["spec"]["template"]["metadata"]["labels"]
    service = chart.only(manifests, "Service")
    assert not service["spec"]["selector"].items() <= labels.items()
    assert labels["app.kubernetes.io/component"] == "checkpoint-daemon"


REJECTED = [
    ("port=80", "port", "a privileged port"),
    ("memory=lots", "memory", "a malformed memory bound"),
    ("memory=16K", "memory", "a suffix helm and the daemon read differently"),
    ("hostPath=relative", "hostPath", "a relative host path"),
    ("persistentPath=relative", "persistentPath", "a relative persistent path"),
    ("persistentPath=/dev/shm", "overlaps", "a persistent path holding the memory folder"),
    (
        "persistentPath=/var/lib/matrixpool/checkpoints/t3",
        "overlaps",
        "a persistent path inside the tier-2 folder",
    ),
    ("keep=0", "keep", "keeping no step"),
    ("replicas=3", "replicas", "a value the chart does not know"),
]


@pytest.mark.parametrize(("value", "message"), [pytest.param(v, m, id=i) for v, m, i in REJECTED])
def test_the_chart_rejects(helm: chart.Helm, value: str, message: str) -> None:
    result = helm.template(ENABLED, f"checkpointDaemon.{value}")
    assert result.returncode != 0, result.stdout[:400]
    assert message in result.stderr


def test_every_checkpoint_daemon_value_has_a_comment_above_it() -> None:
    text = (chart.CHART / "values.yaml").read_text()
    lines = text.splitlines()
    groups = {
        "checkpointDaemon.image",
        "checkpointDaemon.token",
        "checkpointDaemon.podMonitor",
        "checkpointDaemon.networkPolicy",
    }
    for path, number in chart.key_lines(text).items():
        parts = path.split(".")
        if parts[0] != "checkpointDaemon" or len(parts) > 3 or path in groups:
            continue
        if len(parts) == 3 and ".".join(parts[:2]) not in groups:
            continue  # inside a map value such as resources
        assert lines[number - 1].lstrip().startswith("#"), f"values.yaml:{number + 1} {path}"


def test_the_defaults_are_the_ones_documented() -> None:
    values = yaml.safe_load((chart.CHART / "values.yaml").read_text())["checkpointDaemon"]
    assert values["enabled"] is True
    assert values["token"] == {"existingSecret": ""}


def test_helm_lint_strict_passes_with_the_daemon_on(helm: chart.Helm) -> None:
    result = helm.run(
        "lint", str(chart.CHART), "--strict", "--kube-version", chart.KUBE_VERSION, "--set", ENABLED
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_pod_monitor_is_rendered_only_when_asked_for(helm: chart.Helm) -> None:
    assert "PodMonitor" not in chart.kinds(helm.render(ENABLED))
    manifests = helm.render(ENABLED, "checkpointDaemon.podMonitor.enabled=true")
    monitor = chart.only(manifests, "PodMonitor")
    assert monitor["metadata"]["namespace"] == chart.NAMESPACE
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "checkpoint", "path": "/metrics", "interval": "30s"}
    ]
    pod_labels = daemonset(manifests)["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(manifests)["ports"]}
    assert ports["checkpoint"] == 7040


def test_a_pod_monitor_needs_the_daemons(helm: chart.Helm) -> None:
    result = helm.template(OFF, "checkpointDaemon.podMonitor.enabled=true")
    assert result.returncode != 0, result.stdout[:400]
    assert "podMonitor" in result.stderr or "checkpointDaemon" in result.stderr


def test_helm_lint_strict_passes_with_the_pod_monitor_on(helm: chart.Helm) -> None:
    result = helm.run(
        "lint",
        str(chart.CHART),
        "--strict",
        "--kube-version",
        chart.KUBE_VERSION,
        "--set",
        ENABLED,
        "--set",
        "checkpointDaemon.podMonitor.enabled=true",
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- who reaches the daemon port ------------------------------------------------------------------
def network_policy(manifests: list[Manifest]) -> Manifest:
    return chart.only(manifests, "NetworkPolicy")


def test_a_network_policy_guards_the_daemon_port_by_default(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED)
    policy = network_policy(manifests)["spec"]
    pod_labels = daemonset(manifests)["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    assert rule["ports"] == [{"port": 7040, "protocol": "TCP"}]


def test_only_the_operator_gang_pods_and_other_daemons_may_connect(helm: chart.Helm) -> None:
    manifests = helm.render(ENABLED)
    [rule] = network_policy(manifests)["spec"]["ingress"]
    operator_labels = chart.only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    daemon_labels = daemonset(manifests)["spec"]["template"]["metadata"]["labels"]
    operator, gangs, daemons = rule["from"]
    assert operator.keys() == {"podSelector"}  # the release namespace only
    assert operator["podSelector"]["matchLabels"].items() <= operator_labels.items()
    assert gangs == {
        "namespaceSelector": {},
        "podSelector": {"matchExpressions": [{"key": "matrixpool.dev/job", "operator": "Exists"}]},
    }
    assert daemons["podSelector"]["matchLabels"].items() <= daemon_labels.items()
    assert not operator["podSelector"]["matchLabels"].items() <= daemon_labels.items()


def test_further_sources_are_added_from_the_values(helm: chart.Helm) -> None:
    manifests = helm.render(
        ENABLED, "checkpointDaemon.networkPolicy.extraFrom[0].ipBlock.cidr=10.0.0.0/16"
    )
    [rule] = network_policy(manifests)["spec"]["ingress"]
    assert rule["from"][-1] == {"ipBlock": {"cidr": "10.0.0.0/16"}}
    assert len(rule["from"]) == 4


def test_the_network_policy_can_be_turned_off_and_needs_the_daemons(helm: chart.Helm) -> None:
    off = helm.render(ENABLED, "checkpointDaemon.networkPolicy.enabled=false")
    assert "NetworkPolicy" not in chart.kinds(off)
    assert "NetworkPolicy" not in chart.kinds(helm.render(OFF))


def test_beside_each_daemon_an_announcer_keeps_its_lease_with_a_token_of_its_own(
    helm: chart.Helm,
) -> None:
    manifests = helm.render(ENABLED, "checkpointDaemon.leaseSeconds=20")
    announce = container(manifests, "announce")
    assert announce["command"] == ["matrixpool"]
    assert announce["args"] == [
        "announce",
        "--node=$(NODE_NAME)",
        "--endpoint=$(NODE_IP):7040",
        f"--namespace={chart.NAMESPACE}",
        "--lease-seconds=20",
    ]
    spec = pod(manifests)
    assert spec["automountServiceAccountToken"] is False
    mounts = {c["name"]: {m["name"] for m in c.get("volumeMounts", [])} for c in spec["containers"]}
    assert "announce-token" in mounts["announce"]
    assert "announce-token" not in mounts["daemon"], "the daemon gets no API token"
    sources = volumes(manifests)["announce-token"]["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"

    [account] = [
        m
        for m in manifests
        if m["kind"] == "ServiceAccount" and m["metadata"]["name"] == spec["serviceAccountName"]
    ]
    [role] = [
        m
        for m in manifests
        if m["kind"] == "Role" and m["metadata"]["name"] == account["metadata"]["name"]
    ]
    assert role["metadata"]["namespace"] == chart.NAMESPACE
    assert (
        chart.rules_by_resource(role)
        == chart.ANNOUNCER_RULES
        == {("coordination.k8s.io", "leases"): {"create", "patch"}}
    )
    [binding] = [
        m
        for m in manifests
        if m["kind"] == "RoleBinding" and m["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": chart.NAMESPACE,
        }
    ]


# --- helm test (templates/tests/release-check.yaml) ---


def test_helm_test_checks_the_operator_health_and_every_daemon_lease(helm: chart.Helm) -> None:
    manifests = helm.render(tests=True)
    tests = [m for m in manifests if m["metadata"].get("annotations", {}).get("helm.sh/hook")]
    assert {m["kind"] for m in tests} == {"ServiceAccount", "Role", "RoleBinding", "Pod"}
    assert all(m["metadata"]["annotations"]["helm.sh/hook"] == "test" for m in tests)
    assert not any(m["metadata"].get("annotations", {}).get("helm.sh/hook") for m in helm.render())
    test_pod = chart.only(tests, "Pod")
    [check] = test_pod["spec"]["containers"]
    script = (chart.CHART / "files" / "release_check.py").read_text()
    assert check["command"] == ["python", "-c", script]
    env = {e["name"]: e["value"] for e in check["env"]}
    assert env["DAEMONSET"] == daemonset(helm.render())["metadata"]["name"]
    assert env["HEALTH_PORT"] == "8080"
    assert env["NAMESPACE"] == chart.NAMESPACE
    assert env["RELEASE"] == chart.RELEASE
    # it is neither the operator (the Service, the health check's own pod list) nor a daemon
    operator = chart.only(manifests, "Deployment")["spec"]["selector"]["matchLabels"]
    assert not operator.items() <= test_pod["metadata"]["labels"].items()
    daemons = daemonset(manifests)["spec"]["selector"]["matchLabels"]
    assert not daemons.items() <= test_pod["metadata"]["labels"].items()
    assert check["securityContext"]["readOnlyRootFilesystem"] is True
    role = chart.only(tests, "Role")
    assert chart.rules_by_resource(role) == {
        ("", "pods"): {"list"},
        ("apps", "daemonsets"): {"get"},
        ("coordination.k8s.io", "leases"): {"list"},
    }
    assert (
        chart.only(tests, "RoleBinding")["subjects"][0]["name"]
        == (test_pod["spec"]["serviceAccountName"])
    )
    for m in tests:  # its rights go once it passes; the pod stays for `helm test --logs`
        policy = m["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
        kept = m["kind"] == "Pod"
        assert policy == "before-hook-creation" + ("" if kept else ",hook-succeeded")


def test_helm_test_checks_only_the_operator_without_the_daemons(helm: chart.Helm) -> None:
    test_pod = chart.only(helm.render(OFF, tests=True), "Pod")
    env = {e["name"]: e["value"] for e in test_pod["spec"]["containers"][0]["env"]}
    assert env["DAEMONSET"] == ""
