# shellcheck shell=bash
# Sourced by e2e/cluster: `e2e/cluster node up`: containerd, the kubelet, kube-scheduler,
# and the services every cluster has (workload controllers, kube-proxy, CoreDNS).

node_up() {
  healthy || die "no healthy control plane at $E2E_DIR: run 'e2e/cluster up' first"
  local other
  if other="$(node_elsewhere)"; then
    die "another node runs on this machine (${other%/node/containerd/config.toml}); one node at a time: AGENTRUN_E2E_DIR=${other%/node/containerd/config.toml} e2e/cluster node down"
  fi
  if node_healthy; then
    log "reusing the healthy node $NODE_NAME"
    node_images
    return
  fi
  node_preflight
  node_build
  node_down_quiet
  [[ -f "$E2E_DIR/pki/apiserver-kubelet-client.crt" ]] \
    || die "the plane at $E2E_DIR predates the node (no kubelet client certificate on the apiserver): run down, then up"
  [[ "$(cat "$E2E_DIR/state/apiserver.advertise" 2>/dev/null)" == "$(node_ip)" ]] \
    || die "the plane at $E2E_DIR does not advertise $(node_ip) (the kubernetes Service's endpoint Pods reach): run down, then up"
  local started=$SECONDS ip
  ip="$(node_ip)"
  [[ -n "$ip" ]] || die "no global IPv4 address for the kubelet's --node-ip"
  rm -rf "$NODE_DIR"
  mkdir -p "$NODE_DIR"/{state,containerd,kubelet,cni/net.d,cni/ipam,pod-logs}
  echo "$ip" > "$NODE_DIR/state/node-ip"
  cat /proc/sys/net/ipv4/ip_forward > "$NODE_DIR/state/ip_forward.before"
  node_pki "$ip"

  local sock="$NODE_DIR/containerd/containerd.sock"
  cat > "$NODE_DIR/containerd/config.toml" <<TOML
version = 3
root = "$NODE_DIR/containerd/root"
state = "$NODE_DIR/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs"]

[grpc]
  address = "$sock"

[ttrpc]
  address = "$sock.ttrpc"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$PAUSE_IMAGE"

[plugins.'io.containerd.cri.v1.runtime']
  # This VM's capability bounding set lacks CAP_SYS_RESOURCE: without this runc cannot
  # lower the OOM score and every sandbox fails ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$CNI_BIN_DIR"]
    conf_dir = "$NODE_DIR/cni/net.d"
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
TOML
  # A private bridge: no masquerade, no route out; Pods reach only this machine, and the
  # Service range through it (kube-proxy translates a ClusterIP on the way in).
  cat > "$NODE_DIR/cni/net.d/10-agentrun.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "agentrun",
  "plugins": [
    {"type": "bridge", "bridge": "$NODE_BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$NODE_DIR/cni/ipam",
              "ranges": [[{"subnet": "$NODE_SUBNET", "gateway": "$NODE_GATEWAY"}]],
              "routes": [{"dst": "$SERVICE_CIDR", "gw": "$NODE_GATEWAY"}]}}
  ]
}
JSON
  # The bridge exists before the first Pod so that host services (the example's payments
  # service) can listen on its gateway address.
  ip link show "$NODE_BRIDGE" >/dev/null 2>&1 || ip link add "$NODE_BRIDGE" type bridge
  ip addr replace "$NODE_GATEWAY/24" dev "$NODE_BRIDGE"
  ip link set "$NODE_BRIDGE" up

  PATH="$CTRD_BIN:$PATH" node_start containerd "$CTRD_BIN/containerd" --config "$NODE_DIR/containerd/config.toml"
  node_wait "containerd" 60 "$CTRD_BIN/ctr" --address "$sock" version
  node_images

  local pki="$E2E_DIR/pki" api_port kubelet_port healthz_port sched_port
  api_port="$(cat "$E2E_DIR/state/apiserver.port")"
  kubelet_port=$(free_port); healthz_port=$(free_port); sched_port=$(free_port)
  cat > "$NODE_DIR/kubelet/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: agentrun-e2e
  cluster: {server: "https://127.0.0.1:$api_port", certificate-authority: "$pki/ca.crt"}
