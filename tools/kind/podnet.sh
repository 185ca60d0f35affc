#!/bin/bash
# The pod network of matrixpool's kind node image (what kindnetd does in kindest/node, with
# no image to pull): once this node has a podCIDR, write a bridge + host-local conflist on it;
# keep a route to every other node's podCIDR via that node's InternalIP (all nodes share one
# podman network); masquerade only what leaves the pod network (pod-to-pod traffic keeps
# its source IP, as with kindnetd). Runs on every node as matrixpool-podnet.service.
set -u
kc=/etc/kubernetes/kubelet.conf
conf=/etc/cni/net.d/10-matrixpool-bridge.conflist
me=$(hostname)
while true; do
  if [ -f "$kc" ]; then
    lines=$(kubectl --kubeconfig="$kc" get nodes -o jsonpath='{range .items[*]}{.metadata.name} {.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' 2>/dev/null)
    cidrs=()
    while read -r name cidr ip; do
      [ -n "${cidr:-}" ] && cidrs+=("$cidr")
      [ -n "${cidr:-}" ] || continue
      if [ "$name" = "$me" ]; then
        want=$(printf '{"cniVersion":"0.4.0","name":"matrixpool-bridge","plugins":[{"type":"bridge","bridge":"cni0","isGateway":true,"ipMasq":false,"hairpinMode":true,"ipam":{"type":"host-local","ranges":[[{"subnet":"%s"}]],"routes":[{"dst":"0.0.0.0/0"}]}},{"type":"portmap","capabilities":{"portMappings":true}}]}' "$cidr")
        if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
          echo "$want" >"$conf.tmp" && mv "$conf.tmp" "$conf"
          echo "podnet: $conf on $cidr"
        fi
      elif [ -n "${ip:-}" ]; then
        ip route replace "$cidr" via "$ip" || true
      fi
    done <<<"$lines"
    mine=$(sed -n 's/.*"subnet":"\([^"]*\)".*/\1/p' "$conf" 2>/dev/null)
    if [ -n "$mine" ]; then
      # nat chain MATRIXPOOL-PODNET: RETURN for every podCIDR, MASQUERADE the rest
      want="${cidrs[*]}"
      if [ "$want" != "${masq_for:-}" ]; then
        iptables -t nat -N MATRIXPOOL-PODNET 2>/dev/null || iptables -t nat -F MATRIXPOOL-PODNET
        for c in "${cidrs[@]}"; do iptables -t nat -A MATRIXPOOL-PODNET -d "$c" -j RETURN; done
        iptables -t nat -A MATRIXPOOL-PODNET -j MASQUERADE
        iptables -t nat -C POSTROUTING -s "$mine" -j MATRIXPOOL-PODNET 2>/dev/null ||
          iptables -t nat -A POSTROUTING -s "$mine" -j MATRIXPOOL-PODNET
        masq_for=$want
      fi
    fi
  fi
  sleep 5
done
