// Command etcd runs a single-member etcd for the test control plane,
// using the etcd server library that kube-apiserver itself is built against.
package main

import (
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"

	"go.etcd.io/etcd/server/v3/embed"
)

func main() {
	dataDir := flag.String("data-dir", "", "directory for etcd's data")
	clientURL := flag.String("listen-client-urls", "http://127.0.0.1:2379", "client URL to serve")
	peerURL := flag.String("listen-peer-urls", "http://127.0.0.1:2380", "peer URL to serve")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("--data-dir is required")
	}
	client, err := url.Parse(*clientURL)
	if err != nil {
		log.Fatalf("--listen-client-urls: %v", err)
	}
	peer, err := url.Parse(*peerURL)
	if err != nil {
		log.Fatalf("--listen-peer-urls: %v", err)
	}

	cfg := embed.NewConfig()
	cfg.Name = "agentrun-e2e"
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*client}
	cfg.AdvertiseClientUrls = []url.URL{*client}
	cfg.ListenPeerUrls = []url.URL{*peer}
	cfg.AdvertisePeerUrls = []url.URL{*peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()
	cfg.LogLevel = "warn"
	// Tests value speed over durability of the test cluster's own data.
	cfg.UnsafeNoFsync = true

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("starting etcd: %v", err)
	}
	defer e.Close()
	<-e.Server.ReadyNotify()
	log.Printf("etcd ready, serving clients on %s", client)

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case err := <-e.Err():
		log.Fatalf("etcd: %v", err)
	case s := <-sig:
		log.Printf("etcd stopping on %s", s)
	}
}
