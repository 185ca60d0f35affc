#!/usr/bin/env bash
# `make kind-e2e` (in `make test`, after the real nodes): docs/install-kind.md section B on a
# kind cluster of this machine (tools/kind/cluster.sh: podman, the node image built here).
# Steps 4 to 11 are the doc's own bash blocks, read from the doc and run unchanged. Steps 1-3
# and step 10's first block are run with the substitutions this machine needs, each printed as
# it runs:
#   1. `kind create cluster`   -> tools/kind/cluster.sh up 1 (--image: the local node image;
#                                 a fresh cluster name; kubeconfig in ~/.cache/matrixpool/kind)
#   2. `docker build` + `kind load docker-image`
#                              -> `make image`'s archive and `kind load image-archive`, only if
#                                 the disk keeps MIN_FREE_GB free after it (a node holds about
#                                 twice the archive); otherwise a failure that says so (steps
#                                 5-7 need the image)
#   3. kwok's release manifests (downloaded in the doc)
#                              -> the same kustomize folders from kwok's Go module at
#                                 KWOK_VERSION, its image made from our kwok binary
#   10. `docker build -t matrixpool:dev2` + `kind load docker-image matrixpool:dev2`
#                              -> `ctr images tag` of matrixpool:dev in the node (same bytes)
# and `docker exec` (steps 8, 11) is podman's: a `docker` on PATH that runs `podman exec`.
# Prints one line per step, PASS or FAIL, and exits non-zero at the first failure; the
# cluster is deleted on the way out (tools/kind/cluster.sh down checks nothing of it is left).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=env.sh
source "$here/env.sh"
doc=$repo/docs/install-kind.md
archive=${MATRIXPOOL_IMAGE_ARCHIVE:-${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}/image/matrixpool_dev.tar}
min_free_gb=${MIN_FREE_GB:-4}
t0=$SECONDS
say() { printf '[kind-e2e %3ds] %s\n' "$((SECONDS - t0))" "$*" >&2; }
results=()
result() { results+=("$1"); say "$1"; }

# doc_block N [K]: the Kth (default first) ```bash block under the heading "## N." of section B
doc_block() {
  awk -v n="## $1." -v k="${2:-1}" '
    index($0, n) == 1 { inside = 1; next }
    inside && /^## / { exit }
    inside && /^```bash$/ { seen++; code = (seen == k); next }
    inside && code && /^```$/ { exit }
    code { print }' "$doc"
}

bin=$(nice -n 19 "$repo/tools/k8s/build.sh" | tail -n1)
kbin=$(kind_binaries)
export PATH=$kbin:$bin:$PATH  # kind, kubectl, helm, kwok: all built here

shim=""  # the folder of the `docker` stand-in (below), removed on the way out
finish() {
  local rc=$?
  [ -z "$shim" ] || rm -rf "$shim"
  say "deleting the cluster"
  "$here/cluster.sh" down || rc=1
  printf '%s\n' "${results[@]}" >&2
  exit "$rc"
}
trap finish EXIT

# 1. the cluster
KUBECONFIG=$("$here/cluster.sh" up 1 | tail -n1)
export KUBECONFIG
name=$("$here/cluster.sh" name)
kubectl cluster-info --context "kind-$name" >&2
result "PASS 1. kind cluster $name (podman, node image $(podman inspect -f '{{.Config.Image}}' "$name-control-plane"))"

# 2. the matrixpool image
need=$(( $(stat -c %s "$archive" 2>/dev/null || echo 0) * 2 / 1024 / 1024 / 1024 + 1 ))
free=$(( $(df --output=avail -k / | tail -n1) / 1024 / 1024 ))
if [ ! -f "$archive" ]; then
  result "FAIL 2. no image archive at $archive (make image)"
  exit 1
elif [ $((free - need)) -lt "$min_free_gb" ]; then
  result "FAIL 2. kind load image-archive $archive: needs ~${need} GB on the node, ${free} GB free, ${min_free_gb} GB must stay free"
  exit 1
