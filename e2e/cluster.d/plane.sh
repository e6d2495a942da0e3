# shellcheck shell=bash
# Sourced by e2e/cluster: the control plane itself (build, up, down, restart-apiserver,
# env): etcd, kube-apiserver and kube-controller-manager as local processes, their
# certificates and the kubeconfig.

build() {
  if [[ -x "$BIN/kube-apiserver" && -x "$BIN/kube-controller-manager" && -x "$BIN/etcd" ]]; then
    log "binaries present in $BIN"
    return
  fi
  command -v go >/dev/null || die "go is required to build the control plane"
  go_room
  mkdir -p "$BIN"
  local major="${K8S_VERSION#v}"; major="${major%%.*}"
  local minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
  local ldflags="-s -w"
  local pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  log "building kube-apiserver, kube-controller-manager and etcd $K8S_VERSION into $BIN (cold: many minutes)"
  local tmp="$BIN.tmp.$$"
  mkdir -p "$tmp"
  (
    cd "$ROOT/e2e/controlplane"
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/" \
      k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager \
      ./etcd
  ) || { rm -rf "$tmp"; die "control plane build failed"; }
  mv "$tmp"/* "$BIN/" && rmdir "$tmp"
  log "built: $(ls "$BIN" | tr '\n' ' ')"
}

healthy() {
  [[ -f "$E2E_DIR/kubeconfig" && -f "$E2E_DIR/state/apiserver.port" ]] || return 1
  pid_alive "$E2E_DIR/state/etcd.pid" && pid_alive "$E2E_DIR/state/kube-apiserver.pid" \
    && pid_alive "$E2E_DIR/state/kube-controller-manager.pid" || return 1
  curl -sf --max-time 5 --cacert "$E2E_DIR/pki/ca.crt" \
    --cert "$E2E_DIR/pki/admin.crt" --key "$E2E_DIR/pki/admin.key" \
    "https://127.0.0.1:$(cat "$E2E_DIR/state/apiserver.port")/readyz" >/dev/null
}

tail_logs() {
  local f
  for f in "$E2E_DIR"/logs/*.log; do
    [[ -f "$f" ]] || continue
    printf '\n===== last lines of %s =====\n' "$f" >&2
    tail -n 40 "$f" >&2
  done
}

make_pki() { # advertise-address
  local pki="$E2E_DIR/pki"
  mkdir -p "$pki"
  local ossl=(openssl)
  "${ossl[@]}" req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" -days 30 -subj "/CN=agentrun-e2e-ca" 2>/dev/null
  issue() { # name subject extfile-content
    "${ossl[@]}" req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -keyout "$pki/$1.key" -out "$pki/$1.csr" -subj "$2" 2>/dev/null
    printf '%s\n' "$3" > "$pki/$1.ext"
    "${ossl[@]}" x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
      -CAcreateserial -days 30 -extfile "$pki/$1.ext" -out "$pki/$1.crt" 2>/dev/null
    rm -f "$pki/$1.csr" "$pki/$1.ext"
  }
  # Pods reach the apiserver as the `kubernetes` Service (10.0.0.1, kubernetes.default.svc…)
  # whose endpoint is the advertised host address.
  local sans="IP:127.0.0.1,IP:$SERVICE_KUBERNETES_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default"
  sans+=",DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.$CLUSTER_DOMAIN"
  [[ "$1" == 127.0.0.1 ]] || sans+=",IP:$1"
  issue apiserver "/CN=kube-apiserver" \
    "subjectAltName=$sans
extendedKeyUsage=serverAuth
keyUsage=digitalSignature,keyEncipherment"
  issue admin "/O=system:masters/CN=agentrun-e2e-admin" \
    "extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
  "${ossl[@]}" genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key" 2>/dev/null
  "${ossl[@]}" pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  make_node_apiserver_pki   # for a node joined later (e2e/cluster node up)
}

write_kubeconfig() { # path port
  cat > "$1" <<KC
apiVersion: v1
kind: Config
clusters:
- name: agentrun-e2e
  cluster:
    server: https://127.0.0.1:$2
    certificate-authority: $E2E_DIR/pki/ca.crt
users:
- name: agentrun-e2e-admin
  user:
    client-certificate: $E2E_DIR/pki/admin.crt
    client-key: $E2E_DIR/pki/admin.key
contexts:
- name: agentrun-e2e
  context:
    cluster: agentrun-e2e
    user: agentrun-e2e-admin
    namespace: default
current-context: agentrun-e2e
KC
}

start() { # name args...
  local name="$1"; shift
  # setsid: the plane outlives the shell that started it (make cluster-up, then tests).
  setsid nohup "$@" >"$E2E_DIR/logs/$name.log" 2>&1 </dev/null &
  echo $! > "$E2E_DIR/state/$name.pid"
}

wait_for() { # description seconds command...
  local what="$1" secs="$2"; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
      log "timed out after ${secs}s waiting for $what"
      tail_logs
      down_quiet
      die "control plane did not start"
    fi
    sleep 0.2
  done
}

# The address the apiserver advertises: the `kubernetes` Service's endpoint, which Pods
# on the node reach through kube-proxy. It must not be loopback, so the apiserver listens
# on every interface; every other client keeps using 127.0.0.1. A machine without a global
# IPv4 address gets the old loopback-only plane, with no endpoint for that Service.
apiserver_flags_for() { # advertise-address
  if [[ "$1" == 127.0.0.1 ]]; then
    printf '%s\n' --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --endpoint-reconciler-type none
  else
    printf '%s\n' --bind-address 0.0.0.0 --advertise-address "$1"
  fi
}

start_apiserver() { # from the ports and address recorded in state/
  local pki="$E2E_DIR/pki" api_port etcd_port advertise
  api_port="$(cat "$E2E_DIR/state/apiserver.port")"
  etcd_port="$(cat "$E2E_DIR/state/etcd.port")"
  advertise="$(cat "$E2E_DIR/state/apiserver.advertise" 2>/dev/null || echo 127.0.0.1)"
  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    $(apiserver_flags_for "$advertise") --secure-port "$api_port" \
    --cert-dir "$E2E_DIR/state" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --authorization-mode RBAC \
    --service-account-issuer "https://127.0.0.1:$api_port" \
    --service-account-key-file "$pki/sa.pub" \
    --service-account-signing-key-file "$pki/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --disable-admission-plugins ServiceAccount \
    --enable-admission-plugins PodNodeSelector,PodTolerationRestriction \
    --allow-privileged=true \
    $(node_apiserver_flags)
}

wait_apiserver_ready() { # seconds
  local pki="$E2E_DIR/pki"
  wait_for "kube-apiserver /readyz" "$1" curl -sf --max-time 2 --cacert "$pki/ca.crt" \
    --cert "$pki/admin.crt" --key "$pki/admin.key" \
    "https://127.0.0.1:$(cat "$E2E_DIR/state/apiserver.port")/readyz"
}

restart_apiserver() {
  healthy || die "no healthy control plane at $E2E_DIR to restart kube-apiserver of"
  [[ -f "$E2E_DIR/state/etcd.port" ]] || die "$E2E_DIR/state/etcd.port is missing: the plane predates restart-apiserver; run down, then up"
  local started=$SECONDS
  stop_pid "$E2E_DIR/state/kube-apiserver.pid"
  # Keep the log of the run that was stopped.
  mv "$E2E_DIR/logs/kube-apiserver.log" "$E2E_DIR/logs/kube-apiserver.$(date +%s).log" 2>/dev/null || true
  start_apiserver
  # No down_quiet on failure here: the plane's other processes are not ours to stop.
  local deadline=$((SECONDS + 120))
  local pki="$E2E_DIR/pki"
  until curl -sf --max-time 2 --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
      "https://127.0.0.1:$(cat "$E2E_DIR/state/apiserver.port")/readyz" >/dev/null 2>&1; do
    (( SECONDS < deadline )) || { tail -n 40 "$E2E_DIR/logs/kube-apiserver.log" >&2; die "kube-apiserver did not come back"; }
    sleep 0.2
  done
  log "kube-apiserver restarted in $((SECONDS - started))s"
}

up() {
  if healthy; then
    if [[ -f "$E2E_DIR/state/apiserver.advertise" ]]; then
      log "reusing the healthy control plane at $E2E_DIR/kubeconfig"
      return
    fi
    log "the plane at $E2E_DIR predates the advertised apiserver address (the kubernetes Service's endpoint): starting a new one"
  fi
  build
  tools
  down_quiet
  rm -rf "$E2E_DIR/etcd" "$E2E_DIR/pki" "$E2E_DIR/state" "$E2E_DIR/logs"
  mkdir -p "$E2E_DIR/etcd" "$E2E_DIR/state" "$E2E_DIR/logs"
  local started=$SECONDS advertise
  advertise="$(node_ip)"; advertise="${advertise:-127.0.0.1}"
  echo "$advertise" > "$E2E_DIR/state/apiserver.advertise"
  make_pki "$advertise"
  local etcd_port peer_port api_port kcm_port
  etcd_port=$(free_port); peer_port=$(free_port); api_port=$(free_port); kcm_port=$(free_port)
  echo "$api_port" > "$E2E_DIR/state/apiserver.port"
  echo "$etcd_port" > "$E2E_DIR/state/etcd.port"

  start etcd "$BIN/etcd" --data-dir "$E2E_DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$peer_port"
  wait_for "etcd" 30 curl -sf "http://127.0.0.1:$etcd_port/health"

  start_apiserver
  write_kubeconfig "$E2E_DIR/kubeconfig" "$api_port"
  wait_apiserver_ready 120
  local pki="$E2E_DIR/pki"

  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$E2E_DIR/kubeconfig" \
    --authentication-kubeconfig "$E2E_DIR/kubeconfig" \
    --authorization-kubeconfig "$E2E_DIR/kubeconfig" \
    --controllers garbage-collector-controller,namespace-controller,serviceaccount-controller,root-ca-certificate-publisher-controller,ttl-after-finished-controller \
    --leader-elect=false \
    --root-ca-file "$pki/ca.crt" \
    --bind-address 127.0.0.1 --secure-port "$kcm_port" \
    ${AGENTRUN_KCM_ARGS:-}
  wait_for "kube-controller-manager /healthz" 60 curl -sfk --max-time 2 "https://127.0.0.1:$kcm_port/healthz"
  wait_for "the default namespace" 60 "$TOOLS/kubectl" --kubeconfig "$E2E_DIR/kubeconfig" get namespace default
  log "control plane $K8S_VERSION up in $((SECONDS - started))s: export KUBECONFIG=$E2E_DIR/kubeconfig"
}

down_quiet() {
  local name
  node_down_quiet   # a node joined to this plane goes first
  for name in kube-controller-manager kube-apiserver etcd; do
    stop_pid "$E2E_DIR/state/$name.pid"
  done
}

down() {
  down_quiet
  log "control plane stopped (logs kept in $E2E_DIR/logs)"
}

env_cmd() {
  echo "export KUBECONFIG=$E2E_DIR/kubeconfig"
  echo "export PATH=$TOOLS:\$PATH"
  echo "export AGENTRUN_PROMTOOL=$CACHE/prometheus-$PROMETHEUS_VERSION/promtool"
  echo "export AGENTRUN_JAEGER=$CACHE/jaeger-$JAEGER_VERSION/jaeger"
  echo "export AGENTRUN_ARGO_DIR=$CACHE/argo-$ARGO_VERSION"
  if pg_healthy; then pg_env; fi
}
