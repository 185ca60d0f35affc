"""tools/image: the torch layer's pruning (torchlayer.py) and one torch pin for the image, the
Dockerfile and .venv-torch. The build itself (tools/image/build.sh, root) checks the real torch
tree: every ELF object left there finds its DT_NEEDED libraries, and smoke.py runs in the image."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests import ci

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "tools" / "image"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchlayer", IMAGE / "torchlayer.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["torchlayer"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


torchlayer = _load()


def test_one_torch_pin_for_image_dockerfile_and_torch_venv() -> None:
    venv = re.search(r"^TORCH=torch==([0-9.]+)$", (ROOT / "tools/torch-venv.sh").read_text(), re.M)
    assert venv is not None
    script = (IMAGE / "build.sh").read_text()
    assert "tools/torch-venv.sh" in script
    assert not re.search(r"torch==[0-9]", script), "build.sh reads the pin, it names none"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M) == [venv.group(1)]
    assert '"torch==${TORCH_VERSION}"' in dockerfile
    assert not re.search(r"torch==[0-9]", dockerfile)


def test_every_pruned_or_lazy_path_says_why_and_stays_in_site_packages() -> None:
    for pattern, why in torchlayer.PRUNE:
        assert why.strip()
        assert not pattern.startswith("/")
        assert ".." not in pattern.split("/")
    # What the Dockerfile's stage prunes is the same list: it runs torchlayer.py.
    assert "torchlayer.py prune" in (ROOT / "Dockerfile").read_text()
    assert all(why.strip() for why in torchlayer.LAZY.values())
    assert all(why.strip() for why in torchlayer.EXCLUDED.values())
    # No kept-but-lazy object is pruned, and libcudnn.so.9 itself (DT_NEEDED by libtorch_cuda)
    # is not matched by the pattern for its sub-libraries.
    from fnmatch import fnmatch

    for pattern, _ in torchlayer.PRUNE:
        assert not any(fnmatch(lazy, pattern) for lazy in torchlayer.LAZY)
        assert not fnmatch("nvidia/cudnn/lib/libcudnn.so.9", pattern)


def test_prune_removes_every_match_and_fails_on_a_pattern_that_matches_nothing(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site-packages"
    (site / "nvidia/cudnn/lib").mkdir(parents=True)
    (site / "nvidia/cu13/include/sub").mkdir(parents=True)
    for name, size in (("libcudnn.so.9", 3), ("libcudnn_ops.so.9", 5), ("libcudnn_adv.so.9", 7)):
        (site / "nvidia/cudnn/lib" / name).write_bytes(b"x" * size)
    (site / "nvidia/cu13/include/sub/cuda.h").write_bytes(b"y" * 11)
    patterns = (("nvidia/cudnn/lib/libcudnn_*.so.*", "why"), ("nvidia/*/include", "why"))
    done = torchlayer.prune(site, patterns)
    assert done == [("nvidia/cudnn/lib/libcudnn_*.so.*", 2, 12), ("nvidia/*/include", 1, 11)]
    assert sorted(p.name for p in (site / "nvidia/cudnn/lib").iterdir()) == ["libcudnn.so.9"]
    assert not (site / "nvidia/cu13/include").exists()
    with pytest.raises(SystemExit, match="update PRUNE"):
        torchlayer.prune(site, patterns)  # a stale list (a new torch moved things) fails


def _extension(module: str) -> Path:
    file = getattr(importlib.import_module(module), "__file__", None)
    if not file or not file.endswith(".so"):
        ci.cannot_run(f"{module} is not a shared object here")
    return Path(file)


def _readelf(path: Path, kind: str) -> list[str]:
    if shutil.which("readelf") is None:
        ci.cannot_run("no readelf (binutils) to compare with")
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True)
    return [
        m
        for line in out.stdout.splitlines()
        if f"({kind})" in line
        for m in re.findall(r"\[([^\]]*)\]", line)
    ]


def test_dynamic_reads_what_readelf_reads() -> None:
    numpy_core = _extension("numpy._core._multiarray_umath")
    for path in (_extension("_ctypes"), numpy_core, Path(sys.executable).resolve()):
        d = torchlayer.dynamic(path)
        assert d is not None
        assert d.needed == _readelf(path, "NEEDED")
        assert ":".join(d.rpath) == ":".join(_readelf(path, "RPATH"))
        assert ":".join(d.runpath) == ":".join(_readelf(path, "RUNPATH"))
    assert torchlayer.dynamic(IMAGE / "torchlayer.py") is None  # not ELF


def _image(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A root file system with merged /usr (lib -> usr/lib), ld.so.conf.d, and numpy's
    extension (a real ELF object, RPATH $ORIGIN/../../numpy.libs) in a site-packages."""
    root = tmp_path / "root"
    libdir = root / "usr/lib/x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "etc/ld.so.conf.d").mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (root / "etc/ld.so.conf.d/x86_64-linux-gnu.conf").write_text("/lib/x86_64-linux-gnu\n")
    site = root / "opt/venv/lib/python3.11/site-packages"
    (site / "numpy/_core").mkdir(parents=True)
    (site / "numpy.libs").mkdir()
    source = _extension("numpy._core._multiarray_umath")
    shutil.copy(source, site / "numpy/_core" / source.name)
    d = torchlayer.dynamic(source)
    assert d is not None
    assert d.rpath == ["$ORIGIN/../../numpy.libs"]
    return root, site, d.needed


