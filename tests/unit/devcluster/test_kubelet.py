"""The process kubelet's reading of a pod (``matrixpool.devcluster.kubelet``): env as a kubelet
resolves it, volume files, which pods it runs, and the mount-namespace launcher."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from matrixpool.devcluster import kubelet
from matrixpool.k8s import pods
from matrixpool.placement import gangs, model
from tests import ci

POD = {
    "metadata": {
        "name": "llm-2",
        "namespace": "ns",
        "uid": "p-1",
        "labels": {"matrixpool.dev/rank": "2"},
        "annotations": {
            "matrixpool.dev/incarnation": "17",
            "matrixpool.dev/restore": '{"step": 4}',
        },
    },
    "spec": {"nodeName": "n0", "serviceAccountName": "trainer"},
    "status": {"hostIP": "127.1.0.3", "podIP": "10.0.0.9"},
}


class Lookup:
    def __init__(self, secrets: Mapping[str, Mapping[str, bytes]] | None = None) -> None:
        self.secrets = dict(secrets or {})
        self.asked: list[tuple[str, str | None, int]] = []
        self.bound: list[tuple[str, str] | None] = []  # the pod each token was bound to

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        return self.secrets.get(f"{namespace}/{name}")

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        return {"mode": b"fast"} if name == "settings" else None

    def token(
        self,
        namespace: str,
        account: str,
        audience: str | None,
        seconds: int,
        pod: tuple[str, str] | None = None,
    ) -> str:
        self.asked.append((account, audience, seconds))
        self.bound.append(pod)
        return "jwt"


def needs_mount_namespaces() -> None:
    """Mount namespaces need root: skipped elsewhere, a failure under CI=true (CI runs as
    root), the rule of tests/tmpfs.py."""
    able = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if able.returncode != 0:
        ci.cannot_run(f"no mount namespace (needs root): {able.stderr.strip()}")


def test_expansion_follows_kubernetes_rules() -> None:
    env = {"IP": "127.1.0.3"}
    assert kubelet.expand("$(IP):7040", env) == "127.1.0.3:7040"
    assert kubelet.expand("$(MISSING)/x", env) == "$(MISSING)/x"  # left as written
    assert kubelet.expand("$$(IP)", env) == "$(IP)"  # $$ escapes


def test_field_references_read_the_pod() -> None:
    assert kubelet.field_value(POD, "metadata.labels['matrixpool.dev/rank']") == "2"
    assert kubelet.field_value(POD, "metadata.annotations['nope']") == ""
    assert kubelet.field_value(POD, "status.hostIP") == "127.1.0.3"
    assert kubelet.field_value(POD, "spec.nodeName") == "n0"
    text = kubelet.field_value(POD, "metadata.annotations")
    assert text.splitlines() == [
        'matrixpool.dev/incarnation="17"',
        'matrixpool.dev/restore="{\\"step\\": 4}"',
    ]
    with pytest.raises(kubelet.NotReadyError, match="unsupported fieldPath"):
        kubelet.field_value(POD, "spec.containers")


def test_the_operators_training_pod_resolves_to_what_a_trainer_needs() -> None:
    plan = gangs.PodPlan("ns", "llm-2", model.GangKey("ns/llm"), "llm", "TrainingJob", "t", 2, 2, 8)
    contract = pods.TrainingContract("u-1", 4, 17, '{"memory": {"everySteps": 1}}', 7041)
    template = {"spec": {"containers": [{"name": "t", "image": "matrixpool:1", "command": ["x"]}]}}
    owner = {"apiVersion": "v1", "kind": "TrainingJob", "name": "llm", "uid": "u-1"}
    written = pods.manifest(plan, template, owner, "huawei.com/Ascend910", contract)
    pod = {**written, "spec": {**written["spec"], "nodeName": "n0"}, "status": POD["status"]}
    env = kubelet.container_env(pod, pod["spec"]["containers"][0], Lookup(), {"PATH": "/bin"})
    assert env["MATRIXPOOL_CKPT_DAEMON"] == "127.1.0.3:7041"
    assert env["MATRIXPOOL_RANK"] == "2"
    assert env["MATRIXPOOL_INCARNATION"] == "17"
    assert env["MATRIXPOOL_JOB"] == "u-1"
    assert env["PATH"] == "/bin"  # the image's, kept


def test_secret_and_config_map_references() -> None:
    container = {
        "env": [
            {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
            {
                "name": "C",
                "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}},
            },
            {"name": "D", "value": "$(A)-$(B)"},
        ],
        "envFrom": [{"secretRef": {"name": "s"}, "prefix": "S_"}],
    }
    env = kubelet.container_env(POD, container, Lookup({"ns/s": {"k": b"v"}}))
    assert env == {"S_k": "v", "A": "v", "B": "fast", "D": "v-fast"}
    missing = {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "x", "key": "k"}}}]}
    with pytest.raises(kubelet.NotReadyError) as waiting:
        kubelet.container_env(POD, missing, Lookup())
    assert waiting.value.reason == "CreateContainerConfigError"


def test_volume_files() -> None:
    lookup = Lookup({"ns/cred": {"token": b"t0k"}})
    secret = {"name": "c", "secret": {"secretName": "cred"}}
    assert kubelet.volume_files(POD, secret, lookup) == {"token": b"t0k"}
    optional = {"name": "c", "secret": {"secretName": "none", "optional": True}}
    assert kubelet.volume_files(POD, optional, lookup) == {}
    with pytest.raises(kubelet.NotReadyError, match="not found"):
        kubelet.volume_files(POD, {"name": "c", "secret": {"secretName": "none"}}, lookup)
    info = {
        "name": "i",
        "downwardAPI": {
            "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
        },
    }
    assert kubelet.volume_files(POD, info, lookup) == {"labels": b'matrixpool.dev/rank="2"\n'}
    projected = {
        "name": "kube-api-access",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "settings", "items": [{"key": "mode", "path": "m"}]}},
            ]
        },
    }
    assert kubelet.volume_files(POD, projected, lookup) == {"token": b"jwt", "m": b"fast"}
    assert lookup.asked == [("trainer", None, 3607)]
    meta = POD["metadata"]
    assert lookup.bound == [(meta["name"], meta["uid"])]  # bound to its pod, as a kubelet's are
    assert kubelet.volume_files(POD, {"name": "e", "emptyDir": {}}, lookup) is None


def test_only_pods_of_the_matrixpool_image_run_here() -> None:
    def pod(*images: str) -> dict[str, object]:
        return {
            "spec": {"containers": [{"name": str(i), "image": x} for i, x in enumerate(images)]}
        }

    assert kubelet.runs_here(pod("matrixpool:1.2"))
    assert kubelet.runs_here(pod("reg.local:5000/team/matrixpool@sha256:ab"))
    assert not kubelet.runs_here(pod("matrixpool:1", "busybox"))
    assert not kubelet.runs_here(pod("example.invalid/workload:1"))
    assert kubelet.repository("reg.local:5000/matrixpool") == "reg.local:5000/matrixpool"


def test_the_launcher_binds_volumes_where_the_container_sees_them(tmp_path: Path) -> None:
    needs_mount_namespaces()
    source = tmp_path / "volume"
    source.mkdir()
    (source / "token").write_text("secret\n")
    target = tmp_path / "inside" / "credential"
    argv = kubelet.launcher(
        [kubelet.Mount(str(source), str(target), read_only=True)],
        ["sh", "-c", f"cat {target}/token; touch {target}/x 2>/dev/null || echo read-only"],
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["secret", "read-only"]
    assert not (target / "token").exists()  # outside the namespace nothing is mounted


def test_a_mount_over_a_folder_holding_other_sources_comes_last() -> None:
    mounts = [
        kubelet.Mount("/srv/sim/pods/p/tmp", "/tmp"),
        kubelet.Mount("/tmp/sim/pods/p/secret", "/etc/checkpoint"),
        kubelet.Mount("/tmp/sim/pods/p/info", "/var/run/matrixpool/pod"),
        kubelet.Mount("/tmp/sim/nodes/n/data", "/var/run"),
    ]
    argv = kubelet.launcher(mounts, ["true"])
    script = argv[argv.index("-c") + 1]
    targets = [line.split()[-1] for line in script.splitlines() if line.startswith("mount --bind")]
    assert targets[-1] == "/tmp"  # it would hide the other sources
    assert targets.index("/var/run") < targets.index("/var/run/matrixpool/pod")  # parent first


def test_the_image_stays_visible_under_a_volume_mounted_over_its_folder(tmp_path: Path) -> None:
    needs_mount_namespaces()
    root = tmp_path / "root"  # stands for /tmp, where a checkout and its virtualenv may lie
    image = root / "checkout" / ".venv"
    image.mkdir(parents=True)
    (image / "python").write_text("interpreter\n")
    empty = tmp_path / "emptydir"
    empty.mkdir()
    mounts = [kubelet.Mount(str(empty), str(root))]  # the pod's emptyDir at /tmp
    script = f"cat {image}/python; ls {root}"
    hidden = subprocess.run(
        kubelet.launcher(mounts, ["sh", "-c", script]), capture_output=True, text=True
    )
    assert "interpreter" not in hidden.stdout  # without the image folders it is gone
    kept = subprocess.run(
        kubelet.launcher(mounts, ["sh", "-c", script], image=[str(image)]),
        capture_output=True,
        text=True,
        check=True,
    )
    assert kept.stdout.splitlines()[0] == "interpreter"
