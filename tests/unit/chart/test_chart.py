"""The Helm chart ``charts/matrixpool``, rendered with ``helm template`` and read with PyYAML.

Checks what a cluster would receive: a non-root, read-only operator pod with resources and
probes; least-privilege RBAC; CRDs kept on uninstall; values rejected by values.schema.json;
``helm lint --strict``. The helm binary comes from ``tools/k8s/build.sh`` (its last stdout line
is the bin folder), the same one the Makefile and CI use.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "matrixpool"
RELEASE = "mp"
NAMESPACE = "matrixpool-system"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion): it must render there.
KUBE_VERSION = "v1.30.0"

Manifest = dict[str, Any]


class Helm:
    """Runs the helm binary against the chart."""

    def __init__(self, path: Path, env: dict[str, str]) -> None:
        self.path = path  # the helm executable
        self.env = env  # HELM_* folders of this test session

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.path), *args], capture_output=True, text=True, env=self.env, check=False
        )

    def template(self, *sets: str, tests: bool = False) -> subprocess.CompletedProcess[str]:
        """``helm template``: what ``helm install`` applies; with ``tests``, also the
        ``helm test`` hooks (templates/tests/), which install does not create."""
        set_args = [arg for value in sets for arg in ("--set", value)]
        return self.run(
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            KUBE_VERSION,
            *([] if tests else ["--skip-tests"]),
            *set_args,
        )

    def render(self, *sets: str, tests: bool = False) -> list[Manifest]:
        result = self.template(*sets, tests=tests)
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def only(manifests: list[Manifest], kind: str) -> Manifest:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def operators(manifests: list[Manifest], kind: str) -> Manifest:
    """The one ``kind`` of the operator (component label ``operator``): the checkpoint daemons,
    on by default, bring a ServiceAccount, Role and RoleBinding of their own."""
    mine = [m for m in manifests if m["metadata"].get("labels", {}).get(COMPONENT) == "operator"]
    return only(mine, kind)


COMPONENT = "app.kubernetes.io/component"


def kinds(manifests: list[Manifest]) -> set[str]:
    return {m["kind"] for m in manifests}


def operator_container(manifests: list[Manifest]) -> Manifest:
    containers: list[Manifest] = only(manifests, "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    assert len(containers) == 1
    return containers[0]


def rules_by_resource(role: Manifest) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


READ = {"get", "list", "watch"}
Rules = dict[tuple[str, str], set[str]]
# The code that runs in the operator process and talks to the API (devcluster and the kubectl
# plugin run with the user's own credentials).
OPERATOR_CODE = ("k8s", "state", "controllers", "runner.py")
ANCHOR_CODE = "k8s/anchor.py"  # writes only the anchor ConfigMap, in the operator's namespace
# Runs beside each checkpoint daemon (matrixpool announce) under the daemon's ServiceAccount.
DAEMON_CODE = "k8s/daemonleases.py"
API_CALL = re.compile(r"\.(?:core|custom|coordination|extensions)\.(\w+)\(")
METHOD = re.compile(r"^(create|patch|delete|replace|read|list)_(namespaced_|cluster_)?(\w+)$")
VERB = {"create": "create", "patch": "patch", "delete": "delete", "replace": "update"}
VERB |= {"read": "get", "list": "list"}
CORE = {"pod": "pods", "pod_binding": "pods/binding", "config_map": "configmaps", "node": "nodes"}
CORE |= {"secret": "secrets", "service": "services", "namespace": "namespaces"}
CORE |= {"pod_for_all_namespaces": "pods"}  # the device plugin's list (deviceplugin/kube.py)
GROUPED = {"lease": ("coordination.k8s.io", "leases")}


def _add(rules: Rules, group: str, resource: str, *verbs: str) -> None:
    rules.setdefault((group, resource), set()).update(verbs)


def _api_calls(path: Path, rules: Rules) -> None:
    """The kubernetes-client calls in ``path`` as (group, resource) -> verbs."""
    from matrixpool.api import crdgen

    for method in API_CALL.findall(path.read_text()):
        found = METHOD.match(method)
        assert found, f"{path}: no RBAC mapping for API method {method}"
        verb, scope, thing = VERB[found[1]], found[2], found[3]
        if thing.startswith("custom_object"):
            suffix = thing.removeprefix("custom_object").replace("_", "/")
            for kind in crdgen.RESOURCES:
                if kind.namespaced == (scope == "namespaced_"):
                    _add(rules, "matrixpool.dev", kind.plural + suffix, verb)
        elif thing in GROUPED:
            _add(rules, *GROUPED[thing], verb)
        else:
            assert thing in CORE, f"{path}: no RBAC mapping for API method {method}"
            _add(rules, "", CORE[thing], verb)


def _kopf_needs(cluster: Rules, anchor: Rules) -> None:
    """What kopf does on the operator's behalf: list and watch what it indexes, watches or runs
    handlers for; patch a daemon's object (finalizer, progress annotations: the anchor) and the
    objects of change handlers (the diff-base annotation); post Events; follow CRDs and
    namespaces."""
    import kopf

    from matrixpool.controllers import credentials, loop  # noqa: F401 -- registers every handler

    registry = kopf.get_default_registry()
    for handler in registry._indexing.get_all_handlers():
        _add(cluster, *_watched(handler.selector), *READ)
    for daemon in registry._spawning.get_all_handlers():
        _add(cluster, *_watched(daemon.selector), *READ)
        _add(anchor, *_watched(daemon.selector), "patch")
    for watcher in registry._watching.get_all_handlers():
        _add(cluster, *_watched(watcher.selector), *READ)
    for changer in registry._changing.get_all_handlers():  # kopf patches in its diff-base
        _add(cluster, *_watched(changer.selector), *READ, "patch")
    _add(cluster, "", "events", "create")
    _add(cluster, "apiextensions.k8s.io", "customresourcedefinitions", *READ)
    _add(cluster, "", "namespaces", *READ)


def _watched(selector: Any) -> tuple[str, str]:
    """(group, resource) of a kopf handler's selector."""
    assert selector is not None
    return selector.group or "", str(selector.any_name)


