#!/usr/bin/env bash
# The operator on a real kind cluster: build the image, load it, install the chart,
# run a sample. Needs docker, kind, kubectl and helm on PATH.
#
# NOT RUN IN CI: the project's build machines have no Docker engine or registry, so
# this script is kept correct by review. On step Pods: a real kubelet runs the sample's
# placeholder images, which do not exist; point the sample at a real image (any image
# that writes {"result": …} to /dev/termination-log), e.g.
#   busybox: sh -c 'echo "{\"result\":{\"ok\":true}}" > /dev/termination-log'
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

# A run whose steps really execute on kind's kubelet.
kubectl apply -f - <<'YAML'
apiVersion: agentrun.dev/v1alpha1
kind: AgentRun
metadata:
  name: kind-smoke
  namespace: default
spec:
  ttlSecondsAfterFinished: 600
  steps:
    - name: hello
      effect: None
      container:
        image: busybox:1.36
        command: ["sh", "-c", "echo '{\"result\":{\"hello\":\"world\"},\"tokens\":{\"input\":1,\"output\":1}}' > /dev/termination-log"]
    - name: key
      effect: Idempotent
      container:
        image: busybox:1.36
        command: ["sh", "-c", "printf '{\"result\":{\"key\":\"%s\"}}' \"$AGENTRUN_IDEMPOTENCY_KEY\" > /dev/termination-log"]
YAML

kubectl wait --for=jsonpath='{.status.phase}'=Succeeded agentrun/kind-smoke -n default --timeout=5m
kubectl get ar -n default
kubectl get ar kind-smoke -n default -o jsonpath='{.status.steps[*].result}{"\n"}'
echo "kind smoke run succeeded; delete the cluster with: kind delete cluster --name $CLUSTER"
