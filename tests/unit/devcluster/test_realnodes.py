"""The real nodes' files and names (matrixpool.devcluster.realnodes), without starting them."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

from matrixpool.api import labels
from matrixpool.devcluster import images, realnodes


def test_two_cluster_folders_get_different_names_and_subnets(tmp_path: Path) -> None:
    a = realnodes.Network.of(tmp_path / "a")
    b = realnodes.Network.of(tmp_path / "b")
    assert a.tag != b.tag
    assert a == realnodes.Network.of(tmp_path / "a")  # stable: down finds what up made
    for network in (a, b):
        assert len(network.bridge) <= 15  # IFNAMSIZ
        assert len(network.host_veth(63)) <= 15
        assert 100 <= network.octet < 200
    assert a.node_ip(0) != a.node_ip(1)
    assert a.pod_subnet(0) != a.pod_subnet(1)
    assert a.gateway == f"10.{a.octet}.0.1"


def test_containerd_config_keeps_every_path_in_the_node_folder(tmp_path: Path) -> None:
    node = realnodes.Node(1, tmp_path / "real-1")
    config = realnodes.containerd_config(node)
    assert f'address = "{node.socket}"' in config
    assert f'root = "{tmp_path / "real-1" / "containerd" / "root"}"' in config
    assert f'sandbox_image = "{realnodes.PAUSE_IMAGE}"' in config
    # Without it runc fails on this machine ("can't get final child's PID from pipe").
    assert "restrict_oom_score_adj = true" in config
    assert "netns_mounts_under_state_dir = true" in config
    assert str(tmp_path / "real-1" / "cni" / "net.d") in config


def test_a_kept_root_is_named_by_node_index_and_its_state_stays_in_the_node_folder(
    tmp_path: Path,
) -> None:
    node = realnodes.Node(2, tmp_path / "cluster" / "real-2")
    store = realnodes.image_store(tmp_path / "cache", node.index)
    assert store == tmp_path / "cache" / "realnodes" / "containerd-2"
    config = realnodes.containerd_config(node, store)
    assert f'root = "{store}"' in config
    assert f'state = "{node.folder / "containerd" / "state"}"' in config  # tasks die with it


def test_a_kept_root_serves_one_containerd_at_a_time(tmp_path: Path) -> None:
    store = realnodes.image_store(tmp_path, 0)
    held = realnodes.lock_store(store)
    assert held is not None
    assert store.is_dir()
    assert realnodes.lock_store(store) is None  # another cluster's containerd holds it
    other = realnodes.lock_store(realnodes.image_store(tmp_path, 1))  # another node's
    assert other is not None
    os.close(other)
    os.close(held)  # its containerd (and shims) gone
    again = realnodes.lock_store(store)
    assert again is not None
    os.close(again)


def test_cni_gives_each_node_its_own_pod_subnet_and_address_file(tmp_path: Path) -> None:
    network = realnodes.Network("abcd", 150)
    first = realnodes.cni_config(realnodes.Node(0, tmp_path / "real-0"), network)
    second = realnodes.cni_config(realnodes.Node(1, tmp_path / "real-1"), network)
    ipam = [c["plugins"][0]["ipam"] for c in (first, second)]
    assert ipam[0]["ranges"] == [[{"subnet": "10.150.1.0/24"}]]
    assert ipam[1]["ranges"] == [[{"subnet": "10.150.2.0/24"}]]
    assert ipam[0]["dataDir"] != ipam[1]["dataDir"]
    assert first["name"] != second["name"]
    json.dumps(first)  # containerd reads it as JSON


def test_kubelet_never_collects_images_it_could_not_pull_again(tmp_path: Path) -> None:
    config = realnodes.kubelet_config(realnodes.Node(0, tmp_path), tmp_path / "ca.crt")
    assert config["imageGCHighThresholdPercent"] == 100
    assert config["failCgroupV1"] is False
    assert (
        config["containerRuntimeEndpoint"]
        == f"unix://{tmp_path / 'containerd' / 'containerd.sock'}"
    )
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["authentication"]["x509"]["clientCAFile"] == str(tmp_path / "ca.crt")


def test_node_processes_enter_the_nodes_network_and_mounts(tmp_path: Path) -> None:
    network = realnodes.Network("abcd", 150)
    node = realnodes.Node(2, tmp_path / "real-2")
    args = realnodes.kubelet_args(node, network, Path("/bin-dir"), {"type": "real"})
    assert args[:4] == [
        "nsenter",
        "--net=/run/netns/mpabcdn2",
        f"--mount={realnodes.MOUNT_NAMESPACES / 'abcd' / 'mpabcdn2'}",
        "--",
    ]
    assert "--node-ip=10.150.0.12" in args
    assert "--hostname-override=real-2" in args
    assert "--root-dir=/var/lib/kubelet" in args  # the node's own, bound in its mount namespace
    assert "/var/lib/kubelet" in realnodes.NODE_PATHS
    assert "/var/lib/matrixpool/persistent" not in realnodes.NODE_PATHS  # tier 3 is shared


def test_real_nodes_are_labelled_into_racks_of_their_supernode() -> None:
    assert realnodes.node_labels(3, 2, "sn-real") == {
        labels.SUPERNODE: "sn-real",
        labels.RACK: "sn-real-rack-1",
        "type": "real",
    }


def test_a_docker_archive_holds_the_layers_and_a_config_naming_them(tmp_path: Path) -> None:
    payload = tmp_path / "hello"
    payload.write_bytes(b"#!/bin/sh\necho hi\n")
    layer = images.layer_of_files({"hello": payload})
    out = images.write_archive(
        tmp_path / "img.tar", "example/hello:1", layers=[layer], config={"Entrypoint": ["/hello"]}
    )
    with tarfile.open(out) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        config = json.load(tar.extractfile(manifest[0]["Config"]))  # type: ignore[arg-type]
        with tarfile.open(fileobj=tar.extractfile("0/layer.tar")) as inner:
            assert inner.getnames() == ["hello"]
    assert manifest[0]["RepoTags"] == ["example/hello:1"]
    assert config["rootfs"]["diff_ids"] == [images.digest(layer)]
    assert config["config"]["Entrypoint"] == ["/hello"]
    assert config["config"]["Env"][0].startswith("PATH=")


def test_an_oci_stream_of_an_archive_leaves_out_the_layers_a_node_holds(tmp_path: Path) -> None:
    files = []
    for name in ("base", "app"):
        (tmp_path / name).write_text(name)
        files.append(images.layer_of_files({name: tmp_path / name}))
    archive = images.write_archive(
        tmp_path / "img.tar", "matrixpool:dev", layers=files, config={"User": "65532:65532"}
    )
    base, app = (images.digest(f) for f in files)
    out = io.BytesIO()
    name = "example.invalid/library/matrixpool:dev"
    assert images.write_oci(archive, out, name, have={base}) == [app]
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        blobs = {n.removeprefix("blobs/sha256/") for n in tar.getnames() if n.startswith("blobs/")}
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        [entry] = index["manifests"]
        manifest = json.load(tar.extractfile(f"blobs/sha256/{entry['digest'][7:]}"))  # type: ignore[arg-type]
        layer = tar.extractfile(f"blobs/sha256/{app[7:]}")
        assert layer is not None
        assert layer.read() == files[1].read_bytes()
        assert json.load(tar.extractfile("oci-layout")) == {"imageLayoutVersion": "1.0.0"}  # type: ignore[arg-type]
    # The named image, its manifest and config, and only the layer the node lacks.
    assert entry["annotations"][images.NAME_ANNOTATION] == name
    assert [layer["digest"] for layer in manifest["layers"]] == [base, app]
    assert blobs == {entry["digest"][7:], manifest["config"]["digest"][7:], app[7:]}
    out = io.BytesIO()
    assert images.write_oci(archive, out, name) == [base, app]  # a node with an empty root


def test_chain_ids_name_the_snapshots_containerd_unpacked() -> None:
    # containerd 1.6 unpacked a two-layer image into snapshots 8d2b… and aab3e6… (parent
    # 8d2b…), and the same base under another app layer 11204c… into e1694c….
    base = "sha256:8d2b041636dfebe1d2a0a01d578d7954201fb8febc3b0fadf0d880ddeecdd187"
    app1 = "sha256:77db91be055db74cc01aa5f77f130152b56b0d7b479d187d89931dc70e78d0eb"
    app2 = "sha256:11204c3b860c916d55a17d4517d8b8f4a5b31eec338248af8cbb8c462972ee3a"
    assert images.chain_ids([base, app1]) == [
        base,
        "sha256:aab3e6acd454337f8f9b3355d6ecc4a1ce7d0d5474cca6b0e1bdc7a01c683f0c",
    ]
    assert images.chain_ids([base, app2])[1] == (
        "sha256:e1694cbcfda36a8a0a7c7efeeb2fcca65bb5f4ce1fb32967f6e147684aa38c4c"
    )
    assert images.chain_ids([]) == []


def test_the_diff_ids_of_an_archive_are_its_layers_digests(tmp_path: Path) -> None:
    files = []
    for name in ("base", "app"):
        (tmp_path / name).write_text(name)
        files.append(images.layer_of_files({name: tmp_path / name}))
    archive = images.write_archive(tmp_path / "img.tar", "x:1", layers=files, config={})
    assert images.diff_ids(archive) == [images.digest(f) for f in files]


def test_short_image_names_are_spelled_with_the_runtimes_domain() -> None:
    domain = "example.invalid"
    assert images.full_name("matrixpool:dev", domain) == f"{domain}/library/matrixpool:dev"
    assert images.full_name("matrixpool/pause:local", domain) == f"{domain}/matrixpool/pause:local"
    assert images.full_name("localhost/x:1", domain) == "localhost/x:1"
    assert images.full_name("localhost:5000/a/b:1", domain) == "localhost:5000/a/b:1"


def test_the_dockerfile_describes_the_image_make_image_builds() -> None:
    root = Path(__file__).resolve().parents[3]
    script = (root / "tools" / "image" / "build.sh").read_text()
    dockerfile = (root / "Dockerfile").read_text()
    listed = re.search(r"^packages=\(([^)]*)\)", script, re.M)
    assert listed is not None
    installed = re.search(r"--no-install-recommends \\\n\s+([^\n]+) \\\n", dockerfile)
    assert installed is not None
    assert set(listed.group(1).split()) == set(installed.group(1).split())
    for same in ('"User": "65532:65532"', '"Entrypoint": ["matrixpool"]', "--system-site-packages"):
        assert same in script
    assert "USER 65532:65532" in dockerfile
    assert 'ENTRYPOINT ["matrixpool"]' in dockerfile
    assert "--system-site-packages /opt/matrixpool" in dockerfile


def test_kubelets_send_pods_to_the_cluster_dns_through_kube_dns(tmp_path: Path) -> None:
    config = realnodes.kubelet_config(realnodes.Node(0, tmp_path), tmp_path / "ca.crt")
    assert config["clusterDNS"] == ["10.96.0.10"]  # kube-dns, which kube-proxy carries
    assert config["clusterDomain"] == "cluster.local"


def test_each_node_runs_kube_proxy_in_iptables_mode_in_its_own_network(tmp_path: Path) -> None:
    network = realnodes.Network("abcd", 150)
    node = realnodes.Node(2, tmp_path / "real-2")
    config = realnodes.kube_proxy_config(node, network)
    assert config["mode"] == "iptables"
    assert config["hostnameOverride"] == "real-2"
    assert config["clusterCIDR"] == "10.150.0.0/16"  # every node's pods
    assert config["nodePortAddresses"] == ["10.150.0.12/32"]
    assert config["clientConnection"]["kubeconfig"].startswith(str(node.folder))
    assert config["conntrack"] == {"maxPerCore": 0, "min": 0}  # the machine's limits stay
    args = realnodes.kube_proxy_args(node, network, Path("/bin-dir"))
    assert args[:2] == ["nsenter", "--net=/run/netns/mpabcdn2"]
    assert "/bin-dir/kube-proxy" in args


def test_a_power_cut_kills_a_containers_whole_tree_and_nothing_else() -> None:
    """A container sharing this machine's pid namespace (hostPID) loses its process tree,
    never the namespace: this test's own process lives on."""
    tree = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 301 & wait"])
    bystander = subprocess.Popen(["sleep", "302"])
    try:
        deadline = time.monotonic() + 10
        while len(_children(tree.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        children = _children(tree.pid)
        assert len(children) == 2
        realnodes.kill_containers([tree.pid])
        assert tree.wait(timeout=10) == -9
        assert not [c for c in children if _running(c)]
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
