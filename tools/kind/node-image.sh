#!/usr/bin/env bash
# Builds a kind node image with no registry and loads it into podman as
# localhost/matrixpool/kind-node:<k8s version> (`make kind-node-image`). Prints the image name
# last. Needs root (mmdebstrap, chroot, podman); installs podman and mmdebstrap from Debian
# (apt-get) if missing, and says so.
#
# Cached by content: the image carries the label matrixpool.kind-node-key, a hash of everything
# it is made from (these scripts, kind's base-image files, the binaries' recipes); a call that
# finds an image of the current key does nothing (~1 s). The Debian root file systems are cached
# in ~/.cache/matrixpool/kind/ by their package lists.
#
# What it holds, and how it differs from kindest/node:
#   - root fs: mmdebstrap of Debian bookworm (this machine's apt sources) with systemd and
#     Debian's containerd 1.6.20 / runc 1.1.5 / CNI plugins 1.1.1 (kindest/base: trixie with
#     containerd 2.x, runc 1.4, CNI 1.9 built from source), plus kind's own base-image files
#     (entrypoint, systemd units, kubelet drop-ins, sysctls) from the kind Go module, adapted:
#     containerd at /usr/bin, CNI plugins at /usr/lib/cni (linked from /opt/cni/bin),
#     restrict_oom_score_adj = true (no CAP_SYS_RESOURCE here: lowering oom_score_adj fails),
#     kubelet --fail-cgroupv1=false (this machine is cgroup v1; kubelet >= 1.35 refuses it).
#   - /usr/bin/kubeadm, kubelet, kubectl v1.37.2 built from Go modules.
#   - images preloaded in containerd (namespace k8s.io), named exactly as
#     `kubeadm config images list` names them, each one layer made from binaries we build:
#     kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy (+ Debian iptables),
#     etcd (v3.7.0), CoreDNS (our v1.15.0 build under the tag kubeadm asks for), pause.
#   - CNI: no kindnetd (an image we would have to build); a systemd service in the node
#     (podnet.sh) does its job: bridge + host-local conflist on the node's podCIDR, a route to
#     each other node's podCIDR via its IP; default-cni.yaml is a no-op ConfigMap.
#     Storage: a no-provisioner StorageClass (no local-path-provisioner image).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=env.sh
source "$here/env.sh"
cache=$MP_KIND_CACHE
work=$cache/node-work
image=localhost/matrixpool/kind-node:$KUBERNETES_VERSION
t0=$SECONDS
log() { printf '[kind-node %3ds] %s\n' "$((SECONDS - t0))" "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "needs root (mmdebstrap, chroot, podman)"; exit 1; }
kind_host_ready
need_debs mmdebstrap=mmdebstrap jq=jq
bin=$(nice -n 19 "$repo/tools/k8s/build.sh" | tail -n1)
kbin=$(kind_binaries)
kind_src=$(cd /tmp && go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | jq -r .Dir)
files=$kind_src/images/base/files

# The image is keyed by everything it is made from (label matrixpool.kind-node-key): the
# scripts here, kind's base files, the Debian package list, and the binaries' recipes; a warm
# call with an image of the current key does nothing.
key=$( { cat "$here"/node-image.sh "$here"/podnet.sh "$here"/iptables-wrapper "$here"/image-archive.py
  (cd "$files" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
  cat "$bin/RECIPES" "$kbin/RECIPES"; } | sha256sum | cut -c1-16)
if [ "$(podman image inspect -f '{{index .Labels "matrixpool.kind-node-key"}}' "$image" 2>/dev/null)" = "$key" ]; then
  echo "$image"
  exit 0
fi

# --- 1. Debian root fs (cached by its package list) -------------------------------------------
pkgs=systemd,systemd-sysv,dbus,containerd,runc,containernetworking-plugins,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,bash,ca-certificates,procps,jq,socat,e2fsprogs
base=$cache/base-$(echo "$pkgs" | sha256sum | cut -c1-12)
if [ ! -f "$base/.ready" ]; then
  log "mmdebstrap bookworm ($pkgs)"
  rm -rf "$base"; mkdir -p "$base"
  nice -n 19 mmdebstrap --quiet --variant=minbase --mode=root --format=directory \
    --aptopt='APT::Install-Recommends "false"' --include="$pkgs" \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/usr/share/doc "$1"/usr/share/man' \
    bookworm "$base/rootfs" >&2
  rm -f "$base/rootfs/etc/apt/sources.list" "$base"/rootfs/etc/apt/sources.list.d/*
  touch "$base/.ready"
fi
proxybase=$cache/proxybase
if [ ! -f "$proxybase/.ready" ]; then
  log "mmdebstrap bookworm for kube-proxy (iptables, conntrack)"
  rm -rf "$proxybase"; mkdir -p "$proxybase"
  nice -n 19 mmdebstrap --quiet --variant=minbase --mode=root --format=directory \
    --aptopt='APT::Install-Recommends "false"' --include=iptables,conntrack,kmod,ipset \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/usr/share/doc "$1"/usr/share/man "$1"/usr/share/locale' \
    bookworm "$proxybase/rootfs" >&2
  rm -f "$proxybase/rootfs/etc/apt/sources.list" "$proxybase"/rootfs/etc/apt/sources.list.d/*
  touch "$proxybase/.ready"
fi
if ! cmp -s "$here/iptables-wrapper" "$proxybase/rootfs/usr/sbin/iptables-wrapper"; then
  # As upstream's kube-proxy image (iptables-wrappers): the first iptables call picks legacy or
  # nft by which one already holds rules in the node (kind's entrypoint picks the same way).
  install -m0755 "$here/iptables-wrapper" "$proxybase/rootfs/usr/sbin/iptables-wrapper"
  for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    ln -sfn /usr/sbin/iptables-wrapper "$proxybase/rootfs/etc/alternatives/$t"
  done
fi

# --- 2. the control-plane images, as docker-archives ------------------------------------------
rm -rf "$work"; mkdir -p "$work/images"
mapfile -t wanted < <("$kbin/kubeadm" config images list --kubernetes-version "$KUBERNETES_VERSION")
archive() { python3 "$here/image-archive.py" "$work/images/$1.tar" "${@:2}"; }
for ref in "${wanted[@]}"; do
  short=${ref##*/}; short=${short%%:*}
  case $short in
    kube-apiserver|kube-controller-manager|kube-scheduler)
      archive "$short" "$ref" --file "$bin/$short=/usr/local/bin/$short:0755" ;;
    kube-proxy)
      archive "$short" "$ref" --rootfs "$proxybase/rootfs" --file "$bin/kube-proxy=/usr/local/bin/kube-proxy:0755" ;;
    etcd)
      archive etcd "$ref" --file "$bin/etcd=/usr/local/bin/etcd:0755" ;;
    coredns)
      archive coredns "$ref" --file "$bin/coredns=/coredns:0755" --entrypoint '["/coredns"]' ;;
    pause)
      pause_ref=$ref
      archive pause "$ref" --file "$bin/pause=/pause:0755" --entrypoint '["/pause"]' ;;
    *) log "kubeadm lists an image this script does not build: $ref"; exit 1 ;;
  esac
  log "image $ref"
