# Sourced by tools/kind/*.sh: the pins, the cache folder, and what podman needs on this machine.
# shellcheck shell=bash
_kind_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../k8s/versions.env
source "$_kind_here/../k8s/versions.env"
MP_KIND_CACHE=${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}/kind
export KIND_EXPERIMENTAL_PROVIDER=podman
# podman here needs its rlimits pinned at this machine's hard limits (see containers.conf); the
# system's /etc/containers files stay untouched.
export CONTAINERS_CONF=${CONTAINERS_CONF:-$_kind_here/containers.conf}
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}

# kind_binaries: the folder with kind, kubeadm and kubectl (tools/k8s/build.sh, by recipe).
kind_binaries() { nice -n 19 "$_kind_here/../k8s/build.sh" kind kubeadm kubectl | tail -n1; }

# need_debs PROGRAM=PACKAGE...: installs the Debian packages of the programs missing, and says so.
need_debs() {
  local missing=() p
  for p in "$@"; do command -v "${p%%=*}" >/dev/null || missing+=("${p#*=}"); done
  [ ${#missing[@]} -gt 0 ] || return 0
  printf '[kind] installing Debian packages: %s (apt-get)\n' "${missing[*]}" >&2
  "$_kind_here/../apt-install.sh" "${missing[@]}"
}

# kind_host_ready: what kind's podman provider needs of this machine. It always mounts
# /lib/modules read-only into the nodes; a kernel booted with no modules has no such folder and
# `podman run` fails with "statfs /lib/modules: no such file or directory": an empty folder
# satisfies it (created only where it is missing).
kind_host_ready() {
  if ! command -v podman >/dev/null; then
    # with its Recommends, as tried here: netavark + aardvark-dns (kind's network), catatonit
    printf '[kind] installing Debian packages: podman (apt-get, with its recommends)\n' >&2
    "$_kind_here/../apt-install.sh" --with-recommends podman
  fi
  [ -e /lib/modules ] || mkdir -p /lib/modules
}
