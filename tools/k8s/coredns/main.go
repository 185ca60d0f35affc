// CoreDNS for matrixpool's local clusters: upstream's coremain with the plugins a cluster DNS
// uses (the ones kubeadm's Corefile names, plus bind and hosts), instead of all ~60 of
// github.com/coredns/coredns/core/plugin: the cloud plugins' SDKs (AWS, Azure, GCP, DataDog)
// would double the build. Built by tools/k8s/build.sh at COREDNS_VERSION (versions.env); the
// order in which plugins run is upstream's (core/dnsserver/zdirectives.go), whatever the
// order of the imports below.
package main

import (
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func main() {
	coremain.Run()
}