users:
- name: kubelet
  user: {client-certificate: "$pki/kubelet-client.crt", client-key: "$pki/kubelet-client.key"}
contexts:
- name: kubelet
  context: {cluster: agentrun-e2e, user: kubelet}
current-context: kubelet
KC
  cat > "$NODE_DIR/kubelet/config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This VM runs cgroup v1 (hybrid); kubelet 1.35+ refuses v1 unless told otherwise.
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
containerRuntimeEndpoint: "unix://$sock"
address: "$ip"
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz_port
tlsCertFile: "$pki/kubelet-serving.crt"
tlsPrivateKeyFile: "$pki/kubelet-serving.key"
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$pki/ca.crt"}
# Only holders of a certificate from the plane's CA get past authentication.
authorization: {mode: AlwaysAllow}
podLogsDir: "$NODE_DIR/pod-logs"
resolvConf: ""
# Pods resolve through the kube-dns Service (CoreDNS on the bridge's gateway).
clusterDNS: ["$CLUSTER_DNS_IP"]
clusterDomain: "$CLUSTER_DOMAIN"
makeIPTablesUtilChains: false
maxPods: 30
registerWithTaints:
- {key: "$NODE_TAINT", value: "real", effect: NoSchedule}
# The disk is shared with builds (and may be nearly full): evict only when it really is,
# in absolute terms, and never garbage-collect the imported images. There is no
# node-lifecycle controller to taint a node under pressure, so the scheduler would keep
# sending Pods that the kubelet then refuses ("Evicted") one after another.
evictionHard: {memory.available: "100Mi", nodefs.available: "256Mi", imagefs.available: "256Mi", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 10s
nodeStatusReportFrequency: 1m
shutdownGracePeriod: 0s
YAML
  node_kubectl apply -f - >/dev/null <<YAML
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "agentrun-e2e:node:$NODE_NAME"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:node:$NODE_NAME"}
YAML

  node_start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig "$E2E_DIR/kubeconfig" \
    --authentication-kubeconfig "$E2E_DIR/kubeconfig" \
    --authorization-kubeconfig "$E2E_DIR/kubeconfig" \
    --leader-elect=false --bind-address 127.0.0.1 --secure-port "$sched_port"
  node_wait "kube-scheduler /healthz" 60 curl -sfk --max-time 2 "https://127.0.0.1:$sched_port/healthz"
  node_services "$ip"

  node_start kubelet "$BIN/kubelet" \
    --config "$NODE_DIR/kubelet/config.yaml" \
    --kubeconfig "$NODE_DIR/kubelet/kubeconfig" \
    --root-dir "$NODE_DIR/kubelet/root" --cert-dir "$NODE_DIR/kubelet/pki" \
    --hostname-override "$NODE_NAME" --node-ip "$ip" \
    --node-labels "$NODE_TAINT=real"
  node_wait "node $NODE_NAME Ready" 120 node_ready
  # The kubelet registers with node.kubernetes.io/not-ready:NoSchedule; the node-lifecycle
  # controller that would lift it once Ready does not run on this plane, so we do.
  node_kubectl taint node "$NODE_NAME" node.kubernetes.io/not-ready:NoSchedule- >/dev/null 2>&1 || true
  node_wait "the workload controllers' /healthz" 60 \
    curl -sfk --max-time 2 "https://127.0.0.1:$(cat "$NODE_DIR/state/workload-controllers.port")/healthz"
  node_wait "kube-proxy /healthz" 60 curl -sf --max-time 2 "http://127.0.0.1:$(cat "$NODE_DIR/state/kube-proxy.healthz")/healthz"
  node_wait "CoreDNS /ready" 60 curl -sf --max-time 2 "http://127.0.0.1:$(cat "$NODE_DIR/state/coredns.ready")/ready"
  log "node $NODE_NAME ($ip, taint $NODE_TAINT=real:NoSchedule) up in $((SECONDS - started))s;" \
    "Services by kube-proxy (nftables), cluster DNS $CLUSTER_DNS_IP by CoreDNS on $NODE_GATEWAY:53"
}

