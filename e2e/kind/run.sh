#!/usr/bin/env bash
# The operator on a real kind cluster: build the image, load it, install the chart,
# run a sample. Needs docker, kind, kubectl and helm on PATH.
#
# NOT RUN IN CI: the project's build machines have no Docker engine or registry, so
# this script is kept correct by review. The step images are the ones the local node
# runs (examples/refund-agent, built as OCI tarballs by `e2e/cluster images` from Debian
# packages and the repo's sources) and are loaded with `kind load image-archive`; the
# samples in config/samples run on kind as they are.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${KIND_CLUSTER:-agentrun}"
IMAGE="${IMAGE:-agentrun-operator:dev}"
NS=agentrun-system

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "$tool is required" >&2; exit 1; }
done

kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER"
kubectl config use-context "kind-$CLUSTER"

docker build -t "$IMAGE" "$ROOT"
kind load docker-image "$IMAGE" --name "$CLUSTER"

helm upgrade --install agentrun-operator "$ROOT/charts/agentrun-operator" \
  -n "$NS" --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
  --wait --timeout 3m
kubectl rollout status deployment -n "$NS" -l app.kubernetes.io/instance=agentrun-operator --timeout=2m

# The example agent's images, built locally (no registry), and what the samples need:
# the payments service, the ConfigMap with its URL, the step ServiceAccount.
"$ROOT/e2e/cluster" images
for tar in "${AGENTRUN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrun-operator}"/node-images/{refund-agent,node-probe}.tar; do
  kind load image-archive "$tar" --name "$CLUSTER"
done
kubectl apply -n default -f "$ROOT/examples/refund-agent/deploy.yaml"
kubectl rollout status deployment/payments -n default --timeout=2m

# The samples as they are: the refund run waits for a person, evict-demo runs through.
kubectl apply -n default -f "$ROOT/config/samples/agentrun_refund.yaml" -f "$ROOT/config/samples/agentrun_evicted.yaml"
kubectl wait --for=jsonpath='{.status.phase}'=Succeeded agentrun/evict-demo -n default --timeout=5m
kubectl wait --for=jsonpath='{.status.phase}'=WaitingForApproval agentrun/refund-order-4711 -n default --timeout=5m
APV="$(kubectl get agentrun refund-order-4711 -n default -o jsonpath='{.status.steps[?(@.name=="issue-refund")].approval}')"
kubectl patch approval "$APV" -n default --type merge -p '{"spec":{"decision":"Approved","comment":"kind smoke"}}'
kubectl wait --for=jsonpath='{.status.phase}'=Succeeded agentrun/refund-order-4711 -n default --timeout=5m
kubectl get ar -n default
kubectl get ar refund-order-4711 -n default -o jsonpath='{range .status.steps[*]}{.name}{": "}{.result}{"\n"}{end}'
echo "kind sample runs succeeded; delete the cluster with: kind delete cluster --name $CLUSTER"
