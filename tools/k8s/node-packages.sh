#!/usr/bin/env bash
# The container runtime of the real nodes (matrixpool cluster up --real-nodes N): containerd,
# runc and the CNI plugins from Debian's packages, plus iproute2 for the nodes' network
# namespaces and iptables for kube-proxy (iptables mode) and the CNI bridge's masquerading.
# Installs what is missing (apt-get, as root) and says so; checks that the installed upstream
# versions are the ones tools/k8s/versions.env pins. Idempotent.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
log() { printf '[node-packages] %s\n' "$*" >&2; }

declare -A wanted=(
  [containerd]=$CONTAINERD_VERSION
  [runc]=$RUNC_VERSION
  [containernetworking-plugins]=$CNI_PLUGINS_VERSION
  [iproute2]=
  [iptables]=
)
installed() { dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null | sed -n 's/^install ok installed //p'; }
missing=()
for p in "${!wanted[@]}"; do [ -n "$(installed "$p")" ] || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { log "needs root to install Debian packages: ${missing[*]}"; exit 1; }
  log "installing Debian packages: ${missing[*]} (apt-get)"
  "$here/../apt-install.sh" "${missing[@]}"
fi
for p in "${!wanted[@]}"; do
  v=$(installed "$p"); want=${wanted[$p]}
  [ -n "$v" ] || { log "$p is not installed"; exit 1; }
  upstream=${v#*:}; upstream=${upstream%%[~+-]*}
  if [ -n "$want" ] && [ "$upstream" != "$want" ]; then
    log "$p $v is installed; versions.env pins $want"
    exit 1
  fi
done
log "containerd $(installed containerd), runc $(installed runc), CNI plugins $(installed containernetworking-plugins), iptables $(installed iptables)"
