# agentrun-operator — every entry point a developer or CI needs.
#
#   make demo          the product on the local control plane, as a person sees it
#   make test          everything CI runs: lint, CRD drift, unit tests, and the
#                      integration tests on a real local control plane (with promtool,
#                      lua and Jaeger for the alert, GitOps and trace tests, and a
#                      throwaway PostgreSQL for the history store tests); the operator
#                      image (make image) for the install in the cluster on the real node
#   make test-upgrade  the chart and image of an earlier commit (UPGRADE_FROM) on the real
#                      node, runs in flight, then the upgrade to this checkout's
#   make cluster-up    build (if needed) and start the local control plane
#   make cluster-down  stop it (and the node, if one is up)
#   make node-up       the plane plus a real node (kubelet, containerd, runc; root)
#   make node-down     stop the node only
#   make sdk-test      the Python step SDK's tests (the Rust SDK's run with `unit`)
#   make crds          regenerate crds/ from the Rust types
#   make policies      regenerate config/policies from the chart
#   make plugin        install kubectl-agentrun into $(PREFIX)/bin (default ~/.local/bin)
#   make image         the operator image as an OCI tarball in dist/ (static musl binaries,
#                      no container engine; `ctr images import` or `kind load image-archive`)
#   make release       dist/: binaries, image, chart, CRDs, krew manifest, SBOM, changelog,
#                      SHA256SUMS (docs/install.md, "Verifying a release")
#   make release-check make release twice from two clean checkouts of HEAD, each with an
#                      empty target directory; the SHA256SUMS must match
#   make observability the alert, dashboard and GitOps health checks (promtool, lua;
#                      no control plane)
#   make chaos         the long chaos suite on its own control plane (target/e2e-chaos)
#   make bench         the engine micro-benchmark, then the cluster benchmark on its own
#                      control plane (target/e2e-bench); BENCH_ARGS passes flags to it,
#                      e.g. make bench BENCH_ARGS='--concurrency 1,50 --repeats 1'
#   make bench-fanout  runs of 50 steps as a sequence, then as a fan-out: steps/s of
#                      each on a plane of its own (target/e2e-fanout)
#   make bench-journal the step journal through the Python SDK as a step Pod writes it:
#                      append latency and kube-apiserver CPU against status writes,
#                      replay, bytes per loop, on a plane of its own (target/e2e-journal)
#   make bench-peers   AgentRuns against chains of Jobs (kube-controller-manager with its
#                      default client QPS, then raised) and Argo Workflows (its
#                      workflow-controller, built by `e2e/cluster argo`: defaults, raised
#                      QPS, then a 1 s requeue too) on a plane of their own (target/e2e-peers);
#                      PEERS_ARGS passes flags to every driver run

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo
export AGENTRUN_E2E_DIR ?= $(CURDIR)/target/e2e
CLUSTER := e2e/cluster

.PHONY: demo demo-stop test observability lint layers check-crds crds unit integration cluster-build cluster-up cluster-down tools bench bench-peers build

build:
	$(CARGO) build --workspace --all-targets --locked

lint: layers
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

# The layers the crates hold: the engine reaches no client, runtime or store,
# and the resources no client; a dependency that would break that fails here.
layers:
	@for c in agentrun-api agentrun-engine; do \
	  tree=$$($(CARGO) tree --locked -p $$c -e normal --prefix none) || exit 1; \
	  bad=$$(echo "$$tree" | grep -E '^(tokio|kube-runtime|kube-client|hyper|reqwest|tokio-postgres) ' | sort -u || true); \
	  if [ -n "$$bad" ]; then echo "$$c depends on $$bad"; exit 1; fi; \
	done; echo "layers: agentrun-api and agentrun-engine depend on no client, runtime or store"

# The chart and the kustomize base carry copies (both need the file inside their tree).
CRD_COPIES := charts/agentrun-operator/crds/agentrun.dev_crds.yaml config/crd/agentrun.dev_crds.yaml

crds:
	$(CARGO) run --quiet --locked -- crd > crds/agentrun.dev_crds.yaml.tmp
	mv crds/agentrun.dev_crds.yaml.tmp crds/agentrun.dev_crds.yaml
	for f in $(CRD_COPIES); do cp crds/agentrun.dev_crds.yaml $$f; done

# The kubectl plugin (docs/cli.md): `kubectl agentrun …` once the binary is on PATH.
PREFIX ?= $(HOME)/.local
.PHONY: plugin
plugin:
	$(CARGO) install --locked --path plugin --root $(PREFIX)
	@echo "installed $(PREFIX)/bin/kubectl-agentrun; try: kubectl agentrun list"

# The operator image and the release (release/build says what each file is).
.PHONY: image release release-check
image:
	release/build image

