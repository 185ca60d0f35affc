"""Container images without a registry: docker-archive files (``ctr images import`` and
``docker load`` read them) made from layer tars and an image config.

Used for the real nodes' pause image (:mod:`matrixpool.devcluster.realnodes`) and by
``tools/image/build.sh`` for the matrixpool image (``python -m matrixpool.devcluster.images``).

:func:`write_oci` turns such an archive into an OCI image layout stream that leaves out the
blobs a containerd already holds (``ctr images import`` writes every blob of an archive to disk
before it finds it has it: 3.3 GB per node for a change to the app layer alone). A containerd
that dropped a layer's blob after unpacking it holds the layer as a snapshot, named by its
chain ID (:func:`chain_ids`).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def layer_of_files(files: Mapping[str, Path], mode: int = 0o755) -> Path:
    """A layer tar holding ``files`` (path in the image → file here), owned by root."""
    fd, name = tempfile.mkstemp(suffix=".tar")
    os.close(fd)
    with tarfile.open(name, "w") as tar:
        for arcname, source in files.items():
            info = tar.gettarinfo(str(source), arcname=arcname)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode, info.mtime = mode, 0
            with open(source, "rb") as f:
                tar.addfile(info, f)
    return Path(name)


def image_config(layers: Sequence[Path], config: Mapping[str, Any]) -> dict[str, Any]:
    """The OCI/docker image config: ``config`` (Entrypoint, Cmd, Env, User, WorkingDir …) over
    a default PATH, and the layers' diff ids."""
    merged = {"Env": [f"PATH={DEFAULT_PATH}"], **config}
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": merged,
        "rootfs": {"type": "layers", "diff_ids": [digest(p) for p in layers]},
    }


def write_archive(
    out: Path, name: str, *, layers: Sequence[Path], config: Mapping[str, Any]
) -> Path:
    """Write a docker-archive of ``layers`` (bottom first) tagged ``name`` to ``out``."""
    blob = json.dumps(image_config(layers, config), sort_keys=True).encode()
    config_name = hashlib.sha256(blob).hexdigest() + ".json"
    manifest = [
        {
            "Config": config_name,
            "RepoTags": [name],
            "Layers": [f"{i}/layer.tar" for i in range(len(layers))],
        }
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        _add_bytes(tar, config_name, blob)
        for i, path in enumerate(layers):
            tar.add(str(path), arcname=f"{i}/layer.tar")
        _add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
    tmp.replace(out)
    return out


OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
NAME_ANNOTATION = "io.containerd.image.name"  # the name containerd's importer gives the image


def full_name(name: str, domain: str) -> str:
    """A short image name as a container runtime spells it, given the ``domain`` it puts before
    a name that has none (the kubelet looks images up under that spelling): ``matrixpool:dev``
    → ``<domain>/library/matrixpool:dev``, ``a/b:1`` → ``<domain>/a/b:1``."""
    first, _, rest = name.partition("/")
    if not rest:
        return f"{domain}/library/{name}"
    if "." in first or ":" in first or first == "localhost":
        return name
    return f"{domain}/{name}"


def write_oci(archive: Path, out: IO[bytes], name: str, have: Collection[str] = ()) -> list[str]:
    """Write the image of docker-archive ``archive`` to ``out`` as an OCI image layout tar
    (streamed: ``out`` may be a pipe) named ``name``, leaving out the layers whose digest is in
    ``have`` (a containerd's ``ctr content ls``). Returns the digests of the layers it wrote."""
    with tarfile.open(archive) as source:
        manifest, config = _docker_image(source)
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        members = [source.getmember(path) for path in manifest["Layers"]]
        layers = [
            {"mediaType": OCI_LAYER, "digest": d, "size": m.size}
            for d, m in zip(diff_ids, members, strict=True)
        ]
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        image = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
            "layers": layers,
        }
        image_blob = json.dumps(image, sort_keys=True).encode()
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": "sha256:" + hashlib.sha256(image_blob).hexdigest(),
                    "size": len(image_blob),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {NAME_ANNOTATION: name},
                }
            ],
        }
        written = []
        with tarfile.open(fileobj=out, mode="w|") as tar:
            _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
            for blob in (config, image_blob):
                _add_bytes(tar, _blob_path("sha256:" + hashlib.sha256(blob).hexdigest()), blob)
            for layer, member in zip(layers, members, strict=True):
                if layer["digest"] in have:
                    continue
                info = tarfile.TarInfo(_blob_path(layer["digest"]))
                info.size, info.mtime = member.size, 0
                tar.addfile(info, source.extractfile(member))
                written.append(layer["digest"])
            _add_bytes(tar, "index.json", json.dumps(index).encode())
    return written


def diff_ids(archive: Path) -> list[str]:
    """The digests of a docker-archive's layers, lowest first (its config's rootfs.diff_ids;
    the archive's layers are uncompressed, so each is also the layer blob's digest)."""
    with tarfile.open(archive) as source:
        _, config = _docker_image(source)
    return list(json.loads(config)["rootfs"]["diff_ids"])


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """The OCI chain ID of each layer: the identity of the layer together with all below it,
    which names its unpacked snapshot in containerd (image-spec config.md, "Layer ChainID")."""
    chain: list[str] = []
    for diff_id in diff_ids:
        if chain:
            diff_id = "sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest()
        chain.append(diff_id)
    return chain


def _docker_image(tar: tarfile.TarFile) -> tuple[dict[str, Any], bytes]:
    """A docker-archive's one image: its manifest.json entry and its config's bytes."""
    [manifest] = json.loads(_read(tar, "manifest.json"))
    return manifest, _read(tar, manifest["Config"])


def _read(tar: tarfile.TarFile, name: str) -> bytes:
    member = tar.extractfile(name)
    if member is None:
        raise ValueError(f"{name} is not a file of the archive")
    return member.read()


def _blob_path(digest_: str) -> str:
    algorithm, _, hex_ = digest_.partition(":")
    return f"blobs/{algorithm}/{hex_}"


def _add_bytes(tar: tarfile.TarFile, arcname: str, data: bytes) -> None:
    info = tarfile.TarInfo(arcname)
    info.size, info.mtime = len(data), 0
    tar.addfile(info, io.BytesIO(data))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write a docker-archive from layer tars")
    parser.add_argument("out", type=Path)
    parser.add_argument("name", help="NAME:TAG of the image")
    parser.add_argument("--config", required=True, help="the image config's `config` as JSON")
    parser.add_argument("layers", nargs="+", type=Path, help="layer tars, bottom first")
    args = parser.parse_args(argv)
    write_archive(args.out, args.name, layers=args.layers, config=json.loads(args.config))
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