else
  nice -n 19 kind load image-archive "$archive" --name "$name" >&2
  result "PASS 2. kind load image-archive $(basename "$archive")"
fi

# 3. kwok, from its Go module, its image from our binary
kwok_src=$(cd /tmp && go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | jq -r .Dir)
work=$(mktemp -d)
kubectl kustomize "$kwok_src/kustomize/kwok" >"$work/kwok.yaml"
kwok_image=$(sed -n 's/^ *image: *//p' "$work/kwok.yaml" | head -n1)
sed -i "s#^\( *image: *\)$kwok_image\$#\1$kwok_image:$KWOK_VERSION#" "$work/kwok.yaml"
python3 "$here/image-archive.py" "$work/kwok-image.tar" "$kwok_image:$KWOK_VERSION" \
  --file "$bin/kwok=/usr/local/bin/kwok:0755" --entrypoint '["/usr/local/bin/kwok"]'
kind load image-archive "$work/kwok-image.tar" --name "$name" >&2
kubectl apply -f "$work/kwok.yaml" >&2
kubectl apply -k "$kwok_src/kustomize/stage/fast" >&2
rm -rf "$work"
kubectl -n kube-system rollout status deployment/kwok-controller --timeout=120s >&2
result "PASS 3. kwok $KWOK_VERSION in kube-system (its manifests from the Go module, image from our binary)"

# `docker exec` in the doc's blocks: kind's node is a podman container here
shim=$(mktemp -d)
printf '%s\n' '#!/bin/sh' \
  '# tools/kind/e2e.sh: `docker exec` where kind'"'"'s nodes are podman containers' \
  '[ "$1" = exec ] || { echo "docker $1: only docker exec is stood in for here" >&2; exit 2; }' \
  'exec podman "$@"' >"$shim/docker"
chmod +x "$shim/docker"
export PATH=$shim:$PATH
say "docker exec -> podman exec (steps 8 and 11; $shim/docker)"

# run_doc N [K]: the Kth bash block of step N, unchanged; PASS or FAIL
run_doc() {
  local step=$1 block
  block=$(doc_block "$step" "${2:-1}")
  [ -n "$block" ] || { result "FAIL $step. no bash block under '## $step.' in $doc"; exit 1; }
  say "running docs/install-kind.md step $step:"
  printf '%s\n' "$block" | sed 's/^/    /' >&2
  if bash -euo pipefail -c "$block" >&2; then
    result "PASS $step. $(grep -m1 "^## $step\." "$doc" | sed "s/^## [0-9]*\. //")"
  else
    result "FAIL $step. $(grep -m1 "^## $step\." "$doc" | sed "s/^## [0-9]*\. //")"
    kubectl get pods -A -o wide >&2 || true
    kubectl get supernodes,trainingjobs -o wide >&2 || true
    kubectl get events --sort-by=.lastTimestamp 2>/dev/null | tail -n 15 >&2 || true
    kubectl -n matrixpool-system get events --sort-by=.lastTimestamp 2>/dev/null | tail -n 15 >&2 || true
    kubectl -n matrixpool-system logs deployment/matrixpool --tail=30 >&2 || true
    kubectl logs -l matrixpool.dev/job=pytorch-ddp --tail=5 >&2 || true
    exit 1
  fi
}

# 4.-11.: the doc's blocks, unchanged, but for step 10's build and load
for step in 4 5 6 7 8 9; do run_doc "$step"; done
built=$(doc_block 10 1)
say "step 10's first block, stood in for:"
printf '%s\n' "$built" | sed 's/^/    (not run) /' >&2
case $built in
  *"docker build -t matrixpool:dev2 ."*"kind load docker-image matrixpool:dev2"*) ;;
  *) result "FAIL 10. its first block is not the build and load this script stands in for"; exit 1 ;;
esac
tag=(ctr --namespace k8s.io images tag docker.io/library/matrixpool:dev docker.io/library/matrixpool:dev2)
say "  podman exec $name-control-plane ${tag[*]}"
podman exec "$name-control-plane" "${tag[@]}" >&2
run_doc 10 2
run_doc 11