release:
	release/build

# Two builds of HEAD, each from a clean checkout at a path of its own and an empty
# target directory of its own, must give the same bytes.
RC := $(CURDIR)/target/release-check
release-check:
	rm -rf $(RC); git worktree prune; mkdir -p $(RC)
	for x in a b; do \
	  git worktree add --quiet --detach $(RC)/src-$$x HEAD; \
	  (cd $(RC)/src-$$x && CARGO_TARGET_DIR=$(RC)/target-$$x release/build --out $(RC)/$$x); \
	  git worktree remove --force $(RC)/src-$$x; \
	done
	diff -u $(RC)/a/SHA256SUMS $(RC)/b/SHA256SUMS
	@echo "release-check: the two builds are identical"; cat $(RC)/a/SHA256SUMS

# config/policies is the chart's admission policies and roles, rendered.
.PHONY: policies
policies:
	e2e/render-policies

# The checked-in CRDs must be exactly what the types generate.
check-crds:
	@$(CARGO) run --quiet --locked -- crd | diff -u crds/agentrun.dev_crds.yaml - \
	  || { echo "crds/ is stale: run 'make crds' and commit the result" >&2; exit 1; }
	@for f in $(CRD_COPIES); do cmp -s crds/agentrun.dev_crds.yaml $$f \
	  || { echo "$$f differs from crds/: run 'make crds' and commit the result" >&2; exit 1; }; done

# --benches runs each criterion benchmark once in test mode (debug build), so a
# benchmark whose setup no longer works fails here rather than in `make bench`.
unit:
	$(CARGO) test --workspace --lib --bins --benches --locked
	$(CARGO) test --workspace --doc --locked

cluster-build:
	$(CLUSTER) build

tools:
	$(CLUSTER) tools

cluster-up:
	$(CLUSTER) up

cluster-down: demo-stop
	$(CLUSTER) down

demo:
	e2e/demo

demo-stop:
	@for p in operator simkubelet receiver; do f=$(AGENTRUN_E2E_DIR)/demo/$$p.pid; \
	  if [ -f $$f ]; then kill $$(cat $$f) 2>/dev/null || true; rm -f $$f; fi; done

observability:
	$(CLUSTER) tools
	$(CLUSTER) promtool
	$(CLUSTER) lua
	eval "$$($(CLUSTER) env)"; $(CARGO) test --locked -p agentrun-e2e --test observability

# Integration tests need the plane; `test` brings it up and always takes it down.
integration:
	eval "$$($(CLUSTER) env)"; $(CARGO) test --workspace --locked --no-fail-fast --test '*'

test: lint check-crds unit sdk-test
	$(CARGO) build --workspace --bins --locked
	release/build image
	$(CLUSTER) build
	$(CLUSTER) node build
	$(CLUSTER) tools
	$(CLUSTER) promtool
	$(CLUSTER) lua
	$(CLUSTER) jaeger
	$(CLUSTER) browser
	trap '$(CLUSTER) postgres down; $(CLUSTER) down' EXIT; $(CLUSTER) up; $(CLUSTER) postgres up; \
	  $(CLUSTER) node up; $(MAKE) --no-print-directory integration

# The cluster benchmark gets a plane of its own (separate ports and etcd) and
# always takes it down. See docs/performance.md.
BENCH_E2E_DIR ?= $(CURDIR)/target/e2e-bench
BENCH_ARGS ?=

bench:
	$(CARGO) bench --locked -p agentrun-engine --bench engine
	mkdir -p target
	$(CARGO) test --locked -p agentrun-engine --lib -- tests::d11_bounded_status::status_of_a_500_step_run_with_maximal_names_stays_under_256_kib --exact --nocapture 2>&1 | tee target/bench-status-size.log
	@# A filter that names no test runs nothing and passes: it must have run the one.
	grep -q '^test result: ok. 1 passed' target/bench-status-size.log
	$(CARGO) build --release --locked -p agentrun-operator -p agentrun-e2e --bins
	$(CLUSTER) build
	export AGENTRUN_E2E_DIR=$(BENCH_E2E_DIR); unset KUBECONFIG; \
	  trap '$(CLUSTER) down' EXIT; $(CLUSTER) up; \
	  target/release/bench $(BENCH_ARGS)

