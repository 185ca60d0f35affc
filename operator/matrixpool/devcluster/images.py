"""Container images without a registry: docker-archive files (``ctr images import`` and
``docker load`` read them) made from layer tars and an image config.

Used for the real nodes' pause image (:mod:`matrixpool.devcluster.realnodes`) and by
``tools/image/build.sh`` for the matrixpool image (``python -m matrixpool.devcluster.images``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
