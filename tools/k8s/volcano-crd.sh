#!/usr/bin/env bash
# Generates Volcano's HyperNode CRD (topology.volcano.sh/v1alpha1) from its Go types, for the
# test that applies `matrixpool export topology --format volcano` to a real API server
# (tests/integration/test_peers.py). The repository holds no copy of Volcano's CRDs: this runs
# controller-gen (sigs.k8s.io/controller-tools, the generator Volcano uses) over the module
# volcano.sh/apis at a pinned version, into
# ${MATRIXPOOL_CACHE:-~/.cache/matrixpool}/peers/volcano-apis-<version>/crd/.
# Versions: VOLCANO_APIS_VERSION, CONTROLLER_GEN_VERSION from the environment, else below.
# Reuses a complete folder. Prints the folder as its last line.
set -euo pipefail

VOLCANO_APIS_VERSION=${VOLCANO_APIS_VERSION:-v1.14.0}
CONTROLLER_GEN_VERSION=${CONTROLLER_GEN_VERSION:-v0.18.0}
cache=${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}
out="$cache/peers/volcano-apis-$VOLCANO_APIS_VERSION"
work="$cache/work/volcano-apis-$VOLCANO_APIS_VERSION"
crd="$out/crd/topology.volcano.sh_hypernodes.yaml"

if [ -s "$crd" ]; then
  echo "$out"
  exit 0
fi
mkdir -p "$out/crd" "$work"
exec 9>"$cache/peers/.volcano-apis-$VOLCANO_APIS_VERSION.lock"
flock 9
if [ -s "$crd" ]; then
  echo "$out"
  exit 0
fi
export GOFLAGS="-mod=mod -trimpath"
export CGO_ENABLED=0
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
started=$SECONDS
log() { printf '[volcano-crd %3ds] %s\n' "$((SECONDS - started))" "$*" >&2; }

log "[1/3] resolving volcano.sh/apis@$VOLCANO_APIS_VERSION and controller-gen $CONTROLLER_GEN_VERSION"
cd "$work"
[ -f go.mod ] || go mod init matrixpool.dev/tools/volcano >/dev/null 2>&1
go get "sigs.k8s.io/controller-tools/cmd/controller-gen@$CONTROLLER_GEN_VERSION" \
  "volcano.sh/apis@$VOLCANO_APIS_VERSION" >"$work/deps.log" 2>&1 \
  || { tail -n 40 "$work/deps.log" >&2; exit 1; }
log "[2/3] controller-gen"
go build -o "$work/controller-gen" sigs.k8s.io/controller-tools/cmd/controller-gen
src=$(go list -m -f '{{.Dir}}' volcano.sh/apis)
log "[3/3] the HyperNode CRD from $src/pkg/apis/topology/v1alpha1"
(cd "$src" && "$work/controller-gen" crd paths=./pkg/apis/topology/v1alpha1/... \
  output:crd:dir="$work/crd")
cp "$work/crd/topology.volcano.sh_hypernodes.yaml" "$crd.tmp" && mv "$crd.tmp" "$crd"
log "done in $((SECONDS - started)) s"
echo "$out"