# The Job controller and Argo Workflows as peers (docs/performance-history.md,
# "Side by side"): the same driver, once with AgentRuns, twice with chains of 10
# single-Pod Jobs (kcm restarted between with a raised client QPS/burst) and
# three times with Workflows of 10 sequential steps (Argo's workflow-controller,
# one per batch: its defaults, a raised client QPS/burst, then also its
# DEFAULT_REQUEUE_TIME lowered from 10s to 1s). Argo is built for
# this only (`e2e/cluster argo`); `make test` never builds it. Tables in
# target/e2e-peers/.
PEERS_E2E_DIR ?= $(CURDIR)/target/e2e-peers
PEERS_ARGS ?= --concurrency 1,50,200 --repeats 3
KCM_DEFAULT := --controllers job-controller
KCM_RAISED := --controllers job-controller --kube-api-qps 1000 --kube-api-burst 2000
PEERS := target/release/bench --resume-runs 0 --status-steps 0 $(PEERS_ARGS)
ARGO_RAISED := --argo-qps 1000 --argo-burst 2000
ARGO_TUNED := $(ARGO_RAISED) --argo-requeue-time 1s

# A run of 50 steps as a sequence, then as a fan-out (one step, then 49 in
# parallel, spec.parallelism 50): steps/s of each, on a plane of its own
# (target/e2e-fanout). FANOUT_ARGS passes flags to both.
FANOUT_E2E_DIR ?= $(CURDIR)/target/e2e-fanout
FANOUT_ARGS ?= --concurrency 1,20 --repeats 3
FANOUT := target/release/bench --steps 50 --resume-runs 0 --status-steps 0 $(FANOUT_ARGS)

.PHONY: bench-fanout
bench-fanout:
	$(CARGO) build --release --locked -p agentrun-operator -p agentrun-e2e --bins
	$(CLUSTER) build
	export AGENTRUN_E2E_DIR=$(FANOUT_E2E_DIR); unset KUBECONFIG; \
	  trap '$(CLUSTER) down' EXIT; $(CLUSTER) up; \
	  $(FANOUT) --label sequence --report $(FANOUT_E2E_DIR)/sequence.md; \
	  $(FANOUT) --fan-out --label 'fan-out (1 then 49 in parallel)' --report $(FANOUT_E2E_DIR)/fan-out.md; \
	  cat $(FANOUT_E2E_DIR)/sequence.md $(FANOUT_E2E_DIR)/fan-out.md

# The step journal (docs/journal.md) as a step writes it: the Python SDK's Journal
# with a token bound to a Pending step Pod, under the chart's journals policy,
# against status merge patches of the same run (no operator, no node; see
# docs/performance.md, "The step journal"). JOURNAL_ARGS passes flags to
# e2e/bench/journal.py, e.g. JOURNAL_ARGS='--calls 200 --rounds 5'.
JOURNAL_E2E_DIR ?= $(CURDIR)/target/e2e-journal
JOURNAL_ARGS ?=

.PHONY: bench-journal
bench-journal:
	$(CLUSTER) build
	export AGENTRUN_E2E_DIR=$(JOURNAL_E2E_DIR); unset KUBECONFIG; \
	  trap '$(CLUSTER) down' EXIT; $(CLUSTER) up; \
	  python3 e2e/bench/journal.py --report $(JOURNAL_E2E_DIR)/journal.md $(JOURNAL_ARGS)

bench-peers:
	$(CARGO) build --release --locked -p agentrun-operator -p agentrun-e2e --bins
	$(CLUSTER) build
	$(CLUSTER) argo
	export AGENTRUN_E2E_DIR=$(PEERS_E2E_DIR); unset KUBECONFIG; \
	  trap '$(CLUSTER) down' EXIT; \
	  $(CLUSTER) down; AGENTRUN_KCM_ARGS='$(KCM_DEFAULT)' $(CLUSTER) up; \
	  $(PEERS) --peer agentrun --report $(PEERS_E2E_DIR)/agentrun.md; \
	  $(PEERS) --peer jobs --label 'kcm client QPS 20, burst 30 (defaults)' --report $(PEERS_E2E_DIR)/jobs-default-qps.md; \
	  $(CLUSTER) down; AGENTRUN_KCM_ARGS='$(KCM_RAISED)' $(CLUSTER) up; \
	  $(PEERS) --peer jobs --label 'kcm client QPS 1000, burst 2000' --report $(PEERS_E2E_DIR)/jobs-raised-qps.md; \
	  $(PEERS) --peer argo --label 'Argo client QPS 20, burst 30 (defaults)' --report $(PEERS_E2E_DIR)/argo-default-qps.md; \
	  $(PEERS) --peer argo $(ARGO_RAISED) --label 'Argo client QPS 1000, burst 2000' --report $(PEERS_E2E_DIR)/argo-raised-qps.md; \
	  $(PEERS) --peer argo $(ARGO_TUNED) --label 'Argo client QPS 1000, burst 2000, DEFAULT_REQUEUE_TIME 1s' --report $(PEERS_E2E_DIR)/argo-tuned.md; \
	  cat $(PEERS_E2E_DIR)/agentrun.md $(PEERS_E2E_DIR)/jobs-default-qps.md $(PEERS_E2E_DIR)/jobs-raised-qps.md \
	    $(PEERS_E2E_DIR)/argo-default-qps.md $(PEERS_E2E_DIR)/argo-raised-qps.md $(PEERS_E2E_DIR)/argo-tuned.md

