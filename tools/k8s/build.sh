#!/usr/bin/env bash
# Builds the local cluster's binaries from Go modules at the versions pinned in versions.env:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the real nodes' kubelet and
# kube-proxy (all four from k8s.io/kubernetes), kwok, helm, CoreDNS (the cluster DNS, with the
# plugins tools/k8s/coredns/main.go names) and pause (tools/k8s/pause, the sandbox image's).
# Called by `matrixpool cluster up`, `make binaries` and CI; prints progress while a cold build
# runs and the bin folder as its last line.
#
#   tools/k8s/build.sh            the set above (the local cluster's)
#   tools/k8s/build.sh NAME...    only these, in a set folder of their own: also kind (its Go
#                                 module, sigs.k8s.io/kind), kubeadm and kubectl (from
#                                 k8s.io/kubernetes as kubelet is), which the kind node image
#                                 needs (tools/kind/node-image.sh) and the default set does not The real nodes' containerd, runc and CNI plugins
# are Debian's (tools/k8s/node-packages.sh installs them, at the versions versions.env names).
#
# Cache (MATRIXPOOL_CACHE, default ~/.cache/matrixpool):
#   bin/by-recipe/<name>-<key>/<name>  each binary once per recipe: <key> hashes what its build
#                                      reads (module, version, package, ldflags; for pause and
#                                      CoreDNS their files here), so changing one pin rebuilds
#                                      only the binaries built from it, and a new binary builds
#                                      alone
#   bin/<set>/                         hard links to the binaries of the current recipes, and
#                                      RECIPES naming them (<set> hashes their keys): the folder
#                                      printed, which a running cluster keeps using
# A folder of the layout before recipes (bin/<hash of versions.env and build.sh>/, no RECIPES
# file) lends each binary whose own --version reports the version pinned now, once, instead of
# a rebuild (pause reports none: it is rebuilt, in seconds).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kwok helm coredns pause)
[ $# -eq 0 ] || binaries=("$@")
kube_binaries=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
common="CGO_ENABLED=0 -trimpath"  # every build's environment; part of every recipe

k8s_minor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)
pkgver=k8s.io/component-base/version
kube_ldflags="-s -w -X $pkgver.gitVersion=$KUBERNETES_VERSION -X $pkgver.gitMajor=1 -X $pkgver.gitMinor=$k8s_minor -X $pkgver.gitTreeState=clean"
kube_ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$k8s_minor"
# helm's release builds stamp its version and the Kubernetes version it assumes for
# .Capabilities and for lint; without them it would assume Kubernetes 1.20.
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
files_hash() { cat "$@" | sha256sum | cut -c1-16; }

# recipe NAME: one line naming everything the build of NAME reads.
recipe() {
  case $1 in
    etcd) echo "go.etcd.io/etcd/server/v3@$ETCD_VERSION ldflags=-s -w $common" ;;
    kube-*|kubelet|kubeadm|kubectl)
      echo "k8s.io/kubernetes/cmd/$1@$KUBERNETES_VERSION staging=v0.${KUBERNETES_VERSION#v1.} ldflags=$kube_ldflags $common" ;;
    kwok) echo "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION ldflags=-s -w $common" ;;
    kind) echo "sigs.k8s.io/kind@$KIND_VERSION ldflags=-s -w $common" ;;
    helm) echo "helm.sh/helm/v3/cmd/helm@$HELM_VERSION ldflags=$helm_ldflags $common" ;;
    coredns)
      echo "github.com/coredns/coredns@$COREDNS_VERSION main=$(files_hash "$here/coredns/main.go") ldflags=-s -w $common" ;;
    pause) echo "tools/k8s/pause $(files_hash "$here/pause/go.mod" "$here/pause/main.go") ldflags=-s -w $common" ;;
    *) echo "no recipe for $1" >&2; exit 1 ;;
  esac
}
key() { recipe "$1" | sha256sum | cut -c1-12; }
slot() { echo "$cache/bin/by-recipe/$1-$(key "$1")"; }
for b in "${binaries[@]}"; do recipe "$b" >/dev/null; done  # an unknown name stops here

