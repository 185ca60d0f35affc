"""The torch layer of the matrixpool image: which wheels it installs, and what a CPU image
leaves out of them. Used by tools/image/build.sh (standard library only; runs on the build
machine, against the image's root file system):

    torchlayer.py wheels REPORT PYTHON_VERSION   the wheel files of a `pip install --dry-run
                                                 --report` (one a line), less EXCLUDED
    torchlayer.py prune ROOT SITE_PACKAGES       remove PRUNE under ROOT/SITE_PACKAGES, then
                                                 check that every ELF object left there finds
                                                 each of its DT_NEEDED libraries (LAZY apart)

PyPI's torch for Linux is one wheel for CPU and GPU: it requires NVIDIA's CUDA wheels even to
import on a CPU (libtorch_cuda.so is DT_NEEDED by libtorch.so). What the dynamic linker needs
for `import torch` stays; what only a GPU opens (dlopen at run time, or the libraries of a
module torch loads lazily) goes. `prune` fails when a pattern matches nothing (the list went
stale with a new torch) and when a kept object misses a library (a pruning too many).
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import shutil
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

# Distributions of torch's requirements that are not installed at all.
EXCLUDED: dict[str, str] = {
    "triton": "torch.compile's GPU kernels (Inductor's CUDA backend); ~1 GB. torch imports it "
    "only when compiling for a GPU, and CPU code runs without it",
}

# Glob patterns under site-packages, each with why a CPU image does without it.
PRUNE: tuple[tuple[str, str], ...] = (
    (
        "nvidia/cudnn/lib/libcudnn_*.so.*",
        "cuDNN's engines and sub-libraries (adv, cnn, ops, graph, heuristic, engines_*, ext): "
        "libcudnn.so.9, which libtorch_cuda.so and libtorch_python.so need, dlopens them "
        "when a cuDNN handle is made on a GPU; ~890 MB",
    ),
    (
        "nvidia/cu13/lib/libcusolver*.so.*",
        "cuSOLVER and cuSOLVERMg: DT_NEEDED only by torch/lib/libtorch_cuda_linalg.so, which "
        "torch loads lazily for CUDA linear algebra (LAZY); ~280 MB",
    ),
    (
        "nvidia/cu13/lib/libnvJitLink.so.*",
        "nvJitLink: DT_NEEDED only by cuSOLVER(Mg) (pruned); CUDA opens it to link GPU code; "
        "~120 MB",
    ),
    (
        "nvidia/cu13/lib/libnvrtc-builtins.so.*",
        "NVRTC's builtins: libnvrtc.so dlopens them when it compiles a GPU kernel",
    ),
    (
        "nvidia/cu13/lib/libnvperf_*.so",
        "CUPTI's GPU performance counters (host and target), opened when profiling a GPU",
    ),
    (
        "nvidia/cu13/lib/libcufile_rdma.so.*",
        "GPUDirect Storage over RDMA: needs libmlx5 and libibverbs, which the image lacks",
    ),
    (
        "nvidia/nvshmem/lib/nvshmem_*.so.*",
        "NVSHMEM's bootstrap and transport plugins (MPI, PMIx, OpenSHMEM, ibverbs, UCX, "
        "libfabric), which libnvshmem_host dlopens on a GPU; their own libraries are absent",
    ),
    (
        "nvidia/*/lib/*.bc",
        "LLVM bitcode of NVSHMEM and NCCL device code, linked into GPU kernels; ~180 MB",
    ),
    (
        "nvidia/*/lib/*.a",
        "static libraries (cudart, cudadevrt, nvshmem_device): for linking, not for running",
    ),
    ("nvidia/*/include", "CUDA, cuDNN, NCCL, NVSHMEM and cuSPARSELt headers"),
    (
        "torch/lib/libgfortran.so.5",
        "a GNU Fortran runtime the wheel bundles: no torch library needs it (no DT_NEEDED, no "
        "'libgfortran' string in any), and it needs libquadmath.so.0, which the image lacks",
    ),
    (
        "torch/include",
        "torch's C++ headers, for building extensions and Inductor's C++ code: the image has "
        "no compiler; ~60 MB",
    ),
)

# Objects kept although a library they need is not in the image: torch opens them only on a GPU.
LAZY: dict[str, str] = {
    "torch/lib/libtorch_cuda_linalg.so": "torch's CUDA linear algebra, loaded on first use on "
    "a GPU (torch.backends.cuda.preferred_linalg_library); needs the pruned cuSOLVER",
    "torch/lib/libcaffe2_nvrtc.so": "NVRTC for CUDA kernels compiled at run time; needs the "
    "NVIDIA driver's libcuda.so.1, which no image carries (the node's driver provides it)",
}

# The dynamic linker's default directories (besides /etc/ld.so.conf's).
DEFAULT_DIRS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib")


def wheels(report: Path, python_version: str) -> list[Path]:
    """The wheel files a `pip install --dry-run --report` would install, less EXCLUDED."""
    data = json.loads(report.read_text())
    env = data.get("environment", {})
    if env.get("python_version") != python_version or env.get("platform_machine") != "x86_64":
        raise SystemExit(
            f"torchlayer: pip resolved for Python {env.get('python_version')} on "
            f"{env.get('platform_machine')}, the image has Python {python_version} on x86_64: "
            "run build.sh with a pip of the image's Python version (PIP=...)"
        )
    found: list[Path] = []
    names = set()
    for item in data["install"]:
        name = item["metadata"]["name"].lower().replace("_", "-")
        names.add(name)
        if name in EXCLUDED:
            continue
        url = urlparse(item["download_info"]["url"])
        if url.scheme != "file" or not url.path.endswith(".whl"):
            raise SystemExit(f"torchlayer: {name} is not a local wheel: {url.geturl()}")
        found.append(Path(unquote(url.path)))
    if "torch" not in names:
        raise SystemExit(f"torchlayer: {report} installs no torch")
    return sorted(found)


# --- ELF: the dynamic section's DT_NEEDED, DT_RPATH and DT_RUNPATH -------------------------

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_NEEDED, DT_STRTAB, DT_RPATH, DT_RUNPATH = 0, 1, 5, 15, 29


@dataclass
class Dynamic:
    """What the dynamic linker reads of an ELF object to find the libraries it needs."""

    needed: list[str] = field(default_factory=list)
    rpath: list[str] = field(default_factory=list)
    runpath: list[str] = field(default_factory=list)


def dynamic(path: Path) -> Dynamic | None:
    """The dynamic section of a 64-bit little-endian ELF file; None for anything else (not
    ELF, or no PT_DYNAMIC: a static executable)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF":
            return None
        if head[4] != 2 or head[5] != 1:  # ELFCLASS64, ELFDATA2LSB: all that x86_64 has
            raise ValueError(f"{path}: not a 64-bit little-endian ELF")
        (phoff,) = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
        dyn: tuple[int, int] | None = None
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
                "<IIQQQQ", table, i * phentsize
            )
            if p_type == PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == PT_DYNAMIC:
                dyn = (p_offset, p_filesz)
        if dyn is None:
            return None
        f.seek(dyn[0])
        raw = f.read(dyn[1])
        entries: list[tuple[int, int]] = []
        for off in range(0, len(raw) - 15, 16):
            tag, val = struct.unpack_from("<qQ", raw, off)
            if tag == DT_NULL:
                break
            entries.append((tag, val))
        strtab = next((val for tag, val in entries if tag == DT_STRTAB), None)
        if strtab is None:
            raise ValueError(f"{path}: a dynamic section without DT_STRTAB")
        base = next((o + strtab - v for v, o, n in loads if v <= strtab < v + n), None)
        if base is None:
            raise ValueError(f"{path}: DT_STRTAB {strtab:#x} is in no PT_LOAD segment")

        def string(at: int) -> str:
            f.seek(base + at)
            out = b""
            while not out.endswith(b"\0"):
                chunk = f.read(256)
                if not chunk:
                    break
                out += chunk
            return out.split(b"\0", 1)[0].decode()

        d = Dynamic()
        for tag, val in entries:
            if tag == DT_NEEDED:
                d.needed.append(string(val))
            elif tag == DT_RPATH:
                d.rpath += string(val).split(":")
            elif tag == DT_RUNPATH:
                d.runpath += string(val).split(":")
        return d