def test_missing_follows_rpath_origin_and_the_images_library_dirs(tmp_path: Path) -> None:
    root, site, needed = _image(tmp_path)
    bundled = [lib for lib in needed if "openblas" in lib]
    system = [lib for lib in needed if lib not in bundled]
    assert bundled
    assert system
    module = next((site / "numpy/_core").iterdir())
    assert torchlayer.missing(root, site) == {module: needed}
    for lib in bundled:  # found through $ORIGIN/../../numpy.libs
        (site / "numpy.libs" / lib).write_bytes(b"")
    for lib in system:  # found through /lib/x86_64-linux-gnu, a link into /usr
        (root / "usr/lib/x86_64-linux-gnu" / lib).write_bytes(b"")
    assert torchlayer.missing(root, site) == {}
    (site / "numpy.libs" / bundled[0]).unlink()  # a pruned dependency is caught
    assert torchlayer.missing(root, site) == {module: [bundled[0]]}
    assert torchlayer.missing(root, site, lazy=[module]) == {}


def test_inside_resolves_links_within_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib").mkdir(parents=True)
    (root / "lib").symlink_to("/usr/lib")  # absolute: must stay inside root
    (root / "usr/lib/libz.so.1.2").write_bytes(b"")
    (root / "usr/lib/libz.so.1").symlink_to("libz.so.1.2")
    (root / "usr/lib/escape.so").symlink_to("../../../../etc/passwd")
    assert torchlayer.inside(root, "/lib/libz.so.1") == root / "usr/lib/libz.so.1.2"
    assert torchlayer.inside(root, "/lib/escape.so") is None  # /etc/passwd of root: absent
    assert torchlayer.inside(root, "/lib/nothing.so") is None


def test_wheels_leaves_out_triton_and_wants_the_images_python(tmp_path: Path) -> None:
    def item(name: str, file: str) -> dict[str, object]:
        return {"metadata": {"name": name}, "download_info": {"url": f"file:///w/{file}"}}

    report = tmp_path / "report.json"
    env = {"python_version": "3.11", "platform_machine": "x86_64"}
    installs = [
        item("torch", "torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl"),
        item("triton", "triton-3.9.0-cp311-cp311-manylinux_2_28_x86_64.whl"),
        item("nvidia-cudnn-cu13", "nvidia_cudnn_cu13-9.26.0.51-py3-none-manylinux_2_27.whl"),
    ]
    report.write_text(json.dumps({"environment": env, "install": installs}))
    assert [p.name for p in torchlayer.wheels(report, "3.11")] == [
        "nvidia_cudnn_cu13-9.26.0.51-py3-none-manylinux_2_27.whl",
        "torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    ]
    with pytest.raises(
        SystemExit, match=re.escape("Python 3.11 on x86_64, the image has Python 3.12")
    ):
        torchlayer.wheels(report, "3.12")
    report.write_text(json.dumps({"environment": env, "install": installs[1:]}))
    with pytest.raises(SystemExit, match="installs no torch"):
        torchlayer.wheels(report, "3.11")