recipes=$(for b in "${binaries[@]}"; do printf '%s %s %s\n' "$b" "$(key "$b")" "$(recipe "$b")"; done)
bin="$cache/bin/$(cut -d' ' -f1-2 <<<"$recipes" | sha256sum | cut -c1-12)"
work="$cache/work"

complete() {
  [ -f "$bin/RECIPES" ] || return 1
  for b in "${binaries[@]}"; do [ -x "$bin/$b" ] || return 1; done
}
if complete; then
  echo "$bin"
  exit 0
fi

# One build at a time per cache: a second caller waits, then finds the binaries ready.
mkdir -p "$cache/bin/by-recipe" "$work/logs"
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
  local out="$work/logs/$label.log" t0=$SECONDS
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

# ---- the layout before recipes: binaries lent by their own version -------------------------

pinned_version() {  # NAME: the version NAME must report, or nothing (pause, coredns)
  case $1 in
    etcd) echo "$ETCD_VERSION" ;;
    kube-*|kubelet|kubeadm|kubectl) echo "$KUBERNETES_VERSION" ;;
    kwok) echo "$KWOK_VERSION" ;;
    kind) echo "$KIND_VERSION" ;;
    helm) echo "$HELM_VERSION" ;;
  esac
}

reported_version() {  # NAME FILE
  case $1 in
    etcd) "$2" --version 2>/dev/null | sed -n 's/^etcd Version: /v/p' ;;
    kube-*|kubelet) "$2" --version 2>/dev/null | sed -n 's/^Kubernetes //p' ;;
    kwok) "$2" --version 2>/dev/null | sed -n 's/^kwok version \([^ ]*\).*/\1/p' ;;
    kubeadm) "$2" version -o short 2>/dev/null ;;
    kubectl) "$2" version --client 2>/dev/null | sed -n 's/^Client Version: //p' ;;
    kind) "$2" version 2>/dev/null | cut -d' ' -f2 ;;
    helm) "$2" version --template '{{.Version}}' 2>/dev/null ;;
  esac
}