def rules_the_code_uses() -> tuple[Rules, Rules]:
    """(cluster-wide, operator namespace only) rules, derived from the operator's code."""
    cluster: Rules = {}
    anchor: Rules = {}
    code = ROOT / "operator" / "matrixpool"
    for part in OPERATOR_CODE:
        for path in (
            sorted((code / part).rglob("*.py")) if (code / part).is_dir() else [code / part]
        ):
            if path != code / DAEMON_CODE:
                _api_calls(path, anchor if path == code / ANCHOR_CODE else cluster)
    _kopf_needs(cluster, anchor)
    # blockOwnerDeletion on the owner references of pods and ConfigMaps (pods.owner_reference)
    for plural in ("trainingjobs", "inferenceservices"):
        _add(cluster, "matrixpool.dev", f"{plural}/finalizers", "update")
    anchor = {k: v - cluster.get(k, set()) for k, v in anchor.items()}
    return cluster, {k: v for k, v in anchor.items() if v}


def rules_the_announcer_uses() -> Rules:
    """What ``matrixpool announce`` (the daemon's Lease) does, in the release namespace."""
    rules: Rules = {}
    _api_calls(ROOT / "operator" / "matrixpool" / DAEMON_CODE, rules)
    return rules


EXPECTED_RULES, EXPECTED_NAMESPACE_RULES = rules_the_code_uses()
ANNOUNCER_RULES = rules_the_announcer_uses()
PEERING_RULES = {
    ("kopf.dev", "clusterkopfpeerings"): READ | {"patch"},
    ("kopf.dev", "kopfpeerings"): READ | {"patch"},
}


# --- the operator pod ---


def test_operator_pod_runs_as_non_root_user_65532_with_runtime_default_seccomp(
    helm: Helm,
) -> None:
    pod = only(helm.render(), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_operator_container_is_read_only_unprivileged_and_drops_all_capabilities(
    helm: Helm,
) -> None:
    security = operator_container(helm.render())["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 65532
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}


def test_tmp_is_a_writable_empty_dir_because_the_root_filesystem_is_read_only(
    helm: Helm,
) -> None:
    manifests = helm.render()
    volumes = only(manifests, "Deployment")["spec"]["template"]["spec"]["volumes"]
    mounts = operator_container(manifests)["volumeMounts"]
    tmp_volume = next(m["name"] for m in mounts if m["mountPath"] == "/tmp")
    assert "emptyDir" in next(v for v in volumes if v["name"] == tmp_volume)


def test_operator_container_sets_cpu_and_memory_requests_and_limits(helm: Helm) -> None:
    resources = operator_container(helm.render())["resources"]
    assert set(resources["requests"]) >= {"cpu", "memory"}
    assert set(resources["limits"]) >= {"cpu", "memory"}


@pytest.mark.parametrize("probe", ["livenessProbe", "readinessProbe"])
def test_probe_asks_kopf_liveness_endpoint_on_port_8080(helm: Helm, probe: str) -> None:
    container = operator_container(helm.render())
    get = container[probe]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert get["path"] == "/healthz"
    assert ports.get(get["port"], get["port"]) == 8080
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]


