// Command pause is the sandbox process of every Pod on the local node: it
// holds the Pod's namespaces and exits on SIGTERM or SIGINT.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
}
