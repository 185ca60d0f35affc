"""tools/kind/image-archive.py: the one-layer docker-archives the kind node image preloads into
its containerd (control-plane images from our binaries). containerd's import checks the layer
against the config's diff_id and finds the image by the manifest's RepoTags; kubeadm then finds
it by that exact name, so a wrong digest or name would make kind's nodes pull (and fail here)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "kind" / "image-archive.py"


def _archive(tmp: Path, out: str, *args: str) -> dict[str, bytes]:
    path = tmp / out
    subprocess.run([sys.executable, str(SCRIPT), str(path), *args], check=True)
    files = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member)
            if data is not None:
                files[member.name] = data.read()
    return files


def test_layer_digest_name_and_files(tmp_path: Path) -> None:
    binary = tmp_path / "etcd"
    binary.write_bytes(b"\x7fELF fake etcd")
    binary.chmod(0o600)
    ref = "matrixpool.test/etcd:3.7.0-0"
    files = _archive(
        tmp_path, "a.tar", ref, "--file", f"{binary}=/usr/local/bin/etcd:0755",
        "--entrypoint", '["/usr/local/bin/etcd"]',
    )  # fmt: skip
    (manifest,) = json.loads(files["manifest.json"])
    assert manifest["RepoTags"] == [ref]
    config = json.loads(files[manifest["Config"]])
    assert manifest["Config"] == hashlib.sha256(files[manifest["Config"]]).hexdigest() + ".json"
    layer = files[manifest["Layers"][0]]
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    assert config["config"]["Entrypoint"] == ["/usr/local/bin/etcd"]
    (tmp_path / "layer.tar").write_bytes(layer)
    with tarfile.open(tmp_path / "layer.tar") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert [n for n, m in members.items() if m.isdir()] == ["usr", "usr/local", "usr/local/bin"]
    etcd = members["usr/local/bin/etcd"]
    assert (etcd.mode, etcd.uid, etcd.gid, etcd.mtime) == (0o755, 0, 0, 0)


def test_same_inputs_same_digest(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(b"pause")
    spec = ("pause:3.10.2", "--file", f"{binary}=/pause:0755")
    first = _archive(tmp_path, "1.tar", *spec)
    binary.touch()  # a newer mtime on the source changes nothing
    second = _archive(tmp_path, "2.tar", *spec)
    assert first == second
    binary.write_bytes(b"pause, rebuilt")
    third = _archive(tmp_path, "3.tar", *spec)
    assert json.loads(third["manifest.json"]) != json.loads(first["manifest.json"])
