# shellcheck shell=bash disable=SC2034 # node-up.sh and images.sh read the node's settings
# Sourced by e2e/cluster: the optional real node (e2e/cluster node ...): its settings,
# build, certificates, process helpers, health, and how it is stopped and cleaned up.
# Starting it is in node-up.sh, its images in images.sh.

# ---------------------------------------------------------------------------
# The local node (e2e/cluster node build|images|up|down|status): a real kubelet,
# kube-scheduler, containerd 2.x with runc, and CNI bridge networking on a
# private bridge, joined to the plane `up` started. Optional: `up` alone starts
# no node and no scheduler. Needs root (mounts, cgroups, iptables, netns).
# ---------------------------------------------------------------------------
CONTAINERD_VERSION="v2.4.2"
CTRD_BIN="$CACHE/containerd-$CONTAINERD_VERSION"
COREDNS_VERSION="v1.15.0" # github.com/coredns/coredns (its go.mod asks for Go 1.26)
COREDNS_BIN="$CACHE/coredns-$COREDNS_VERSION"
CLUSTER_DNS_IP="10.0.0.10" # the kube-dns Service, in --service-cluster-ip-range
NODE_DIR="$E2E_DIR/node"
NODE_NAME="agentrun-node"
NODE_TAINT="agentrun.dev/node"
NODE_BRIDGE="agentrun0"
NODE_SUBNET="10.213.0.0/24"
NODE_GATEWAY="10.213.0.1"
CNI_BIN_DIR="${AGENTRUN_CNI_BIN_DIR:-/usr/lib/cni}"

k8s_ldflags() { # the version stamp of a Kubernetes command built from the module
  local major="${K8S_VERSION#v}"; major="${major%%.*}"
  local minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
  local ldflags="-s -w" pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  printf '%s' "$ldflags"
}

