#!/usr/bin/env bash
# A kind cluster with podman (KIND_EXPERIMENTAL_PROVIDER=podman) from the locally built node
# image (tools/kind/node-image.sh, built first if missing). Nothing is pulled from a registry.
# Needs root.
#
#   tools/kind/cluster.sh up [NODES]   1 (default) or 2 nodes (a control plane + a worker);
#                                      prints the kubeconfig's path last  (make kind)
#   tools/kind/cluster.sh name         the name of the cluster that is up, if any
#   tools/kind/cluster.sh down         deletes it: its node containers, their volumes and
#                                      kind's podman network; checks none is left (make kind-down)
#
# One cluster at a time on this machine (each node's /var takes 1 GB and more): `up` and `down`
# run under a lock (~/.cache/matrixpool/kind/cluster.lock), and `up` refuses while the cluster
# of an earlier `up` still runs. Each `up` names its cluster afresh (mp-kind-<time>), so a
# cluster from a run that died never clashes with the next one. The kubeconfig is written to
# ~/.cache/matrixpool/kind/kubeconfig, never to ~/.kube/config (kind's default), so no other
# kubectl on this machine is pointed at kind by accident.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=env.sh
source "$here/env.sh"
kubeconfig=$MP_KIND_CACHE/kubeconfig
state=$MP_KIND_CACHE/cluster.name
log() { printf '[kind] %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "needs root (podman, rootful)"; exit 1; }
mkdir -p "$MP_KIND_CACHE"
exec 8>"$MP_KIND_CACHE/cluster.lock"
if ! flock -n 8; then
  log "another tools/kind/cluster.sh is running; waiting for it"
  flock 8
fi
kind_host_ready
kbin=$(kind_binaries)
# Every podman container's conmon would inherit the lock's descriptor and hold the lock for as
# long as the cluster runs: what starts containers runs with descriptor 8 closed.
kind() { "$kbin/kind" "$@" 8>&-; }
current() { [ -f "$state" ] && kind get clusters 2>/dev/null | grep -qx "$(cat "$state")"; }
leftovers() {  # NAME: the podman containers and volumes of that cluster still there
  podman ps -aq --filter "label=io.x-k8s.kind.cluster=$1"
  podman volume ls -q | grep "^$1-" || true
}

case ${1:-} in
  up)
    nodes=${2:-1}
    case $nodes in 1|2) ;; *) log "NODES is 1 or 2, not $nodes"; exit 2 ;; esac
    if current; then
      log "kind cluster $(cat "$state") is up (KUBECONFIG=$kubeconfig); tools/kind/cluster.sh down first"
      exit 1
    fi
    name=mp-kind-$(date +%s)
    image=$(nice -n 19 "$here/node-image.sh" 8>&- | tail -n1)  # ~1 s when the image of the current inputs exists
    cfg=$MP_KIND_CACHE/cluster-$nodes.yaml
    {
      echo "kind: Cluster"
      echo "apiVersion: kind.x-k8s.io/v1alpha4"
      echo "nodes:"
      echo "- role: control-plane"
      for _ in $(seq 2 "$nodes"); do echo "- role: worker"; done
    } >"$cfg"
    echo "$name" >"$state"
    t0=$SECONDS
    kind create cluster --name "$name" --image "$image" --config "$cfg" \
      --kubeconfig "$kubeconfig" --wait 180s >&2
    "$kbin/kubectl" --kubeconfig "$kubeconfig" wait --for=condition=Ready node --all --timeout=120s >&2
    log "cluster $name up ($nodes node(s)) in $((SECONDS - t0)) s; export KUBECONFIG=$kubeconfig"
    echo "$kubeconfig"
    ;;
  name)
    current && cat "$state"
    ;;
  down)
    name=$(cat "$state" 2>/dev/null || true)
    if [ -z "$name" ]; then
      log "no kind cluster of tools/kind/cluster.sh recorded; nothing to delete"
    else
      kind delete cluster --name "$name" --kubeconfig "$kubeconfig" >&2
      left=$(leftovers "$name")
      if [ -n "$left" ]; then
        log "after kind delete cluster, still there: $left"
        exit 1
      fi
      rm -f "$state" "$kubeconfig"
      log "cluster $name deleted; no container or volume of it is left"
    fi
    # kind keeps its podman network "kind" for the next cluster; drop it when no container uses it
    if podman network exists kind && [ -z "$(podman ps -aq --filter network=kind)" ]; then
      podman network rm kind >/dev/null
    fi
    ;;
  *) echo "usage: $0 up [NODES] | name | down" >&2; exit 2 ;;
esac
