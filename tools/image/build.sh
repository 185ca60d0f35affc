#!/usr/bin/env bash
# Builds the matrixpool image (operator, checkpoint daemon, device plugin and the example
# trainers) with no registry, in three layers: a Debian base made by mmdebstrap from this
# machine's own apt sources; a torch layer, a venv at /opt/matrixpool with PyPI's torch (the
# version tools/torch-venv.sh pins) and NumPy, pruned for CPU; an app layer with the project's
# wheel in that venv. Smoke-tests torch inside the image, writes a docker-archive
# (`ctr images import` and `docker load` read it) and prints its path as the last line.
#
#   tools/image/build.sh [NAME:TAG]        default matrixpool:dev
#
# The Dockerfile at the repository root describes the same image for users with a registry:
# Debian bookworm with Debian's python3, the venv (--system-site-packages, though Debian
# installs no Python package there now) with torch and its CUDA wheels less what only a GPU
# opens (tools/image/torchlayer.py: triton not installed, PRUNE removed), uid 65532,
# ENTRYPOINT matrixpool.
#
# Caches, in ~/.cache/matrixpool/image: the base by its package list (base-<hash>); the torch
# layer by the base and the set of wheels it installs (torch-<hash>); the image by the sources
# (a source change rebuilds only the app layer, a warm run with no change nothing). torch's
# wheels come from ~/.cache/matrixpool/wheels ($MATRIXPOOL_WHEELS), the folder
# tools/torch-venv.sh fills; missing ones are downloaded there with `pip download`.
# Needs root (mmdebstrap, overlay mounts, chroot).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
name=${1:-matrixpool:dev}
cache=${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}/image
wheels=${MATRIXPOOL_WHEELS:-$HOME/.cache/matrixpool/wheels}
suite=bookworm
# The image's Debian packages; the Dockerfile's apt-get line names the same ones.
packages=(python3 python3-venv ca-certificates tini)
# torch's pin lives in tools/torch-venv.sh (TORCH=torch==X.Y.Z); the Dockerfile's matches it.
torch_pin=$(sed -n 's/^TORCH=\(torch==[0-9][0-9.]*\)$/\1/p' "$repo/tools/torch-venv.sh")
# The image config; the smoke test runs with its Env and User.
config='{"User": "65532:65532", "WorkingDir": "/tmp",
  "Env": ["PATH=/opt/matrixpool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
          "VIRTUAL_ENV=/opt/matrixpool", "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"],
  "Entrypoint": ["matrixpool"], "Cmd": ["run", "--liveness=http://0.0.0.0:8080/healthz"],
  "ExposedPorts": {"8080/tcp": {}, "9090/tcp": {}}}'