# --- paths inside the image's root file system ----------------------------------------------


def inside(root: Path, path: str, hops: int = 0) -> Path | None:
    """``path`` (absolute, as seen in the image) under ``root``, symbolic links followed within
    ``root`` as a chroot would; None when it does not exist."""
    if hops > 40:
        return None
    parts = [p for p in path.split("/") if p]
    here = "/"
    for i, part in enumerate(parts):
        candidate = posixpath.normpath(posixpath.join(here, part))
        host = root / candidate.lstrip("/")
        if host.is_symlink():
            target = os.readlink(host)
            rest = "/".join(parts[i + 1 :])
            joined = posixpath.join(here, target, rest)  # an absolute target starts over
            return inside(root, posixpath.normpath(joined), hops + 1)
        here = candidate
    host = root / here.lstrip("/")
    return host if host.exists() else None


def system_dirs(root: Path) -> list[str]:
    """The image's library directories: /etc/ld.so.conf (and what it includes), then the
    defaults."""
    dirs: list[str] = []

    def read(conf: Path) -> None:
        for line in conf.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("include "):
                pattern = line.split(None, 1)[1].lstrip("/")
                for included in sorted(root.glob(pattern)):
                    read(included)
            elif line:
                dirs.append(line)

    conf = inside(root, "/etc/ld.so.conf")
    if conf is not None:
        read(conf)
    return dirs + [d for d in DEFAULT_DIRS if d not in dirs]