# The chaos suite (e2e/README.md, "Chaos suite") on a plane of its own
# (target/e2e-chaos), always taken down; CHAOS_ARGS passes flags to the driver,
# e.g. make chaos CHAOS_ARGS='--seed 3'. The short version is tests/chaos.rs.
CHAOS_E2E_DIR ?= $(CURDIR)/target/e2e-chaos
CHAOS_ARGS ?=

# The property test's long pass comes first: 20,000 random histories (256 in
# `make test`), for the rare paths a short pass does not reach.
CHAOS_PROPTEST_CASES ?= 20000

.PHONY: chaos
chaos:
	mkdir -p target
	PROPTEST_CASES=$(CHAOS_PROPTEST_CASES) $(CARGO) test --locked -p agentrun-engine --lib -- \
	  proptests::drive::invariants_hold_under_random_interleavings --exact 2>&1 | tee target/chaos-proptest.log
	@# A filter that names no test runs nothing and passes: the pass must have run the one.
	grep -q '^test result: ok. 1 passed' target/chaos-proptest.log
	$(CARGO) build --workspace --bins --locked
	$(CLUSTER) build
	export AGENTRUN_E2E_DIR=$(CHAOS_E2E_DIR); unset KUBECONFIG; \
	  trap '$(CLUSTER) down' EXIT; $(CLUSTER) up; \
	  time target/debug/chaos $(CHAOS_ARGS)

# ---------------------------------------------------------------------------
# The real local node and the step SDKs (e2e/cluster node ..., sdk/). `test` brings the
# node up after the plane; e2e/tests/node.rs runs on it and fails without it.
.PHONY: sdk-test node-up node-down images test-upgrade

# The openai adapter's tests use the real openai package, pinned in
# sdk/python/requirements-openai.txt and installed once into the cache by deps.sh.
sdk-test:
	deps="$$(sdk/python/deps.sh)" && cd sdk/python && PYTHONPATH="$$deps" python3 -m unittest -v

node-up: cluster-up
	$(CLUSTER) node up

node-down:
	$(CLUSTER) node down

# The step images as OCI tarballs (what e2e/kind/run.sh loads into kind).
images:
	$(CLUSTER) images

# An upgrade with runs in flight (e2e/tests/upgrade.rs): the chart and the operator image
# of UPGRADE_FROM, built the same way from a worktree of it under target/upgrade with a
# target directory of its own (kept, so a second run only builds this checkout), installed
# on the real node; runs mid-step, waiting for an approval and in backoff; then the
# upgrade to this checkout as docs/install.md, "Upgrading", says. UPGRADE_FROM predates
# spec.steps becoming an atomic list with a CEL uniqueness rule, so the upgrade crosses a
# CRD change. Not part of `make test` (see docs/install.md for its time).
UPGRADE_FROM ?= ce26e079637a921411ecb5b37dff78f71a8c2c46
UPGRADE_DIR := $(CURDIR)/target/upgrade
UPGRADE_SRC := $(UPGRADE_DIR)/src-$(UPGRADE_FROM)
UPGRADE_DIST := $(UPGRADE_DIR)/dist-$(UPGRADE_FROM)

test-upgrade:
	$(CARGO) build --workspace --bins --locked
	release/build image
	if [ ! -d $(UPGRADE_SRC) ]; then git worktree prune; \
	  git worktree add --quiet --detach $(UPGRADE_SRC) $(UPGRADE_FROM); fi
	if ! ls $(UPGRADE_DIST)/agentrun-operator-image-*.tar >/dev/null 2>&1; then \
	  (cd $(UPGRADE_SRC) && CARGO_TARGET_DIR=$(UPGRADE_DIR)/target release/build image --out $(UPGRADE_DIST)); fi
	$(CLUSTER) build
	$(CLUSTER) node build
	$(CLUSTER) tools
	trap '$(CLUSTER) down' EXIT; $(CLUSTER) up; $(CLUSTER) node up; \
	  eval "$$($(CLUSTER) env)"; \
	  AGENTRUN_UPGRADE_FROM_SRC=$(UPGRADE_SRC) \
	  AGENTRUN_UPGRADE_FROM_IMAGE=$$(ls $(UPGRADE_DIST)/agentrun-operator-image-*.tar) \
	  $(CARGO) test --locked -p agentrun-e2e --features upgrade --test upgrade -- --nocapture
