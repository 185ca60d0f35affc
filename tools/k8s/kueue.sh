#!/usr/bin/env bash
# Builds Kueue (module sigs.k8s.io/kueue, its cmd/kueue manager) as a plain binary for the peer
# benchmarks, into ${MATRIXPOOL_CACHE:-~/.cache/matrixpool}/peers/kueue-<version>/, beside the
# files a process-run Kueue needs from the same module version:
#   kueue                          the manager (run it with --config; KUBECONFIG names the cluster)
#   crd/*.yaml                     config/components/crd/bases: every Kueue CRD (apply server-side;
#                                  the Workload CRD is too big for a client-side apply)
#   webhook/manifests.yaml         config/components/webhook/manifests.yaml: the webhook
#                                  configurations, still pointing at an in-cluster Service (the
#                                  caller rewrites clientConfig to a URL and adds a caBundle)
#   controller_manager_config.yaml config/components/manager: upstream's example Configuration
# Version: KUEUE_VERSION from the environment, else the default below. Reuses a complete folder;
# prints progress while a cold build runs. Prints the folder as its last line.
set -euo pipefail

KUEUE_VERSION=${KUEUE_VERSION:-v0.17.0}
module=sigs.k8s.io/kueue
cache=${MATRIXPOOL_CACHE:-$HOME/.cache/matrixpool}
out="$cache/peers/kueue-$KUEUE_VERSION"
work="$cache/work/kueue-$KUEUE_VERSION"
stamp="$out/BUILD-INFO"

complete() {
  [ -x "$out/kueue" ] && [ -s "$out/webhook/manifests.yaml" ] \
    && compgen -G "$out/crd/*.yaml" >/dev/null && [ -s "$stamp" ]
}
if complete; then
  echo "$out"
  exit 0
fi

# One build at a time per version: a second caller waits, then finds the folder ready.
mkdir -p "$out" "$work"
exec 9>"$cache/peers/.kueue-$KUEUE_VERSION.lock"
if ! flock -n 9; then
  echo "[kueue] another build of $KUEUE_VERSION is running; waiting for it" >&2
  flock 9
fi
if complete; then
  echo "$out"
  exit 0
fi
export GOFLAGS="-mod=mod -trimpath"
export CGO_ENABLED=0
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
started=$SECONDS

log() { printf '[kueue %3ds] %s\n' "$((SECONDS - started))" "$*" >&2; }

# run_with_progress LABEL CMD...: runs CMD, printing a heartbeat every 30 s so a cold build
# never looks stuck; shows the command's output only if it fails.
run_with_progress() {
  local label=$1; shift
  local log_file="$work/$label.log" t0=$SECONDS
  "$@" >"$log_file" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && log "  ... $label still running ($((SECONDS - t0)) s)"
  done
  if ! wait "$pid"; then
    log "FAILED: $label; last lines of $log_file:"
    tail -n 40 "$log_file" >&2
    exit 1
  fi
  log "  $label done in $((SECONDS - t0)) s"
}

log "cold build of Kueue $KUEUE_VERSION into $out"

# A throwaway module that requires Kueue. Kueue's go.mod pins published k8s.io modules and has
# no replace directives, so its own requirements build as they are.
(cd "$work" && { [ -f go.mod ] || go mod init matrixpool.dev/tools/kueue >/dev/null 2>&1; } \
  && go mod edit -require="$module@$KUEUE_VERSION")
log "[1/3] resolving $module@$KUEUE_VERSION and its dependencies"
run_with_progress kueue-deps bash -c "cd '$work' && go get '$module/cmd/kueue@$KUEUE_VERSION' && go mod download '$module'"
src=$(cd "$work" && go list -m -f '{{.Dir}}' "$module")
[ -d "$src/config/components/crd/bases" ] || { log "no CRDs found under $src"; exit 1; }

log "[2/3] copying the CRDs and the webhook manifest from $src"
rm -rf "$out/crd" "$out/webhook"
mkdir -p "$out/crd" "$out/webhook"
cp "$src"/config/components/crd/bases/*.yaml "$out/crd/"
cp "$src/config/components/webhook/manifests.yaml" "$out/webhook/manifests.yaml"
cp "$src/config/components/manager/controller_manager_config.yaml" "$out/"
chmod -R u+w "$out/crd" "$out/webhook" "$out/controller_manager_config.yaml"
log "  $(find "$out/crd" -name '*.yaml' | wc -l) CRD files"

log "[3/3] kueue (cmd/kueue)"
pkgver=$module/pkg/version
ldflags="-s -w -X $pkgver.GitVersion=$KUEUE_VERSION -X $pkgver.BuildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
run_with_progress kueue bash -c "cd '$work' && go build -ldflags '$ldflags' -o '$out/kueue.tmp' '$module/cmd/kueue' && mv '$out/kueue.tmp' '$out/kueue'"

printf 'module=%s\nversion=%s\ngo=%s\nbuilt=%s\n' "$module" "$KUEUE_VERSION" \
  "$(go env GOVERSION)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$stamp"
complete || { log "build finished but files are missing in $out"; exit 1; }
log "Kueue $KUEUE_VERSION built in $((SECONDS - started)) s"
echo "$out"