# adopt NAME DEST: link NAME from a folder of the earlier layout if it reports the pinned version.
adopt() {
  local name=$1 dest=$2 want old
  want=$(pinned_version "$name")
  [ -n "$want" ] || return 1
  for old in "$cache"/bin/*/; do
    old=${old%/}
    if [ "$(basename "$old")" = by-recipe ] || [ -f "$old/RECIPES" ] || [ ! -x "$old/$name" ]; then
      continue  # this layout's folders lend nothing: their recipes may differ from today's
    fi
    if [ "$(reported_version "$name" "$old/$name")" = "$want" ]; then
      ln -f "$old/$name" "$dest" 2>/dev/null || cp "$old/$name" "$dest"
      log "  $name $want taken from $old (the earlier layout) instead of a rebuild"
      return 0
    fi
  done
  return 1
}

# ---- builds: each writes its binary to $2 ----------------------------------------------------

go_module() {  # DIR MODULE VERSION: a throwaway module that requires one dependency
  local dir=$1 mod=$2 ver=$3
  mkdir -p "$dir"
  (cd "$dir" && { [ -f go.mod ] || go mod init "matrixpool.dev/tools/$(basename "$dir")" >/dev/null 2>&1; } \
    && go mod edit -require="$mod@$ver")
}

# k8s.io/kubernetes, with every staging module listed in its own go.mod replaced by its
# published v0.x twin; prepared once per version for the five binaries built from it.
kube_module() {
  local dir="$work/kubernetes-$KUBERNETES_VERSION"
  if [ ! -f "$dir/.ready" ]; then
    go_module "$dir" k8s.io/kubernetes "$KUBERNETES_VERSION"
    local gomod staging
    gomod=$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" \
      | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    staging=$(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod")
    [ -n "$staging" ] || { log "no staging replace lines found in $gomod"; exit 1; }
    local v0="v0.${KUBERNETES_VERSION#v1.}"
    for m in $staging; do (cd "$dir" && go mod edit -replace="$m=$m@$v0"); done
    log "  k8s.io/kubernetes $KUBERNETES_VERSION: $(echo "$staging" | wc -w) staging modules replaced at $v0"
    run_with_progress "kubernetes-deps" bash -c "cd '$dir' && go get k8s.io/kubernetes/cmd/kube-apiserver@$KUBERNETES_VERSION && go mod download"
    touch "$dir/.ready"
  fi
  echo "$dir"
}

build_kube() {  # NAME OUT
  local dir
  dir=$(kube_module)
  run_with_progress "$1" bash -c "cd '$dir' && go build -ldflags '$kube_ldflags' -o '$2' k8s.io/kubernetes/cmd/$1"
}

build_etcd() {
  local dir="$work/etcd-$ETCD_VERSION"
  go_module "$dir" go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
  run_with_progress etcd bash -c "cd '$dir' && go get go.etcd.io/etcd/server/v3@$ETCD_VERSION && go build -ldflags '-s -w' -o '$2' go.etcd.io/etcd/server/v3"
}

build_installed() {  # NAME OUT PACKAGE@VERSION LDFLAGS
  local gobin="$work/gobin-$1"
  run_with_progress "$1" env GOBIN="$gobin" go install -ldflags "$4" "$3"
  mv "$gobin/$1" "$2"
}

# CoreDNS: upstream's coremain with the plugins of tools/k8s/coredns/main.go; `go mod tidy`
# fetches only what those import (the whole module would add the cloud plugins' SDKs).
build_coredns() {
  local dir="$work/coredns-$COREDNS_VERSION"
  go_module "$dir" github.com/coredns/coredns "$COREDNS_VERSION"
  cp "$here/coredns/main.go" "$dir/main.go"
  run_with_progress coredns-deps bash -c "cd '$dir' && go mod tidy"
  run_with_progress coredns bash -c "cd '$dir' && go build -ldflags '-s -w' -o '$2' ."
}

build_pause() {
  run_with_progress pause bash -c "cd '$here/pause' && go build -ldflags '-s -w' -o '$2' ."
}

build() {  # NAME OUT
  case $1 in
    etcd) build_etcd "$1" "$2" ;;
    kube-*|kubelet|kubeadm|kubectl) build_kube "$1" "$2" ;;
    kwok) build_installed kwok "$2" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "-s -w" ;;
    kind) build_installed kind "$2" "sigs.k8s.io/kind@$KIND_VERSION" "-s -w" ;;
    helm) build_installed helm "$2" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" "$helm_ldflags" ;;
    coredns) build_coredns "$1" "$2" ;;
    pause) build_pause "$1" "$2" ;;
  esac
}

log "building what is missing of ${binaries[*]} into $bin (a cold build takes a while on a small machine)"
mkdir -p "$bin"
for b in "${binaries[@]}"; do
  step=$((step + 1))
  dir=$(slot "$b")
  version=$(pinned_version "$b")
  if [ ! -x "$dir/$b" ]; then
    log "[$step/$total] $b ${version:-$(recipe "$b" | cut -d' ' -f1)}"
    mkdir -p "$dir"
    rm -f "$dir/$b.tmp"
    adopt "$b" "$dir/$b.tmp" || build "$b" "$dir/$b.tmp"
    recipe "$b" >"$dir/RECIPE"
    mv "$dir/$b.tmp" "$dir/$b"
  fi
  ln -f "$dir/$b" "$bin/$b" 2>/dev/null || cp "$dir/$b" "$bin/$b"
done
printf '%s\n' "$recipes" >"$bin/RECIPES"
complete || { log "build finished but binaries are missing"; exit 1; }
log "binaries ready in $((SECONDS - started)) s"
echo "$bin"
