#!/usr/bin/env bash
# Builds the matrixpool image (operator, checkpoint daemon, device plugin and the example
# trainers) with no registry: a Debian base made by mmdebstrap from this machine's own apt
# sources, plus a layer with a virtualenv of the project's wheel. Writes a docker-archive
# (`ctr images import` and `docker load` read it) and prints its path as the last line.
#
#   tools/image/build.sh [NAME:TAG]        default matrixpool:dev
#
# The Dockerfile at the repository root describes the same image for users with a registry:
# Debian bookworm, Debian's python3 with python3-numpy and python3-torch (CPU), a venv at
# /opt/matrixpool that sees them (--system-site-packages), uid 65532, ENTRYPOINT matrixpool.
# The base layer is cached by its package list (~/.cache/matrixpool/image/base-<hash>); the
# app layer is rebuilt when the project's sources change. Needs root (mmdebstrap, chroot).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
name=${1:-matrixpool:dev}
cache=${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}/image
suite=bookworm
# The image's Debian packages; the Dockerfile's apt-get line names the same ones.
packages=(python3 python3-venv python3-numpy python3-torch ca-certificates tini)
started=$SECONDS
log() { printf '[image %3ds] %s\n' "$((SECONDS - started))" "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "needs root (mmdebstrap and chroot): run as root"; exit 1; }
need_debs=()
command -v mmdebstrap >/dev/null || need_debs+=(mmdebstrap)
if [ ${#need_debs[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_debs[*]} (apt-get)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need_debs[@]}" >/dev/null
fi
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

# --- base layer: Debian + python3 + numpy + torch, cached by the package list -------------
base_hash=$(printf '%s\n' "$suite" "${packages[@]}" "$(sed -n '/^# --- base/,/^# --- app/p' "$0")" | sha256sum | cut -c1-12)
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
  log "base layer: $(du -h "$base/layer.tar" | cut -f1)"
fi

# --- app layer: /opt/matrixpool, a venv of the project's wheel over the base ---------------
# Reused while the base and the wheel's sources are the same (a warm CI run rebuilds nothing).
out="$cache/${name//[:\/]/_}.tar"
app_hash=$( (echo "$base_hash $name"; cd "$repo" && find pyproject.toml README.md operator recovery \
  -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum) \
  | sha256sum | cut -c1-16)
if [ -f "$out" ] && [ "$(cat "$out.source" 2>/dev/null)" = "$app_hash" ]; then
  log "image $name: $out is up to date with the sources"
  echo "$out"
  exit 0
fi
work="$cache/work"
rm -rf "$work" && mkdir -p "$work/wheels" "$work/upper" "$work/ovl" "$work/merged"
log "app layer: wheels of matrixpool and its dependencies"
pip=${PIP:-$repo/.venv/bin/pip}
[ -x "$pip" ] || pip="python3 -m pip"
$pip wheel --quiet --wheel-dir "$work/wheels" "$repo" >&2
cleanup() {
  umount "$work/merged/wheels" 2>/dev/null || true
  for m in proc dev; do umount "$work/merged/$m" 2>/dev/null || true; done
  umount "$work/merged" 2>/dev/null || true
}
trap cleanup EXIT
mount -t overlay overlay -o "lowerdir=$base/rootfs,upperdir=$work/upper,workdir=$work/ovl" "$work/merged"
mkdir -p "$work/merged/wheels"
mount --bind "$work/wheels" "$work/merged/wheels"
chroot "$work/merged" /bin/sh -ec '
  python3 -m venv --system-site-packages /opt/matrixpool
  /opt/matrixpool/bin/pip install --quiet --no-index --no-cache-dir --find-links=/wheels matrixpool
  /opt/matrixpool/bin/python -c "import matrixpool, matrixpool_recovery, torch, numpy"
' >&2
umount "$work/merged/wheels"
rmdir "$work/merged/wheels"
umount "$work/merged"
trap - EXIT
# Only what the app step added: the venv (pip leaves no caches with --no-cache-dir).
find "$work/upper" -name __pycache__ -prune -exec rm -rf {} +
tar --numeric-owner -C "$work/upper" -cf "$work/app.tar" opt
log "app layer: $(du -h "$work/app.tar" | cut -f1)"

# --- docker-archive: manifest.json + config + the two layers -------------------------------
config='{"User": "65532:65532", "WorkingDir": "/tmp",
  "Env": ["PATH=/opt/matrixpool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
          "VIRTUAL_ENV=/opt/matrixpool", "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"],
  "Entrypoint": ["matrixpool"], "Cmd": ["run", "--liveness=http://0.0.0.0:8080/healthz"],
  "ExposedPorts": {"8080/tcp": {}, "9090/tcp": {}}}'
PYTHONPATH="$repo/operator" python3 -m matrixpool.devcluster.images "$out" "$name" \
  --config "$config" "$base/layer.tar" "$work/app.tar" >/dev/null
echo "$app_hash" >"$out.source"
rm -rf "$work"
log "image $name: $out ($(du -h "$out" | cut -f1))"
echo "$out"
