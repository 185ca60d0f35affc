#!/usr/bin/env python3
"""Writes a one-layer docker-archive (what `ctr images import` and `podman load` read) with no
registry: the layer is made from files on this machine, or from a root file system folder.

  image-archive.py OUT.tar NAME:TAG [--rootfs DIR] [--file SRC=DEST[:MODE]]... \
      [--entrypoint JSON] [--cmd JSON] [--user UID:GID] [--env K=V]...

Files are owned by root; folders above each DEST are created (0755). Times are fixed, so the
same inputs give the same layer digest.
"""

import argparse
import hashlib
import io
import json
import os
import tarfile
import tempfile

EPOCH = 0


def add_dirs(tar, dest, seen):
    parts = dest.strip("/").split("/")[:-1]
    for i in range(len(parts)):
        d = "/".join(parts[: i + 1])
        if d in seen:
            continue
        seen.add(d)
        info = tarfile.TarInfo(d)
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        info.mtime = EPOCH
        tar.addfile(info)


def layer(path, rootfs, files):
    seen = set()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        if rootfs:
            for name in sorted(os.listdir(rootfs)):
                tar.add(os.path.join(rootfs, name), arcname=name)
            seen.update(n.rstrip("/") for n in tar.getnames())
        for spec in files:
            src, _, dest = spec.partition("=")
            dest, _, mode = dest.partition(":")
            add_dirs(tar, dest, seen)
            info = tar.gettarinfo(src, arcname=dest.strip("/"))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = EPOCH
            if mode:
                info.mode = int(mode, 8)
            with open(src, "rb") as f:
                tar.addfile(info, f)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("name")
    p.add_argument("--rootfs")
    p.add_argument("--file", action="append", default=[])
    p.add_argument("--entrypoint")
    p.add_argument("--cmd")
    p.add_argument("--user")
    p.add_argument("--env", action="append", default=[])
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(a.out))) as tmp:
        lpath = os.path.join(tmp, "layer.tar")
        layer(lpath, a.rootfs, a.file)
        diff = sha256(lpath)
        cfg = {
            "Env": a.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        }
        if a.entrypoint:
            cfg["Entrypoint"] = json.loads(a.entrypoint)
        if a.cmd:
            cfg["Cmd"] = json.loads(a.cmd)
        if a.user:
            cfg["User"] = a.user
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "created": "1970-01-01T00:00:00Z",
                "config": cfg,
                "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff]},
            },
            sort_keys=True,
        ).encode()
        cname = hashlib.sha256(config).hexdigest() + ".json"
        manifest = json.dumps(
            [{"Config": cname, "RepoTags": [a.name], "Layers": [diff + "/layer.tar"]}]
        ).encode()
        with tarfile.open(a.out + ".tmp", "w") as out:
            for n, data in ((cname, config), ("manifest.json", manifest)):
                info = tarfile.TarInfo(n)
                info.size = len(data)
                info.mode = 0o644
                out.addfile(info, io.BytesIO(data))
            out.add(lpath, arcname=diff + "/layer.tar")
    os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