node_build() {
  local ldflags
  if [[ ! -x "$BIN/kubelet" || ! -x "$BIN/kube-scheduler" ]]; then
    command -v go >/dev/null || die "go is required to build the node"
    go_room
    ldflags="$(k8s_ldflags)"
    log "building kubelet and kube-scheduler $K8S_VERSION into $BIN"
    local started=$SECONDS tmp="$BIN.node.tmp.$$"
    mkdir -p "$tmp"
    (
      cd "$ROOT/e2e/controlplane"
      CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/" \
        k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler
    ) || { rm -rf "$tmp"; die "kubelet/kube-scheduler build failed"; }
    mkdir -p "$BIN" && mv "$tmp"/* "$BIN/" && rmdir "$tmp"
    log "built kubelet and kube-scheduler in $((SECONDS - started))s"
  fi
  # kube-proxy from the same module, alone: a cache that has the kubelet keeps it.
  if [[ ! -x "$BIN/kube-proxy" ]]; then
    command -v go >/dev/null || die "go is required to build kube-proxy"
    go_room
    log "building kube-proxy $K8S_VERSION into $BIN"
    local started=$SECONDS tmp="$BIN.proxy.tmp.$$"
    mkdir -p "$tmp"
    (
      cd "$ROOT/e2e/controlplane"
      CGO_ENABLED=0 go build -trimpath -ldflags "$(k8s_ldflags)" -o "$tmp/" k8s.io/kubernetes/cmd/kube-proxy
    ) || { rm -rf "$tmp"; die "kube-proxy build failed"; }
    mkdir -p "$BIN" && mv "$tmp"/* "$BIN/" && rmdir "$tmp"
    log "built kube-proxy in $((SECONDS - started))s"
  fi
  # CoreDNS as released: its module has no replace directive, so `go install module@version`
  # builds the same binary (every in-tree plugin) as CoreDNS's own release.
  if [[ ! -x "$COREDNS_BIN/coredns" ]]; then
    command -v go >/dev/null || die "go is required to build CoreDNS"
    go_room
    log "building CoreDNS $COREDNS_VERSION into $COREDNS_BIN"
    local started=$SECONDS tmp="$COREDNS_BIN.tmp.$$"
    mkdir -p "$tmp"
    CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN="$tmp" go install -trimpath -ldflags "-s -w" \
      "github.com/coredns/coredns@$COREDNS_VERSION" \
      || { rm -rf "$tmp"; die "CoreDNS $COREDNS_VERSION build failed (see the go output above)"; }
    mkdir -p "$COREDNS_BIN" && mv "$tmp/coredns" "$COREDNS_BIN/" && rmdir "$tmp"
    log "built CoreDNS in $((SECONDS - started))s"
  fi
  if [[ ! -x "$CTRD_BIN/containerd" || ! -x "$CTRD_BIN/containerd-shim-runc-v2" \
        || ! -x "$CTRD_BIN/ctr" || ! -x "$CTRD_BIN/pause" ]]; then
    command -v go >/dev/null || die "go is required to build containerd"
    go_room
    ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
    ldflags+=" -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2"
    log "building containerd $CONTAINERD_VERSION (containerd, containerd-shim-runc-v2, ctr) and pause into $CTRD_BIN"
    local started=$SECONDS tmp="$CTRD_BIN.tmp.$$"
    mkdir -p "$tmp"
    (
      cd "$ROOT/e2e/node"
      CGO_ENABLED=0 go build -trimpath -tags "no_btrfs no_devmapper no_zfs" -ldflags "$ldflags" -o "$tmp/" \
        github.com/containerd/containerd/v2/cmd/containerd \
        github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
        github.com/containerd/containerd/v2/cmd/ctr \
        ./pause
    ) || { rm -rf "$tmp"; die "containerd build failed"; }
    mkdir -p "$CTRD_BIN" && mv "$tmp"/* "$CTRD_BIN/" && rmdir "$tmp"
    log "built containerd in $((SECONDS - started))s"
  fi
}

node_pki() { # the kubelet's client and serving certificates, and the apiserver's kubelet client
  local pki="$E2E_DIR/pki" ip="$1"
  node_issue() { # name subject ext
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -keyout "$pki/$1.key" -out "$pki/$1.csr" -subj "$2" 2>/dev/null
    printf '%s\n' "$3" > "$pki/$1.ext"
    openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
      -CAcreateserial -days 30 -extfile "$pki/$1.ext" -out "$pki/$1.crt" 2>/dev/null
    rm -f "$pki/$1.csr" "$pki/$1.ext"
  }
  node_issue kubelet-client "/O=system:nodes/CN=system:node:$NODE_NAME" \
    "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  node_issue kubelet-serving "/CN=$NODE_NAME" \
    "subjectAltName=IP:$ip,DNS:$NODE_NAME
extendedKeyUsage=serverAuth
keyUsage=digitalSignature,keyEncipherment"
  # kube-proxy as the user the built-in ClusterRoleBinding system:node-proxier names.
  node_issue kube-proxy "/CN=system:kube-proxy" \
    "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  node_issue coredns "/CN=$COREDNS_USER" \
    "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
}
COREDNS_USER="agentrun-e2e:coredns"

node_kubeconfig() { # path user cert-name: a kubeconfig of a node process for the plane
  local pki="$E2E_DIR/pki"
  cat > "$1" <<KC
apiVersion: v1
kind: Config
clusters:
- name: agentrun-e2e
  cluster: {server: "https://127.0.0.1:$(cat "$E2E_DIR/state/apiserver.port")", certificate-authority: "$pki/ca.crt"}
users:
- name: $2
  user: {client-certificate: "$pki/$3.crt", client-key: "$pki/$3.key"}
contexts:
- name: agentrun-e2e
  context: {cluster: agentrun-e2e, user: $2}
current-context: agentrun-e2e
KC
}

# Flags the apiserver needs to reach a kubelet (kubectl logs/exec): its client certificate,
# made with the plane's PKI, and the node's InternalIP before its (unresolvable) name.
node_apiserver_flags() {
  local pki="$E2E_DIR/pki"
  [[ -f "$pki/apiserver-kubelet-client.crt" ]] || return 0
  printf '%s\n' --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP,Hostname
}

make_node_apiserver_pki() {
  local pki="$E2E_DIR/pki"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$pki/apiserver-kubelet-client.key" -out "$pki/apiserver-kubelet-client.csr" \
    -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n' > "$pki/apiserver-kubelet-client.ext"
  openssl x509 -req -in "$pki/apiserver-kubelet-client.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 30 -extfile "$pki/apiserver-kubelet-client.ext" \
    -out "$pki/apiserver-kubelet-client.crt" 2>/dev/null
  rm -f "$pki/apiserver-kubelet-client.csr" "$pki/apiserver-kubelet-client.ext"
}

node_ip() { # the first global IPv4 address: the kubelet refuses loopback as a node IP
  ip -4 -o addr show scope global | awk '{split($4, a, "/"); print a[1]; exit}'
}

node_kubectl() { "$TOOLS/kubectl" --kubeconfig "$E2E_DIR/kubeconfig" "$@"; }

# Start a node process that writes no pidfile of its own: `exec` in the child makes the
# recorded PID the program's (setsid nohup ... & echo $! can record a wrapper's).
node_start() { # name args...
  local name="$1"; shift
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$NODE_DIR/state/$name.pid" "$@" \
    >"$E2E_DIR/logs/$name.log" 2>&1 </dev/null &
  local i
  for i in $(seq 1 50); do [[ -s "$NODE_DIR/state/$name.pid" ]] && return 0; sleep 0.1; done
  die "$name did not start"
}

node_wait() { # what seconds command...
  local what="$1" secs="$2"; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
      log "timed out after ${secs}s waiting for $what"
      local f
      for f in "${NODE_PROCESSES[@]}"; do
        [[ -f "$E2E_DIR/logs/$f.log" ]] && { printf '\n===== last lines of %s.log =====\n' "$f" >&2; tail -n 30 "$E2E_DIR/logs/$f.log" >&2; }
      done
      node_down
      die "the node did not start"
    fi
    sleep 0.5
  done
}

node_preflight() {
  [[ $EUID -eq 0 ]] || die "the node needs root (mounts, cgroups, network namespaces, iptables)"
  local missing=()
  command -v runc >/dev/null || missing+=(runc)
  command -v iptables >/dev/null || missing+=(iptables)
  command -v nft >/dev/null || missing+=(nftables)   # kube-proxy's nftables mode runs nft
  [[ -x "$CNI_BIN_DIR/bridge" && -x "$CNI_BIN_DIR/host-local" && -x "$CNI_BIN_DIR/loopback" ]] \
    || missing+=(containernetworking-plugins)
  if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "the node needs: ${missing[*]}"
    log "installing ${missing[*]} (Debian packages)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  grep -qw overlay /proc/filesystems || die "the node needs the overlay filesystem (modprobe overlay)"
}

NODE_PROCESSES=(containerd kube-scheduler workload-controllers kube-proxy coredns kubelet)

node_healthy() { # every node process alive, and a node heartbeat in the last 40s
  local name
  for name in "${NODE_PROCESSES[@]}"; do pid_alive "$NODE_DIR/state/$name.pid" || return 1; done
  node_heartbeat_fresh
}

# There is no node-lifecycle controller on this plane, so the Ready condition is never
# turned to Unknown for a dead kubelet: readiness is the kubelet's Lease renewal.
node_heartbeat_fresh() {
  local renew
  renew="$(node_kubectl -n kube-node-lease get lease "$NODE_NAME" -o jsonpath='{.spec.renewTime}' 2>/dev/null)" || return 1
  [[ -n "$renew" ]] || return 1
  python3 - "$renew" <<'PY'
import sys, datetime
t = datetime.datetime.strptime(sys.argv[1][:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
age = (datetime.datetime.now(datetime.timezone.utc) - t).total_seconds()
sys.exit(0 if age < 40 else 1)
PY
}

node_ready() {
  node_heartbeat_fresh || return 1
  [[ "$(node_kubectl get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

# One node per machine: the bridge, the kubepods cgroups, /run/containerd, kube-proxy's
# nftables tables and CoreDNS's address are global. The config file of a node's containerd
# that runs from another e2e directory, if any.
node_elsewhere() {
  local f cmdline
  for f in /proc/[0-9]*/cmdline; do
    cmdline="$(tr '\0' ' ' 2>/dev/null < "$f")" || continue
    if [[ "$cmdline" == "$CTRD_BIN/containerd --config "*/node/containerd/config.toml* \
          && "$cmdline" != *" $NODE_DIR/containerd/config.toml"* ]]; then
      cmdline="${cmdline#* --config }"; echo "${cmdline%% *}"; return 0
    fi
  done
  return 1
}