# What every cluster has besides the kubelet, started by `node up`:
#   - the workload controllers (Deployment, ReplicaSet, EndpointSlice) in a controller
#     manager of the node's own, so the plane without a node keeps its short list;
#   - kube-proxy, nftables mode (its own tables, `ip kube-proxy` and `ip6 kube-proxy`), for
#     every Service's ClusterIP, the `kubernetes` Service (10.0.0.1:443) among them;
#   - CoreDNS with the kubernetes plugin, on the bridge's gateway, port 53, behind the
#     kube-dns Service (kube-system, 10.0.0.10) whose EndpointSlice names that address.
node_services() { # node-ip
  local ip="$1" pki="$E2E_DIR/pki" port
  port=$(free_port)
  echo "$port" > "$NODE_DIR/state/workload-controllers.port"
  node_start workload-controllers "$BIN/kube-controller-manager" \
    --kubeconfig "$E2E_DIR/kubeconfig" \
    --authentication-kubeconfig "$E2E_DIR/kubeconfig" \
    --authorization-kubeconfig "$E2E_DIR/kubeconfig" \
    --controllers deployment-controller,replicaset-controller,endpointslice-controller \
    --leader-elect=false --bind-address 127.0.0.1 --secure-port "$port"

  mkdir -p "$NODE_DIR/kube-proxy"
  node_kubeconfig "$NODE_DIR/kube-proxy/kubeconfig" system:kube-proxy kube-proxy
  local healthz metrics
  healthz=$(free_port); metrics=$(free_port)
  echo "$healthz" > "$NODE_DIR/state/kube-proxy.healthz"
  cat > "$NODE_DIR/kube-proxy/config.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {kubeconfig: "$NODE_DIR/kube-proxy/kubeconfig"}
hostnameOverride: "$NODE_NAME"
bindAddress: "$ip"
# The CNI bridge's Pod range: traffic from outside it to a ClusterIP is masqueraded.
clusterCIDR: "$NODE_SUBNET"
healthzBindAddress: "127.0.0.1:$healthz"
metricsBindAddress: "127.0.0.1:$metrics"
# Leave the machine's conntrack table size and timeouts as they are.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
YAML
  node_start kube-proxy "$BIN/kube-proxy" --config "$NODE_DIR/kube-proxy/config.yaml"

  mkdir -p "$NODE_DIR/coredns"
  node_kubeconfig "$NODE_DIR/coredns/kubeconfig" "$COREDNS_USER" coredns
  local health ready
  health=$(free_port); ready=$(free_port)
  echo "$ready" > "$NODE_DIR/state/coredns.ready"
  # The upstream of names outside the cluster: this machine's resolvers.
  cat > "$NODE_DIR/coredns/Corefile" <<COREFILE
.:53 {
    bind $NODE_GATEWAY
    errors
    health 127.0.0.1:$health
    ready 127.0.0.1:$ready
    kubernetes $CLUSTER_DOMAIN in-addr.arpa ip6.arpa {
        kubeconfig $NODE_DIR/coredns/kubeconfig agentrun-e2e
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }
    forward . /etc/resolv.conf
    cache 5
}
COREFILE
  node_kubectl apply -f - >/dev/null <<YAML
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "$COREDNS_USER"}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "$COREDNS_USER"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "$COREDNS_USER"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "$COREDNS_USER"}
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/name: CoreDNS}
spec:
  clusterIP: "$CLUSTER_DNS_IP"
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: 53}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: 53}
---
# No selector: CoreDNS is a process on this machine, listening on the bridge's gateway.
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-node
  namespace: kube-system
  labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: agentrun.dev-e2e-cluster}
addressType: IPv4
endpoints:
- addresses: ["$NODE_GATEWAY"]
  conditions: {ready: true}
  nodeName: "$NODE_NAME"
ports:
- {name: dns, port: 53, protocol: UDP}
- {name: dns-tcp, port: 53, protocol: TCP}
YAML
  node_start coredns "$COREDNS_BIN/coredns" -conf "$NODE_DIR/coredns/Corefile"
}