@pytest.mark.parametrize(
    ("sets", "expected_args"),
    [
        pytest.param(
            (),
            ["run", "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090"],
            id="by default it runs standalone over all namespaces",
        ),
        pytest.param(
            ("operator.namespaces={ml,serving}",),
            [
                "run",
                "--liveness=http://0.0.0.0:8080/healthz",
                "--metrics-port=9090",
                "--namespace=ml",
                "--namespace=serving",
            ],
            id="each watched namespace becomes one --namespace",
        ),
        pytest.param(
            ("operator.peering.enabled=true", "operator.peering.name=pool"),
            [
                "run",
                "--liveness=http://0.0.0.0:8080/healthz",
                "--metrics-port=9090",
                "--peering=pool",
            ],
            id="peering passes its name",
        ),
        pytest.param(
            ("operator.peering.enabled=true",),
            [
                "run",
                "--liveness=http://0.0.0.0:8080/healthz",
                "--metrics-port=9090",
                "--peering=mp-matrixpool",
            ],
            id="peering without a name uses the release's full name",
        ),
    ],
)
def test_operator_args_follow_the_values(
    helm: Helm, sets: tuple[str, ...], expected_args: list[str]
) -> None:
    assert operator_container(helm.render(*sets))["args"] == expected_args


def test_the_operator_serves_metrics_on_the_port_the_service_targets(helm: Helm) -> None:
    args = operator_container(helm.render("metrics.port=9191"))["args"]
    assert "--metrics-port=9191" in args
    assert "--metrics-port=0" in operator_container(helm.render("metrics.enabled=false"))["args"]


def test_logs_are_json_at_info_level_by_default(helm: Helm) -> None:
    env = {e["name"]: e.get("value") for e in operator_container(helm.render())["env"]}
    assert env["MATRIXPOOL_LOG_FORMAT"] == "json"
    assert env["MATRIXPOOL_LOG_LEVEL"] == "info"


def test_old_operator_stops_before_the_new_one_starts(helm: Helm) -> None:
    assert only(helm.render(), "Deployment")["spec"]["strategy"] == {"type": "Recreate"}


def test_image_tag_defaults_to_the_app_version(helm: Helm) -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert operator_container(helm.render())["image"] == f"matrixpool:{app_version}"


# --- RBAC ---


def test_cluster_role_grants_exactly_what_the_operator_uses(helm: Helm) -> None:
    assert rules_by_resource(only(helm.render(), "ClusterRole")) == EXPECTED_RULES