node_cleanup_iptables() { # chains the kubelet may have made (KUBE-*), and the jumps to them
  local cmd table rule chain
  for cmd in iptables ip6tables; do
    command -v "$cmd" >/dev/null || continue
    for table in filter nat mangle; do
      "$cmd" -t "$table" -S 2>/dev/null | grep -E '^-A [A-Z]+ .*-j KUBE-(FIREWALL|KUBELET-CANARY|MARK-DROP|MARK-MASQ|POSTROUTING)' \
        | while read -r rule; do eval "$cmd -t $table ${rule/-A/-D}" 2>/dev/null || true; done || true
      for chain in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-MARK-DROP KUBE-MARK-MASQ KUBE-POSTROUTING; do
        "$cmd" -t "$table" -F "$chain" 2>/dev/null || true
        "$cmd" -t "$table" -X "$chain" 2>/dev/null || true
      done
    done
  done
}

node_cleanup_cgroups() { # the kubelet's kubepods hierarchy, leaves first
  local ctl d
  for ctl in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
    [[ -d "${ctl}kubepods" ]] || continue
    find "${ctl}kubepods" -depth -type d 2>/dev/null | while read -r d; do rmdir "$d" 2>/dev/null || true; done
  done
}

node_down_quiet() {
  [[ -d "$NODE_DIR/state" ]] || return 0
  local sock="$NODE_DIR/containerd/containerd.sock" ctr=("$CTRD_BIN/ctr" --address "$NODE_DIR/containerd/containerd.sock" -n k8s.io)
  stop_pid "$NODE_DIR/state/kubelet.pid"
  stop_pid "$NODE_DIR/state/kube-scheduler.pid"
  stop_pid "$NODE_DIR/state/workload-controllers.pid"
  stop_pid "$NODE_DIR/state/coredns.pid"
  stop_pid "$NODE_DIR/state/kube-proxy.pid"
  # kube-proxy's rules live in tables of its own; the Service's slice names a stopped CoreDNS.
  nft delete table ip kube-proxy 2>/dev/null || true
  nft delete table ip6 kube-proxy 2>/dev/null || true
  node_kubectl -n kube-system delete endpointslice kube-dns-node --ignore-not-found --wait=false --request-timeout=10s >/dev/null 2>&1 || true
  # The containers the kubelet left: kill and delete them so their shims exit.
  if [[ -S "$sock" ]] && pid_alive "$NODE_DIR/state/containerd.pid"; then
    local id
    for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
      "${ctr[@]}" tasks kill -a -s SIGKILL "$id" >/dev/null 2>&1 || true
    done
    sleep 1
    for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
      "${ctr[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true
    done
    for id in $("${ctr[@]}" containers ls -q 2>/dev/null); do
      "${ctr[@]}" containers delete "$id" >/dev/null 2>&1 || true
    done
  fi
  stop_pid "$NODE_DIR/state/containerd.pid"
  # Shims still serving this containerd (a container that would not die): by their -address.
  local pid
  local cmdline f
  for f in /proc/[0-9]*/cmdline; do
    cmdline="$(tr '\0' ' ' 2>/dev/null < "$f")" || continue
    if [[ "$cmdline" == *containerd-shim-runc-v2*"-address $sock "* ]]; then
      pid="${f#/proc/}"; pid="${pid%/cmdline}"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  # Mounts under the node's directory (volumes, rootfs overlays, shm, network namespaces), deepest first.
  local m
  for m in $(awk -v d="$NODE_DIR/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
  # CNI's own cache for this network (results name the netns; those are gone with the mounts).
  rm -f /var/lib/cni/results/agentrun-* 2>/dev/null || true
  # Directories our containerd and CNI made outside NODE_DIR, if nothing else uses them.
  rmdir /run/containerd/runc/k8s.io /run/containerd/runc /run/containerd/s /run/containerd \
    /var/lib/cni/results /var/lib/cni 2>/dev/null || true
  ip link del "$NODE_BRIDGE" 2>/dev/null || true
  if [[ -f "$NODE_DIR/state/ip_forward.before" ]]; then
    cat "$NODE_DIR/state/ip_forward.before" > /proc/sys/net/ipv4/ip_forward 2>/dev/null || true
  fi
  node_cleanup_iptables
  node_cleanup_cgroups
  node_kubectl delete node "$NODE_NAME" --ignore-not-found --wait=false --request-timeout=10s >/dev/null 2>&1 || true
  rm -rf "$NODE_DIR/state"
}

node_down() {
  node_down_quiet
  log "node stopped (logs kept in $E2E_DIR/logs)"
}

node_status() {
  if node_healthy; then
    echo "node $NODE_NAME: up ($(cat "$NODE_DIR/state/node-ip"))"
  else
    echo "node $NODE_NAME: not running (e2e/cluster node up)"; return 1
  fi
}
