"""The device plugin's DaemonSet and admission policy in the chart (devicePlugin values), rendered
with helm (issue 31, finding 7: least privilege).

Off by default; when on: a DaemonSet of its own, needing no checkpoint DaemonSet, whose one
container runs as root without capabilities on the kubelet's folder; a ServiceAccount of its
own with exactly the calls of ``matrixpool/deviceplugin/kube.py`` and a pod-bound projected
token; the checkpoint DaemonSet's ServiceAccount keeps the announcer's Lease rights only; a
ValidatingAdmissionPolicy bounds the plugin's pod patches to its node and its annotation.
What the policy admits on a real API server: tests/e2e/test_chart.py.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from matrixpool.deviceplugin import pairing
from tests.unit.chart import test_chart as chart

ON = "devicePlugin.enabled=true"
DAEMON_ON = "checkpointDaemon.enabled=true"
DAEMON_OFF = "checkpointDaemon.enabled=false"
RESOURCE = "huawei.com/Ascend910"
NAME = f"{chart.RELEASE}-matrixpool-device-plugin"
ACCOUNT = f"system:serviceaccount:{chart.NAMESPACE}:{NAME}"
PLUGIN_CODE = chart.ROOT / "operator" / "matrixpool" / "deviceplugin" / "kube.py"
WATCHED = re.compile(r"\.stream\(\s*self\._api\.core\.(\w+),")
Manifest = dict[str, Any]


def rules_the_plugin_uses() -> chart.Rules:
    """The calls of kube.py as (group, resource) -> verbs, read as the operator's are, plus
    ``watch`` for a list method that kubernetes.watch streams."""
    rules: chart.Rules = {}
    chart._api_calls(PLUGIN_CODE, rules)
    for method in WATCHED.findall(PLUGIN_CODE.read_text()):
        found = chart.METHOD.match(method)
        assert found, method
        assert found[1] == "list", method
        chart._add(rules, "", chart.CORE[found[3]], "watch")
    return rules


def named(manifests: list[Manifest], kind: str, name: str = NAME) -> Manifest:
    [found] = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def plugin_pod(manifests: list[Manifest]) -> Manifest:
    spec: Manifest = named(manifests, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def test_the_plugin_is_off_by_default(helm: chart.Helm) -> None:
    manifests = helm.render(DAEMON_ON)
    assert not [m for m in manifests if NAME in m["metadata"]["name"]]


def test_the_plugin_runs_in_a_daemonset_of_its_own_without_the_checkpoint_daemons(
    helm: chart.Helm,
) -> None:
    manifests = helm.render(ON, DAEMON_OFF)
    daemonset = chart.only(manifests, "DaemonSet")
    assert daemonset["metadata"]["name"] == NAME
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "device-plugin"
    assert not [m for m in manifests if m["metadata"]["name"].endswith("-checkpoint")]


def test_the_checkpoint_daemonset_keeps_no_plugin_container_nor_pod_rights(
    helm: chart.Helm,
) -> None:
    manifests = helm.render(DAEMON_ON, ON)
    checkpoint = named(manifests, "DaemonSet", f"{chart.RELEASE}-matrixpool-checkpoint")
    spec = checkpoint["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["daemon", "announce"]
    assert "device-plugins" not in {v["name"] for v in spec["volumes"]}
    bound = {
        m["roleRef"]["name"]
        for m in manifests
        if m["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s["name"] == spec["serviceAccountName"] for s in m["subjects"])
    }
    assert bound == {spec["serviceAccountName"]}  # the announcer's Role, nothing else
    role = named(manifests, "Role", spec["serviceAccountName"])
    assert chart.rules_by_resource(role) == {("coordination.k8s.io", "leases"): {"create", "patch"}}


def test_the_plugin_runs_as_root_without_capabilities_on_the_kubelets_folder(
    helm: chart.Helm,
) -> None:
    manifests = helm.render(ON, "devicePlugin.healthFile=/run/matrixpool/bad-cards")
    spec = plugin_pod(manifests)
    [container] = spec["containers"]
    assert container["name"] == "device-plugin"
    version = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())["appVersion"]
    assert container["image"] == f"matrixpool:{version}"  # the operator's image
    assert container["command"] == ["python", "-m", "matrixpool.deviceplugin"]
    assert container["args"] == [
        "--node=$(NODE_NAME)",
        f"--resource={RESOURCE}",
        "--cards=8",
        "--folder=/var/lib/kubelet/device-plugins",
        "--health-file=/run/matrixpool/bad-cards",
    ]
    [env] = container["env"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    security = container["securityContext"]
    assert (security["runAsUser"], security["readOnlyRootFilesystem"]) == (0, True)
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False
    assert security["privileged"] is False
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "hostNetwork" not in spec, "the plugin needs no host network"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["device-plugins"]["mountPath"] == "/var/lib/kubelet/device-plugins"
    assert volumes["device-plugins"]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    assert mounts["device-health"] == {
        "name": "device-health",
        "mountPath": "/run/matrixpool",
        "readOnly": True,
    }
    assert volumes["device-health"]["hostPath"]["path"] == "/run/matrixpool"
    assert set(mounts) == set(volumes) == {"device-plugins", "device-health", "token"}


def test_the_plugins_token_is_a_pod_bound_projected_one_of_its_own_account(
    helm: chart.Helm,
) -> None:
    manifests = helm.render(ON)
    spec = plugin_pod(manifests)
    assert spec["serviceAccountName"] == NAME
    assert spec["automountServiceAccountToken"] is False
    assert named(manifests, "ServiceAccount")["automountServiceAccountToken"] is False
    [mount] = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "token"]
    assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    assert mount["readOnly"] is True
    [volume] = [v for v in spec["volumes"] if v["name"] == "token"]
    token = volume["projected"]["sources"][0]["serviceAccountToken"]
    assert token == {"path": "token", "expirationSeconds": 3607}  # the API server's audience


def test_the_plugins_cluster_role_grants_exactly_what_its_code_calls(helm: chart.Helm) -> None:
    manifests = helm.render(ON)
    role = named(manifests, "ClusterRole")
    assert (
        chart.rules_by_resource(role)
        == rules_the_plugin_uses()
        == {("", "pods"): {"list", "patch"}, ("", "nodes"): {"list", "watch"}}
    )
    binding = named(manifests, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == NAME
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": NAME, "namespace": chart.NAMESPACE}
    ]


def test_without_rbac_create_only_the_account_is_made(helm: chart.Helm) -> None:
    manifests = helm.render(ON, "rbac.create=false")
    assert named(manifests, "ServiceAccount")
    assert not [m for m in manifests if m["kind"].startswith("ClusterRole") and NAME in str(m)]


def test_node_selector_tolerations_and_priority_follow_the_values(helm: chart.Helm) -> None:
    spec = plugin_pod(
        helm.render(
            ON,
            "devicePlugin.nodeSelector.type=real",
            "devicePlugin.tolerations[0].operator=Exists",
            "devicePlugin.priorityClassName=system-node-critical",
        )
    )
    assert spec["nodeSelector"] == {"type": "real"}
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["priorityClassName"] == "system-node-critical"


def test_the_policy_is_on_with_the_plugin_for_its_account_only(helm: chart.Helm) -> None:
    manifests = helm.render(
        ON,
        "podAnnotationsPolicy.enabled=false",
        "configMapPolicy.enabled=false",
        "daemonLeasePolicy.enabled=false",
    )
    policy = chart.only(manifests, "ValidatingAdmissionPolicy")
    binding = chart.only(manifests, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    [condition] = spec["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "{ACCOUNT}"'
    [rule] = spec["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"]) == ([""], ["pods"])
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert variables["key"] == f"'{pairing.ALLOCATED}'"  # the mark the plugin writes
    assert "authentication.kubernetes.io/node-name" in variables["node"]
    assert all(v["reason"] == "Forbidden" for v in spec["validations"])


def test_the_policy_can_be_left_out_and_needs_the_plugin(helm: chart.Helm) -> None:
    for sets in ((ON, "devicePluginPolicy.enabled=false"), ()):
        manifests = helm.render(
            *sets,
            "podAnnotationsPolicy.enabled=false",
            "configMapPolicy.enabled=false",
            "daemonLeasePolicy.enabled=false",
        )
        assert "ValidatingAdmissionPolicy" not in chart.kinds(manifests)


def test_helm_lint_strict_passes_with_the_plugin_alone(helm: chart.Helm) -> None:
    result = helm.run(
        "lint", str(chart.CHART), "--strict", "--kube-version", chart.KUBE_VERSION, "--set", ON
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_device_plugin_value_has_a_comment_above_it() -> None:
    text = (chart.CHART / "values.yaml").read_text()
    lines = text.splitlines()
    for path, number in chart.key_lines(text).items():
        parts = path.split(".")
        if parts[0] not in ("devicePlugin", "devicePluginPolicy") or len(parts) != 2:
            continue
        assert lines[number - 1].lstrip().startswith("#"), f"values.yaml:{number + 1} {path}"