started=$SECONDS
log() { printf '[image %3ds] %s\n' "$((SECONDS - started))" "$*" >&2; }
logged() { while IFS= read -r line; do log "$line"; done; }
die() { log "$*"; exit 1; }
size() { du -sh "$@" | cut -f1; }
# A command in a root file system, with a clean environment.
in_root() { chroot "$1" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/nonexistent "${@:2}"; }

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap, mount and chroot): run as root"
[ -n "$torch_pin" ] || die "no TORCH=torch==X.Y.Z line in tools/torch-venv.sh"
need_debs=()
command -v mmdebstrap >/dev/null || need_debs+=(mmdebstrap)
if [ ${#need_debs[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_debs[*]} (apt-get)"
  "$here/../apt-install.sh" "${need_debs[@]}"
fi
pip=${PIP:-$repo/.venv/bin/pip}
[ -x "$pip" ] || pip="python3 -m pip"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" 2>/dev/null || true; done
  mounts=()
}
trap cleanup EXIT
mnt() { mount "$@" && mounts+=("${!#}"); } # mount ...; the last argument is the mount point
# Drops cached layers of one kind other than the current one (each torch layer is ~5 GB).
drop_stale() {
  local kind=$1 keep=$2 old
  for old in "$cache/$kind"-*; do
    [ -d "$old" ] && [ "$old" != "$keep" ] || continue
    log "removing the stale cached layer $(basename "$old") ($(size "$old"))"
    rm -rf "$old"
  done
}

# --- base layer: Debian + python3, cached by the package list -------------------------------
base_hash=$(printf '%s\n' "$suite" "${packages[@]}" "$(sed -n '/^# --- base/,/^# --- torch/p' "$0")" | sha256sum | cut -c1-12)
base="$cache/base-$base_hash"
if [ ! -f "$base/layer.tar" ]; then
  log "base layer: mmdebstrap $suite with ${packages[*]} (this machine's apt sources; a few minutes)"
  rm -rf "$base" && mkdir -p "$base"
  mmdebstrap --quiet --variant=minbase --mode=root --format=directory \
    --aptopt='APT::Install-Recommends "false"' \
    --include="$(IFS=,; echo "${packages[*]}")" \
    --customize-hook='chroot "$1" groupadd --gid 65532 matrixpool' \
    --customize-hook='chroot "$1" useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin matrixpool' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/usr/share/doc "$1"/usr/share/man' \
    "$suite" "$base/rootfs" >&2
  # The rootfs is the layer; the machine's apt sources it was made from stay out of the image.
  rm -f "$base/rootfs/etc/apt/sources.list" "$base"/rootfs/etc/apt/sources.list.d/*
  tar --numeric-owner --xattrs -C "$base/rootfs" -cf "$base/layer.tar.tmp" .
  mv "$base/layer.tar.tmp" "$base/layer.tar"
  log "base layer: $(size "$base/layer.tar")"
  drop_stale base "$base"
fi
python_version=$(in_root "$base/rootfs" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# --- torch layer: the venv /opt/matrixpool with torch and NumPy, pruned for CPU --------------
# Which wheels: pip resolves $torch_pin and numpy in the wheel folder (cached by its listing).
torch_reqs=("$torch_pin" numpy)
mkdir -p "$wheels"
listing=$( (printf '%s\n' "$python_version" "${torch_reqs[@]}"; cat "$here/torchlayer.py"
  cd "$wheels" && find . -maxdepth 1 -name '*.whl' -printf '%f %s\n' | sort) | sha256sum | cut -c1-16)
chosen="$cache/torch-wheels-$listing.txt"
if [ ! -s "$chosen" ]; then
  # pip picks wheels for its own Python: it must be the image's (cp311 wheels for bookworm).
  pip_python=$($pip --version | sed -n 's/.*(python \([0-9.]*\))$/\1/p')
  [ "$pip_python" = "$python_version" ] ||
    die "torch layer: $pip runs Python ${pip_python:-?}, the image has $python_version: set PIP to a pip of Python $python_version"
  resolve() {
    $pip install --dry-run --ignore-installed --no-index --find-links "$wheels" --quiet \
      --report "$cache/torch-report.json" "${torch_reqs[@]}" >/dev/null 2>&1
  }
  if ! resolve; then
    log "torch layer: ${torch_reqs[*]} not all in $wheels: downloading them there (pip download; ~2.8 GB the first time)"
    $pip download --progress-bar off --quiet --dest "$wheels" "${torch_reqs[@]}" >&2
    resolve || die "torch layer: pip cannot resolve ${torch_reqs[*]} from $wheels even after pip download"
  fi
  python3 "$here/torchlayer.py" wheels "$cache/torch-report.json" "$python_version" >"$chosen.tmp"
  mv "$chosen.tmp" "$chosen"
  rm -f "$cache/torch-report.json"
  find "$cache" -maxdepth 1 -name 'torch-wheels-*.txt' ! -name "$(basename "$chosen")" -delete
fi
mapfile -t torch_wheels <"$chosen"
torch_hash=$( (echo "$base_hash"; sed -n '/^# --- torch/,/^# --- app/p' "$0"; cat "$here/torchlayer.py"
  for w in "${torch_wheels[@]}"; do stat -c '%n %s' "$w"; done) | sha256sum | cut -c1-12)
torch_layer="$cache/torch-$torch_hash"
if [ ! -f "$torch_layer/layer.tar" ]; then
  log "torch layer: a venv with ${#torch_wheels[@]} wheels from $wheels ($torch_pin, numpy; not: triton)"
  rm -rf "$torch_layer" && mkdir -p "$torch_layer/rootfs" "$torch_layer/ovl" "$torch_layer/merged"
  m="$torch_layer/merged"
  mnt -t overlay overlay -o "lowerdir=$base/rootfs,upperdir=$torch_layer/rootfs,workdir=$torch_layer/ovl" "$m"
  mkdir -p "$m/wheels"
  mnt --bind -o ro "$wheels" "$m/wheels"
  in_image=()
  for w in "${torch_wheels[@]}"; do in_image+=("/wheels/$(basename "$w")"); done
  # --no-deps: exactly the resolved wheels (the set this layer is cached by), triton left out.
  in_root "$m" /bin/sh -ec '
    python3 -m venv --system-site-packages /opt/matrixpool
    /opt/matrixpool/bin/pip install --quiet --no-index --no-cache-dir --no-deps \
      --disable-pip-version-check "$@"
  ' sh "${in_image[@]}" >&2
  site=$(in_root "$m" /opt/matrixpool/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  log "torch layer: installed; pruning what only a GPU opens"
  python3 "$here/torchlayer.py" prune "$m" "$site" | logged
  cleanup
  rmdir "$torch_layer/rootfs/wheels"
  # The layer is /opt alone (pip's temporary folders left /tmp and the like behind).
  find "$torch_layer/rootfs" -mindepth 1 -maxdepth 1 ! -name opt -exec rm -rf {} +
  rm -rf "$torch_layer/ovl" "$torch_layer/merged"
  tar --numeric-owner -C "$torch_layer/rootfs" -cf "$torch_layer/layer.tar.tmp" opt
  mv "$torch_layer/layer.tar.tmp" "$torch_layer/layer.tar"
  log "torch layer: $(size "$torch_layer/layer.tar")"
  drop_stale torch "$torch_layer"
fi

# --- app layer: the project's wheel in /opt/matrixpool over the torch layer -----------------
# Reused while the layers below, this script, the smoke test and the wheel's sources are the
# same (a warm CI run rebuilds nothing).
out="$cache/${name//[:\/]/_}.tar"
app_hash=$( (echo "$torch_hash $name"; cat "$0" "$here/smoke.py"; cd "$repo" && find pyproject.toml README.md operator recovery \
  -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum) \
  | sha256sum | cut -c1-16)
if [ -f "$out" ] && [ "$(cat "$out.source" 2>/dev/null)" = "$app_hash" ]; then
  log "image $name: $out is up to date with the sources"
  echo "$out"
  exit 0
fi
work="$cache/work"
rm -rf "$work" && mkdir -p "$work/wheels" "$work/upper" "$work/ovl" "$work/merged" "$work/smoke"
log "app layer: wheels of matrixpool and its dependencies"
$pip wheel --quiet --wheel-dir "$work/wheels" "$repo" >&2
lower="$torch_layer/rootfs:$base/rootfs"
m="$work/merged"
mnt -t overlay overlay -o "lowerdir=$lower,upperdir=$work/upper,workdir=$work/ovl" "$m"
mkdir -p "$m/wheels"
mnt --bind -o ro "$work/wheels" "$m/wheels"
in_root "$m" PYTHONDONTWRITEBYTECODE=1 /bin/sh -ec '
  /opt/matrixpool/bin/pip install --quiet --no-index --no-cache-dir --disable-pip-version-check \
    --find-links=/wheels matrixpool
' >&2
cleanup
rmdir "$work/upper/wheels"
# Only what the app step added: the venv's new files (pip leaves no caches with --no-cache-dir).
find "$work/upper" -mindepth 1 -maxdepth 1 ! -name opt -exec rm -rf {} +
find "$work/upper" -name __pycache__ -prune -exec rm -rf {} +
# A file of the torch layer removed or replaced here would be an overlay whiteout (a character
# device) or an opaque folder, which a layer tar cannot say: pip must only add.
replaced=$(find "$work/upper" -type c -printf '%P\n'; python3 -c '
import os, sys
for d, _, _ in os.walk(sys.argv[1]):
    try:
        if os.getxattr(d, "trusted.overlay.opaque") == b"y":
            print(os.path.relpath(d, sys.argv[1]))
    except OSError:
        pass' "$work/upper")
[ -z "$replaced" ] || die "app layer: pip removed or replaced files of the torch layer: $replaced"
tar --numeric-owner -C "$work/upper" -cf "$work/app.tar" opt
app_size=$(size "$work/app.tar")
log "app layer: $app_size"

# --- smoke test: torch and the operator inside the image, read-only, as uid 65532 ------------
# A read-only overlay of the three layers with tmpfs /tmp and /dev/shm, as a pod would run it.
m="$work/smoke"
mnt -t overlay overlay -o "ro,lowerdir=$work/upper:$lower" "$m"
mnt -t proc proc "$m/proc"
mnt -t tmpfs -o mode=1777 tmpfs "$m/tmp"
mnt -t tmpfs -o mode=1777 tmpfs "$m/dev/shm"
cp "$here/smoke.py" "$m/tmp/smoke.py"
mapfile -t image_env < <(python3 -c 'import json, sys; print("\n".join(json.loads(sys.argv[1])["Env"]))' "$config")
as_user=(chroot --userspec=65532:65532 "$m" /usr/bin/env -i "${image_env[@]}" HOME=/nonexistent)
log "smoke test: torch (gloo all_reduce, torchrun, FSDP2, DCP save/async_save/load) and matrixpool in the image, uid 65532"
# gloo binds to the address of the host name; the chroot has no /etc/hosts (a pod gets one).
if ! "${as_user[@]}" OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo sh -c 'cd /tmp && exec python smoke.py --expect-version "$1" --expect-prefix /opt/matrixpool/' \
  sh "${torch_pin#torch==}" 2>&1 | logged; then
  die "smoke test: tools/image/smoke.py failed in the image (above)"
fi
if ! "${as_user[@]}" python -c 'import matrixpool, matrixpool_recovery, numpy, torch' 2>&1 | logged; then
  die "smoke test: the image's venv cannot import matrixpool, matrixpool_recovery, numpy, torch"
fi
"${as_user[@]}" matrixpool --help >/dev/null 2>&1 || die "smoke test: matrixpool --help failed in the image"
log "smoke test: passed"
cleanup

# --- docker-archive: manifest.json + config + the three layers -----------------------------
PYTHONPATH="$repo/operator" python3 -m matrixpool.devcluster.images "$out" "$name" \
  --config "$config" "$base/layer.tar" "$torch_layer/layer.tar" "$work/app.tar" >/dev/null
echo "$app_hash" >"$out.source"
rm -rf "$work"
log "image $name: $out ($(size "$out"): base $(size "$base/layer.tar"), torch $(size "$torch_layer/layer.tar"), app $app_size)"
echo "$out"
