#!/usr/bin/env bash
# Builds the local control-plane binaries from Go modules at the versions pinned in
# versions.env, into ~/.cache/matrixpool/bin/<versions-hash>/ (override with MATRIXPOOL_CACHE).
# Reuses a complete folder; prints progress while a cold build runs. Called by
# `matrixpool cluster up`, `make binaries` and CI. Prints the bin folder as its last line.
# The real nodes' kubelet comes from the same k8s.io/kubernetes module, and their sandbox
# image's pause from tools/k8s/pause; containerd, runc and the CNI plugins are Debian's
# (tools/k8s/node-packages.sh installs them, at the versions versions.env names).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}
hash=$(cat "$here/versions.env" "$here/build.sh" "$here/pause/main.go" | sha256sum | cut -c1-12)
bin="$cache/bin/$hash"
work="$cache/work/$hash"
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kwok helm pause)

complete() {
  for b in "${binaries[@]}"; do [ -x "$bin/$b" ] || return 1; done
}
if complete; then
  echo "$bin"
  exit 0
fi

# One build at a time per cache: a second caller waits, then finds the binaries ready.
mkdir -p "$bin" "$work"
exec 9>"$cache/bin/.build.lock"
if ! flock -n 9; then
  echo "[build] another build is running; waiting for it" >&2
  flock 9
fi
if complete; then
  echo "$bin"
  exit 0
fi
export GOFLAGS="-mod=mod -trimpath"
export CGO_ENABLED=0
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
started=$SECONDS
step=0
total=${#binaries[@]}

log() { printf '[build %3ds] %s\n' "$((SECONDS - started))" "$*" >&2; }

# run_with_progress LABEL CMD...: runs CMD, printing a heartbeat every 30 s so a cold build
# never looks stuck; shows the command's output only if it fails.
run_with_progress() {
  local label=$1; shift
  local out="$work/$label.log" t0=$SECONDS
  "$@" >"$out" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && log "  ... $label still running ($((SECONDS - t0)) s)"
  done
  if ! wait "$pid"; then
    log "FAILED: $label; last lines of $out:"
    tail -n 40 "$out" >&2
    exit 1
  fi
  log "  $label done in $((SECONDS - t0)) s"
}

next() { step=$((step + 1)); log "[$step/$total] $*"; }

# go_module DIR MODULE@VERSION: a throwaway module that requires one dependency.
go_module() {
  local dir=$1 mod=$2 ver=$3
  mkdir -p "$dir"
  (cd "$dir" && { [ -f go.mod ] || go mod init "matrixpool.dev/tools/$(basename "$dir")" >/dev/null 2>&1; } \
    && go mod edit -require="$mod@$ver")
}

# --- Kubernetes: replace every staging module listed in k8s.io/kubernetes's own go.mod ---
kube_binaries() {
  local dir="$work/kubernetes"
  go_module "$dir" k8s.io/kubernetes "$KUBERNETES_VERSION"
  local gomod staging minor
  gomod=$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" \
    | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  staging=$(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod")
  [ -n "$staging" ] || { log "no staging replace lines found in $gomod"; exit 1; }
  local v0="v0.${KUBERNETES_VERSION#v1.}"
  for m in $staging; do (cd "$dir" && go mod edit -replace="$m=$m@$v0"); done
  log "  k8s.io/kubernetes $KUBERNETES_VERSION: $(echo "$staging" | wc -w) staging modules replaced at $v0"
  minor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)
  local pkgver=k8s.io/component-base/version
  local ldflags="-s -w -X $pkgver.gitVersion=$KUBERNETES_VERSION -X $pkgver.gitMajor=1 -X $pkgver.gitMinor=$minor -X $pkgver.gitTreeState=clean"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  run_with_progress "kubernetes-deps" bash -c "cd '$dir' && go get k8s.io/kubernetes/cmd/kube-apiserver@$KUBERNETES_VERSION && go mod download"
  for b in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    next "$b $KUBERNETES_VERSION"
    [ -x "$bin/$b" ] || run_with_progress "$b" bash -c "cd '$dir' && go build -ldflags '$ldflags' -o '$bin/$b.tmp' k8s.io/kubernetes/cmd/$b && mv '$bin/$b.tmp' '$bin/$b'"
  done
}

etcd_binary() {
  next "etcd $ETCD_VERSION"
  [ -x "$bin/etcd" ] && return
  local dir="$work/etcd"
  go_module "$dir" go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
  run_with_progress etcd bash -c "cd '$dir' && go get go.etcd.io/etcd/server/v3@$ETCD_VERSION && go build -ldflags '-s -w' -o '$bin/etcd.tmp' go.etcd.io/etcd/server/v3 && mv '$bin/etcd.tmp' '$bin/etcd'"
}

install_binary() {  # NAME PACKAGE@VERSION [EXTRA LDFLAGS]
  next "$1 ${2#*@}"
  [ -x "$bin/$1" ] && return
  run_with_progress "$1" env GOBIN="$work/gobin" GOFLAGS=-trimpath go install -ldflags "-s -w ${3:-}" "$2"
  mv "$work/gobin/$1" "$bin/$1"
}

# helm's release builds stamp its version and the Kubernetes version it assumes for
# .Capabilities and for lint; without them it would assume Kubernetes 1.20.
helm_ldflags() {
  local minor
  minor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)
  local flags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    flags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  echo "$flags"
}

pause_binary() {
  next "pause (tools/k8s/pause)"
  [ -x "$bin/pause" ] && return
  run_with_progress pause bash -c "cd '$here/pause' && go build -ldflags '-s -w' -o '$bin/pause.tmp' . && mv '$bin/pause.tmp' '$bin/pause'"
}

log "cold build of the control plane into $bin (this takes a while on a small machine)"
etcd_binary
kube_binaries
install_binary kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
install_binary helm "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" "$(helm_ldflags)"
pause_binary
complete || { log "build finished but binaries are missing"; exit 1; }
log "control plane built in $((SECONDS - started)) s"
echo "$bin"
