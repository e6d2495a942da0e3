# syntax=docker/dockerfile:1
#
# The operator image: static musl binaries on distroless, running as 65532:
# the operator, and kubectl-agentrun for the chart's optional read-only console.
#   docker build -t agentrun-operator:dev .
# The crate uses rustls with ring, so musl needs no OpenSSL; ring's C and
# assembly parts are built with musl-gcc.

FROM rust:1-bookworm AS builder
# BuildKit sets TARGETARCH to the platform being built (amd64 or arm64), and the
# builder runs on that platform (natively, or emulated with --platform): the
# musl target is the one of that architecture.
ARG TARGETARCH=amd64
RUN case "$TARGETARCH" in \
      amd64) echo x86_64-unknown-linux-musl ;; \
      arm64) echo aarch64-unknown-linux-musl ;; \
      *) echo "no musl target for architecture $TARGETARCH" >&2; exit 1 ;; \
    esac >/rust-target \
 && rustup target add "$(cat /rust-target)" \
 && apt-get update \
 && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/*
# musl-gcc compiles ring's C; Rust links on its own (self-contained musl), which gives
# a static-pie binary: musl-gcc as the linker gives a PIE that needs /lib/ld-musl.
ENV CC_x86_64_unknown_linux_musl=musl-gcc CC_aarch64_unknown_linux_musl=musl-gcc
WORKDIR /src
COPY . .
# The cache mounts keep the registry and target/ between builds; the binary is
# copied out of the cached target/ so the next stage can take it.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    TARGET="$(cat /rust-target)" \
 && cargo build --release --locked --target "$TARGET" -p agentrun-operator -p kubectl-agentrun \
      --bin agentrun-operator --bin kubectl-agentrun \
 && cp "target/$TARGET/release/agentrun-operator" /agentrun-operator \
 && cp "target/$TARGET/release/kubectl-agentrun" /kubectl-agentrun

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=builder /agentrun-operator /agentrun-operator
# The chart's optional read-only console (console.enabled) runs the plugin.
COPY --from=builder /kubectl-agentrun /kubectl-agentrun
USER 65532:65532
# 8080: /metrics; 8081: /healthz and /readyz.
EXPOSE 8080 8081
ENTRYPOINT ["/agentrun-operator"]
CMD ["run"]
