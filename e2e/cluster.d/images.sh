# shellcheck shell=bash
# Sourced by e2e/cluster: the images the node runs (pause, refund-agent, node-probe), built
# as OCI tarballs from Debian packages and the repo's sources (e2e/cluster images), and
# imported into the node's containerd (e2e/cluster node images|import).

# Every image the node runs comes from a tarball built here and imported; nothing is pulled.
PAUSE_IMAGE="agentrun.local/pause:3.10"
NODE_IMAGES_DIR="$CACHE/node-images"
PYTHON_BASE="$CACHE/python-base-3.11"
# The Debian packages of a python3.11 runtime (interpreter, standard library and the shared
# libraries they load); no shell, no package manager.
PYTHON_DEBS=(libc6 libgcc-s1 gcc-12-base python3.11-minimal libpython3.11-minimal libpython3.11-stdlib
  zlib1g libexpat1 libssl3 libffi8 libbz2-1.0 liblzma5 libsqlite3-0 libuuid1 libncursesw6 libtinfo6
  libreadline8 readline-common libcrypt1 libnsl2 libtirpc3 libtirpc-common libgssapi-krb5-2 libkrb5-3
  libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libdb5.3 libgdbm6 libzstd1 media-types)

python_rootfs() {
  [[ -x "$PYTHON_BASE/rootfs/usr/bin/python3" ]] && return 0
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
    || die "the Python base image is built from Debian packages: apt-get and dpkg-deb are required"
  log "building the Python base from Debian packages into $PYTHON_BASE"
  local tmp="$PYTHON_BASE.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp/debs" "$tmp/rootfs"
  if ! (cd "$tmp/debs" && apt-get download -qq "${PYTHON_DEBS[@]}" >/dev/null 2>&1); then
    apt-get update -qq
    (cd "$tmp/debs" && apt-get download -qq "${PYTHON_DEBS[@]}") || { rm -rf "$tmp"; die "apt-get download failed"; }
  fi
  local deb
  for deb in "$tmp"/debs/*.deb; do dpkg-deb -x "$deb" "$tmp/rootfs"; done
  ln -sf python3.11 "$tmp/rootfs/usr/bin/python3"
  rm -rf "$tmp"/rootfs/usr/share/{doc,man,info,lintian,locale} "$tmp/debs"
  rm -rf "$PYTHON_BASE"; mv "$tmp" "$PYTHON_BASE"
}

# The official openai package and its dependencies for the refund-agent image: the wheels
# pinned in sdk/python/requirements-openai.txt, for CPython 3.11 on linux x86_64 (the image's
# Python and architecture), downloaded from PyPI once and installed into a directory named
# after the pins; no interpreter of the image is needed for it.
PYTHON_REQS="$ROOT/sdk/python/requirements-openai.txt"
PIP_PLATFORM=(--only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.11
  --implementation cp --abi cp311)
python_openai() {
  PYTHON_OPENAI="$CACHE/python-openai-$(sha256sum "$PYTHON_REQS" | cut -c1-12)"
  [[ -f "$PYTHON_OPENAI/.complete" ]] && return 0
  python3 -m pip --version >/dev/null 2>&1 || die "the refund-agent image's openai package is installed with pip: python3 -m pip is required"
  log "downloading the pinned openai wheels (CPython 3.11, linux x86_64) into $PYTHON_OPENAI"
  local tmp="$PYTHON_OPENAI.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  # --no-deps: the file pins the whole closure, so nothing unpinned is resolved.
  PIP_ROOT_USER_ACTION=ignore python3 -m pip download -q --disable-pip-version-check --no-deps "${PIP_PLATFORM[@]}" \
    -d "$tmp/wheels" -r "$PYTHON_REQS" || { rm -rf "$tmp"; die "pip download of the openai wheels failed"; }
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps --no-index --no-compile \
    "${PIP_PLATFORM[@]}" --target "$tmp/site" "$tmp"/wheels/*.whl \
    || { rm -rf "$tmp"; die "installing the openai wheels failed"; }
  # Console scripts (openai, httpx) are not part of the library.
  rm -rf "$tmp/site/bin" "$tmp/wheels"
  touch "$tmp/.complete"
  rm -rf "$PYTHON_OPENAI"; mv "$tmp" "$PYTHON_OPENAI"
}

# The step images (refund-agent, node-probe) as OCI tarballs in NODE_IMAGES_DIR, from the
# repo's sources on every call (seconds). Needs no containerd: e2e/kind/run.sh loads the
# same tarballs into kind (`e2e/cluster images`).
step_images() {
  python_rootfs
  python_openai
  mkdir -p "$NODE_IMAGES_DIR"
  local py=(python3 "$ROOT/e2e/node/images/ociimage.py")
  local packages=/usr/local/lib/python3.11/dist-packages
  local sdk="$ROOT/sdk/python/agentrun_step" site="$packages/agentrun_step"
  "${py[@]}" python "$NODE_IMAGES_DIR/refund-agent.tar" --name "$REFUND_AGENT_IMAGE" \
    --rootfs "$PYTHON_BASE/rootfs" --add "$PYTHON_OPENAI/site=$packages" --add "$sdk=$site" \
    --add "$ROOT/examples/refund-agent/refund_agent.py=/app/refund_agent.py" \
    --add "$ROOT/examples/refund-agent/payments.py=/app/payments.py" \
    --add "$ROOT/examples/mock-model/server.py=/app/mock_model.py" \
    --workdir /app -- python3 /app/refund_agent.py
  "${py[@]}" python "$NODE_IMAGES_DIR/node-probe.tar" --name "$NODE_PROBE_IMAGE" \
    --rootfs "$PYTHON_BASE/rootfs" --add "$sdk=$site" \
    --add "$ROOT/e2e/node/images/probe.py=/app/probe.py" \
    --workdir /app -- python3 /app/probe.py
}

# The pause image and the step images, imported into the node's containerd when it runs.
node_images() {
  if [[ ! -x "$CTRD_BIN/pause" ]]; then
    command -v go >/dev/null || die "go is required to build the pause command"
    go_room
    mkdir -p "$CTRD_BIN"
    (cd "$ROOT/e2e/node" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$CTRD_BIN/pause" ./pause) \
      || die "pause build failed"
  fi
  mkdir -p "$NODE_IMAGES_DIR"
  python3 "$ROOT/e2e/node/images/ociimage.py" pause "$NODE_IMAGES_DIR/pause.tar" \
    --name "$PAUSE_IMAGE" --binary "$CTRD_BIN/pause"
  step_images
  local sock="$NODE_DIR/containerd/containerd.sock" img
  if [[ -S "$sock" ]] && pid_alive "$NODE_DIR/state/containerd.pid"; then
    for img in pause refund-agent node-probe; do
      "$CTRD_BIN/ctr" --address "$sock" -n k8s.io images import "$NODE_IMAGES_DIR/$img.tar" >/dev/null \
        || die "ctr images import $img.tar failed"
    done
    log "images imported: $("$CTRD_BIN/ctr" --address "$sock" -n k8s.io images ls -q | grep '^agentrun.local/' | tr '\n' ' ')"
  fi
}

# Image tarballs built elsewhere (the operator's, `make image`), imported into the running
# node's containerd, where the kubelet finds them without a pull. `--as REF` also names the
# tarball's image REF, so that two builds with the same tag (an earlier commit's and this
# one's, for the upgrade test) can be told apart.
node_import() { # [--as REF] tarball...
  local as="" sock="$NODE_DIR/containerd/containerd.sock" tar name
  if [[ "${1:-}" == --as ]]; then as="${2:-}"; shift 2 || true; fi
  (($#)) || die "usage: e2e/cluster node import [--as REF] TARBALL..."
  [[ -S "$sock" ]] && pid_alive "$NODE_DIR/state/containerd.pid" \
    || die "no node runs at $E2E_DIR: e2e/cluster node up"
  for tar in "$@"; do
    [[ -s "$tar" ]] || die "no image tarball at $tar (make image builds the operator's)"
    "$CTRD_BIN/ctr" --address "$sock" -n k8s.io images import "$tar" >/dev/null \
      || die "ctr images import $tar failed"
    if [[ -n "$as" ]]; then
      name="$(tar -xOf "$tar" index.json | python3 -c \
        'import json, sys; print(json.load(sys.stdin)["manifests"][0]["annotations"]["io.containerd.image.name"])')"
      "$CTRD_BIN/ctr" --address "$sock" -n k8s.io images tag --force "$name" "$as" >/dev/null \
        || die "ctr images tag $name $as failed"
      log "imported $tar as $as"
    else
      log "imported $tar"
    fi
  done
}
REFUND_AGENT_IMAGE="agentrun.local/refund-agent:0.1.0"
NODE_PROBE_IMAGE="agentrun.local/node-probe:0.1.0"
