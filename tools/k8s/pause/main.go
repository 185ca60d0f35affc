// pause: the sandbox ("infra") container of the real nodes' pods, built here because no
// registry is reached. It holds the pod's namespaces, reaps orphans (it is PID 1 of the
// sandbox) and exits 0 on SIGINT or SIGTERM, as the upstream pause does.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
