#!/usr/bin/env bash
# Scale check of the harness itself: starts its own harness (ports HARNESS_PORT_BASE, default
# 16500, so it can run beside a test harness), creates N fake GPU nodes and one DaemonSet on
# them, and reports the time until every pod is Ready and each component's memory, as a
# Markdown table. Stops the harness at the end.
#   scale.sh [N]   (default 1000)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
n=${1:-1000}
export HARNESS_PORT_BASE=${HARNESS_PORT_BASE:-16500}
unset HARNESS_DIR KUBECONFIG
# Thousands of nodes: longer node leases and grace period keep heartbeats from saturating 2 CPUs.
export HARNESS_NODE_LEASE_SECONDS=${HARNESS_NODE_LEASE_SECONDS:-120}
export HARNESS_NODE_GRACE=${HARNESS_NODE_GRACE:-300s}
# shellcheck source=lib.sh
source "$here/lib.sh"

log() { echo "scale.sh: $*" >&2; }

(cd "$here/../.." && cargo build --quiet -p e2e --bin fake-nodes)
"$here/up.sh" >/dev/null
trap '"$here/down.sh"' EXIT
# shellcheck source=/dev/null
source "$HARNESS_DIR/env"

t0=$SECONDS
"$here/nodes.sh" "$n" --prefix scale >&2
nodes_created=$((SECONDS - t0))

kubectl apply -f - >/dev/null <<'YAML'
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: scale-probe, namespace: default}
spec:
  selector: {matchLabels: {app: scale-probe}}
  template:
    metadata: {labels: {app: scale-probe}}
    spec:
      nodeSelector: {feature.node.kubernetes.io/pci-10de.present: "true"}
      tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
      containers: [{name: main, image: registry.k8s.io/pause:3.10}]
YAML
started=$(date +%s.%N)
deadline=$((SECONDS + 1800))
while :; do
  ready=$(kubectl get ds scale-probe -n default -o jsonpath='{.status.numberReady}')
  [[ "${ready:-0}" -ge "$n" ]] && break
  ((SECONDS < deadline)) || { log "only ${ready:-0}/$n pods Ready after 30 min"; exit 1; }
  sleep 1
done
ready_s=$(awk -v a="$(date +%s.%N)" -v b="$started" 'BEGIN {print a - b}')

echo "| N | nodes created (s) | DaemonSet all Ready (s) |"
echo "|---|---|---|"
printf '| %s | %s | %.1f |\n' "$n" "$nodes_created" "$ready_s"
echo
echo "| component | RSS (MiB) | peak RSS (MiB) |"
echo "|---|---|---|"
while read -r name pid _; do
  rss=$(awk '/VmRSS/ {print int($2/1024)}' "/proc/$pid/status")
  hwm=$(awk '/VmHWM/ {print int($2/1024)}' "/proc/$pid/status")
  echo "| $name | $rss | $hwm |"
done <"$HARNESS_DIR/pids"