done

# --- 3. the node root fs: Debian + kind's base files + our binaries -------------------------
root=$work/rootfs
cp -a "$base/rootfs" "$root"
install -m0755 "$files"/usr/local/bin/* "$root/usr/local/bin/"
mkdir -p "$root/kind/bin" "$root/kind/manifests" "$root/LICENSES" "$root/etc/kubernetes/manifests" \
  "$root/etc/systemd/system/kubelet.service.d" "$root/etc/cni/net.d" "$root/opt/cni"
install -m0644 "$files"/kind/README.txt "$root/kind/"
install -m0755 "$files"/kind/bin/* "$root/kind/bin/"
install -m0644 "$files"/etc/crictl.yaml "$root/etc/"
install -m0644 "$files"/etc/default/* "$root/etc/default/"
install -m0644 "$files"/etc/sysctl.d/* "$root/etc/sysctl.d/"
install -m0644 "$files"/etc/systemd/system/*.service "$files"/etc/systemd/system/*.slice "$root/etc/systemd/system/"
install -m0644 "$files"/etc/systemd/system/kubelet.service.d/* "$root/etc/systemd/system/kubelet.service.d/"
sed -i 's#/usr/local/bin/containerd#/usr/bin/containerd#' "$root/etc/systemd/system/containerd.service"
ln -sfn /usr/lib/cni "$root/opt/cni/bin"
# kubelet >= 1.35 refuses cgroup v1 unless told not to; flags win over kubeadm's config file.
sed -i 's#^KUBELET_EXTRA_ARGS=.*#& --fail-cgroupv1=false#' "$root/etc/default/kubelet"
# containerd: kind's config (v2 format, read by containerd 1.6 too), changed for this machine.
sed -e "s#^\(\s*sandbox_image = \).*#\1\"$pause_ref\"#" \
    -e 's#restrict_oom_score_adj = false#restrict_oom_score_adj = true#' \
    "$files/etc/containerd/config.toml" >"$root/etc/containerd/config.toml"
chroot "$root" ctr oci spec \
  | jq '.hooks.createContainer[.hooks.createContainer | length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
  | jq 'del(.process.rlimits)' >"$root/etc/containerd/cri-base.json"
# kind's base Dockerfile steps
chroot "$root" sh -euc '
  find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
  rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
    /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
    /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
  echo ReadKMsg=no >>/etc/systemd/journald.conf
  systemctl enable kubelet.service containerd.service undo-mount-hacks.service
  systemctl mask systemd-binfmt.service'
for b in kubeadm kubectl; do install -m0755 "$kbin/$b" "$root/usr/bin/$b"; done
install -m0755 "$bin/kubelet" "$root/usr/bin/kubelet"
printf '%s' "$KUBERNETES_VERSION" >"$root/kind/version"
# pod network: kindnetd's job done by a shell loop (per-node podCIDR conflist + routes)
install -m0755 "$here/podnet.sh" "$root/kind/bin/matrixpool-podnet.sh"
cat >"$root/etc/systemd/system/matrixpool-podnet.service" <<'EOF'
[Unit]
Description=matrixpool kind pod network (bridge per node, routes to the other nodes)
After=containerd.service
[Service]
ExecStart=/kind/bin/matrixpool-podnet.sh
Restart=always
RestartSec=2
[Install]
WantedBy=multi-user.target
EOF
chroot "$root" systemctl enable matrixpool-podnet.service
cat >"$root/kind/manifests/default-cni.yaml" <<'EOF'
# matrixpool's kind node image: /kind/bin/matrixpool-podnet.sh (a systemd service on every
# node, using the kubelet's credentials) writes the bridge conflist and the routes. The Node
# authorizer lets a node read only its own Node; podnet also needs the others' podCIDRs.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: matrixpool-kind-podnet}
rules:
- {apiGroups: [""], resources: [nodes], verbs: [get, list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: matrixpool-kind-podnet}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: matrixpool-kind-podnet}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:nodes"}
EOF
cat >"$root/kind/manifests/default-storage.yaml" <<'EOF'
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
EOF
log "node root fs: $(du -sh "$root" | cut -f1)"

# --- 4. import, preload the images into the node's containerd, commit ------------------------
stage=localhost/matrixpool/kind-node-stage:$KUBERNETES_VERSION
tar --numeric-owner -C "$root" -c . | podman import - "$stage" >/dev/null
rm -rf "$root"
ctr=mp-kind-node-build
podman rm -f "$ctr" >/dev/null 2>&1 || true
podman run -d --name "$ctr" --privileged --entrypoint /usr/bin/containerd \
  -v "$work/images:/images:ro" "$stage" >/dev/null
for _ in $(seq 30); do podman exec "$ctr" ctr version >/dev/null 2>&1 && break; sleep 1; done
for f in "$work"/images/*.tar; do
  podman exec "$ctr" ctr -n k8s.io images import --no-unpack --digests "/images/$(basename "$f")" >&2
done
podman exec "$ctr" ctr -n k8s.io images ls -q >&2
podman kill --signal TERM "$ctr" >/dev/null; podman wait "$ctr" >/dev/null || true
old_id=$(podman image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
podman commit -q \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' \
  --change 'ENV container=docker' --change 'STOPSIGNAL SIGRTMIN+3' \
  --change "LABEL matrixpool.kind-node-key=$key" \
  "$ctr" "$image" >/dev/null
podman rm -f "$ctr" >/dev/null; podman rmi "$stage" >/dev/null
# the image this one replaces (1.2 GB), unless a node container still uses it
if [ -n "$old_id" ] && [ "$old_id" != "$(podman image inspect -f '{{.Id}}' "$image")" ]; then
  podman rmi "$old_id" >/dev/null 2>&1 || true
fi
rm -rf "$work"
log "node image $image: $(podman image inspect -f '{{.Size}}' "$image") bytes"
echo "$image"