def missing(root: Path, tree: Path, lazy: Iterable[Path] = ()) -> dict[Path, list[str]]:
    """Every ELF object under ``tree`` (in the image at ``root``) → the DT_NEEDED libraries the
    dynamic linker would not find, from its own RUNPATH (else RPATH, $ORIGIN expanded) and the
    image's library directories; objects in ``lazy`` are not checked."""
    skip = {p.resolve() for p in lazy}
    libdirs = system_dirs(root)
    out: dict[Path, list[str]] = {}
    for path in sorted(elf_candidates(tree)):
        if path.resolve() in skip:
            continue
        d = dynamic(path)
        if d is None:
            continue
        origin = "/" + str(path.parent.relative_to(root))
        own = [
            p.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
            for p in (d.runpath or d.rpath)
            if p
        ]
        lost = [
            lib
            for lib in d.needed
            if not any(inside(root, posixpath.join(dir_, lib)) for dir_ in own + libdirs)
        ]
        if lost:
            out[path] = lost
    return out


def elf_candidates(tree: Path) -> Iterator[Path]:
    """Regular files under ``tree`` that are shared objects or executables by name or mode."""
    for dirpath, _, files in os.walk(tree):
        for name in files:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            if ".so" in name or os.access(path, os.X_OK):
                yield path


# --- pruning --------------------------------------------------------------------------------


def prune(site: Path, patterns: Sequence[tuple[str, str]] = PRUNE) -> list[tuple[str, int, int]]:
    """Remove every match of ``patterns`` under ``site``: (pattern, paths, bytes) for each.
    Raises when a pattern matches nothing."""
    done: list[tuple[str, int, int]] = []
    for pattern, _ in patterns:
        matches = sorted(site.glob(pattern))
        if not matches:
            raise SystemExit(f"torchlayer: nothing under {site} matches {pattern!r}: update PRUNE")
        size = 0
        for path in matches:
            if not path.resolve().is_relative_to(site.resolve()):
                raise SystemExit(f"torchlayer: {path} is outside {site}")
            size += tree_size(path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        done.append((pattern, len(matches), size))
    return done


def tree_size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def megabytes(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="the wheels to install, from a pip report")
    w.add_argument("report", type=Path)
    w.add_argument("python_version", help="the image's Python, MAJOR.MINOR")
    p = sub.add_parser("prune", help="prune site-packages, then check every DT_NEEDED")
    p.add_argument("root", type=Path, help="the image's root file system")
    p.add_argument("site", help="site-packages, as a path in the image")
    args = parser.parse_args(argv)

    if args.command == "wheels":
        for path in wheels(args.report, args.python_version):
            print(path)
        return 0

    root: Path = args.root
    site = root / args.site.lstrip("/")
    before = tree_size(site)
    for pattern, count, size in prune(site):
        print(f"pruned {megabytes(size):>8}: {pattern} ({count})")
    print(f"site-packages {megabytes(before)} -> {megabytes(tree_size(site))}")
    lazy = [site / rel for rel in LAZY]
    for path in lazy:
        if not path.is_file():
            raise SystemExit(f"torchlayer: LAZY names {path}, which is not there: update LAZY")
    lost = missing(root, site, lazy)
    for path, libs in lost.items():
        print(f"torchlayer: {path.relative_to(site)} needs {', '.join(libs)}", file=sys.stderr)
    if lost:
        print("torchlayer: objects miss libraries (pruned too much?)", file=sys.stderr)
        return 1
    count = sum(1 for path in elf_candidates(site) if dynamic(path) is not None)
    print(f"DT_NEEDED of {count} ELF objects all found ({len(lazy)} loaded lazily not checked)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