def test_the_anchor_is_patched_and_deleted_only_in_the_release_namespace(helm: Helm) -> None:
    manifests = helm.render()
    role = operators(manifests, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert (
        rules_by_resource(role)
        == EXPECTED_NAMESPACE_RULES
        == {("", "configmaps"): {"patch", "delete"}}
    )
    binding = operators(manifests, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == only(manifests, "ClusterRoleBinding")["subjects"]


def test_the_code_derivation_sees_every_kind_of_call() -> None:
    """The derived list is not vacuous: binding, status patches and ConfigMaps are in it."""
    assert EXPECTED_RULES[("", "pods/binding")] == {"create"}
    assert EXPECTED_RULES[("matrixpool.dev", "trainingjobs/status")] == {"patch"}
    assert EXPECTED_RULES[("", "configmaps")] == READ | {"create", "update"}
    assert ("", "pods/eviction") not in EXPECTED_RULES
    assert ("", "pods/status") not in EXPECTED_RULES


def test_the_main_loop_runs_only_on_the_anchor_in_the_operator_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from matrixpool.controllers import loop
    from matrixpool.k8s import anchor

    monkeypatch.setenv("MATRIXPOOL_NAMESPACE", NAMESPACE)
    assert loop.is_anchor(name=anchor.NAME, namespace=NAMESPACE)
    assert not loop.is_anchor(name=anchor.NAME, namespace="someone-else")
    assert not loop.is_anchor(name="other", namespace=NAMESPACE)


def test_cluster_role_has_no_wildcards(helm: Helm) -> None:
    role = only(helm.render("operator.peering.enabled=true"), "ClusterRole")
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert not any("*" in entry for entry in rule[field]), rule
        assert "resourceNames" not in rule or rule["resourceNames"]


def test_cluster_role_lets_the_operator_bind_gang_pods(helm: Helm) -> None:
    rules = rules_by_resource(only(helm.render(), "ClusterRole"))
    assert "create" in rules[("", "pods/binding")]


def test_peering_adds_kopf_peering_rules(helm: Helm) -> None:
    role = only(helm.render("operator.peering.enabled=true"), "ClusterRole")
    assert rules_by_resource(role) == EXPECTED_RULES | PEERING_RULES


def test_cluster_role_binding_grants_the_role_to_the_operator_service_account(
    helm: Helm,
) -> None:
    manifests = helm.render()
    binding = only(manifests, "ClusterRoleBinding")
    account = operators(manifests, "ServiceAccount")
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == only(manifests, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_cluster_scoped_names_include_the_release_name(helm: Helm) -> None:
    manifests = helm.render()
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        assert RELEASE in only(manifests, kind)["metadata"]["name"]


def test_rbac_and_service_account_can_be_left_to_the_cluster_admin(helm: Helm) -> None:
    # The operator's; the checkpoint daemons' announcer keeps a ServiceAccount, Role and
    # RoleBinding of its own whatever rbac.create says (checkpoint-daemonset.yaml), so they
    # are off here.
    manifests = helm.render(
        "rbac.create=false",
        "serviceAccount.create=false",
        "serviceAccount.name=ops",
        "checkpointDaemon.enabled=false",
    )
    assert not kinds(manifests) & {
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    }
    pod = only(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ops"


# --- CRDs ---


def matrixpool_crds(manifests: list[Manifest]) -> list[Manifest]:
    return [
        m
        for m in manifests
        if m["kind"] == "CustomResourceDefinition" and m["spec"]["group"] == "matrixpool.dev"
    ]


def test_chart_installs_the_three_matrixpool_crds_and_keeps_them_on_uninstall(
    helm: Helm,
) -> None:
    crds = matrixpool_crds(helm.render("crds.install=true"))
    assert len(crds) >= 3, "the CRD templates under templates/crds/ are missing"
    assert {c["spec"]["names"]["plural"] for c in crds} >= {
        "supernodes",
        "trainingjobs",
        "inferenceservices",
    }
    for crd in crds:
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_crds_are_left_out_when_crds_install_is_false(helm: Helm) -> None:
    assert matrixpool_crds(helm.render("crds.install=false")) == []


def test_peering_creates_the_cluster_peering_object_after_its_crds(helm: Helm) -> None:
    manifests = helm.render("operator.peering.enabled=true")
    peering_crds = [
        m
        for m in manifests
        if m["kind"] == "CustomResourceDefinition" and m["spec"]["group"] == "kopf.dev"
    ]
    assert {c["metadata"]["name"] for c in peering_crds} == {
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }
    assert all(
        c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for c in peering_crds
    )
    peering = only(manifests, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "mp-matrixpool"
    assert "post-install" in peering["metadata"]["annotations"]["helm.sh/hook"]


def test_namespaced_operator_peers_in_each_namespace(helm: Helm) -> None:
    manifests = helm.render(
        "operator.peering.enabled=true",
        "operator.peering.installCRDs=false",
        "operator.namespaces={ml,serving}",
    )
    peerings = [m for m in manifests if m["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["ml", "serving"]
    assert "ClusterKopfPeering" not in kinds(manifests)
    assert not [m for m in manifests if m["metadata"]["name"].endswith(".kopf.dev")]


def test_no_peering_objects_without_peering(helm: Helm) -> None:
    manifests = helm.render()
    assert not kinds(manifests) & {"ClusterKopfPeering", "KopfPeering"}
    assert not [m for m in manifests if m["metadata"]["name"].endswith(".kopf.dev")]


# --- metrics ---


def test_metrics_port_is_exposed_by_a_service(helm: Helm) -> None:
    manifests = helm.render()
    ports = {p["name"]: p["containerPort"] for p in operator_container(manifests)["ports"]}
    service = only(manifests, "Service")
    assert ports["metrics"] == 9090
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_metrics_can_be_turned_off(helm: Helm) -> None:
    manifests = helm.render("metrics.enabled=false")
    assert "Service" not in kinds(manifests)
    assert "metrics" not in {p["name"] for p in operator_container(manifests)["ports"]}


def test_service_monitor_is_rendered_only_when_asked_for(helm: Helm) -> None:
    assert "ServiceMonitor" not in kinds(helm.render())
    monitor = only(helm.render("serviceMonitor.enabled=true"), "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s"}
    ]


# --- values.schema.json and the template's own checks ---


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        pytest.param(("replicaCount=-1",), "replicaCount", id="a negative replica count"),
        pytest.param(("replicaCount=2",), "peering", id="two replicas without kopf peering"),
        pytest.param(("operator.logFormat=xml",), "logFormat", id="an unknown log format"),
        pytest.param(("image.pullPolicy=Sometimes",), "pullPolicy", id="an unknown pull policy"),
        pytest.param(("replicas=3",), "replicas", id="a value the chart does not know"),
        pytest.param(("metrics.port=8080",), "port", id="metrics on the liveness port"),
        pytest.param(
            ("resources.requests.memory=lots",), "memory", id="a malformed memory quantity"
        ),
        pytest.param(
            ("operator.namespaces={Not_A_Namespace}",),
            "namespaces",
            id="a namespace that is not a DNS label",
        ),
        pytest.param(
            ("serviceMonitor.enabled=true", "metrics.enabled=false"),
            "metrics",
            id="a ServiceMonitor without metrics",
        ),
    ],
)
def test_chart_rejects(helm: Helm, sets: tuple[str, ...], message: str) -> None:
    result = helm.template(*sets)
    assert result.returncode != 0, f"{sets} rendered:\n{result.stdout[:400]}"
    assert message in result.stderr


def test_two_replicas_render_once_peering_is_on(helm: Helm) -> None:
    manifests = helm.render("replicaCount=2", "operator.peering.enabled=true")
    assert only(manifests, "Deployment")["spec"]["replicas"] == 2


def test_values_schema_is_draft_07_and_closed_at_the_top() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["additionalProperties"] is False
    assert set(values) <= set(schema["properties"])


# Keys of values.yaml that only group other values; each value inside carries its own comment.
VALUE_GROUPS = {
    "image",
    "operator",
    "operator.peering",
    "serviceAccount",
    "rbac",
    "podAnnotationsPolicy",
    "crds",
    "metrics",
    "serviceMonitor",
}


def key_lines(text: str) -> dict[str, int]:
    """Line index of every mapping key in a block-style YAML file, by dotted path."""
    found: dict[str, int] = {}
    stack: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines()):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match[1]), match[2]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        found[".".join([k for _, k in stack] + [key])] = number
        stack.append((indent, key))
    return found


def test_every_value_has_a_comment_above_it() -> None:
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    for path, number in key_lines(text).items():
        parent = path.rpartition(".")[0]
        if path in VALUE_GROUPS or (parent and parent not in VALUE_GROUPS):
            continue
        assert lines[number - 1].lstrip().startswith("#"), f"values.yaml:{number + 1} {path}"


@pytest.mark.parametrize(
    "sets",
    [
        pytest.param((), id="default values"),
        pytest.param(
            (
                "replicaCount=2",
                "operator.peering.enabled=true",
                "serviceMonitor.enabled=true",
                "operator.namespaces={ml}",
                "priorityClassName=system-cluster-critical",
            ),
            id="every option turned on",
        ),
    ],
)
def test_helm_lint_strict_passes(helm: Helm, sets: tuple[str, ...]) -> None:
    set_args = [arg for value in sets for arg in ("--set", value)]
    result = helm.run("lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION, *set_args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_extra_env_reaches_the_operator_container(helm: Helm) -> None:
    sets = ("operator.extraEnv[0].name=MATRIXPOOL_CLOCK_START", "operator.extraEnv[0].value=now")
    env = {e["name"]: e.get("value") for e in operator_container(helm.render(*sets))["env"]}
    assert env["MATRIXPOOL_CLOCK_START"] == "now"
