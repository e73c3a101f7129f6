#!/usr/bin/env bash
# `make demo`: the operator doing its job on a laptop, no GPU needed. Builds what it needs (the
# harness binaries, the operator), starts a real control plane with fake GPU nodes (T4,
# A100-40GB, H100 and one CPU node), installs the Helm chart with the flags of NVIDIA's install docs, runs the
# operator with the chart's ServiceAccount token, waits for the ClusterPolicy to be ready, then
# applies a time-slicing config through chart values and shows the device plugin rolling.
# Everything stays up for exploring; `make demo-down` stops it.
#
# With DEMO_RUNTIME=runc (the default where this is root) the operator a user would deploy runs:
# `make release` publishes the image and the chart to an OCI registry on 127.0.0.1, the chart is
# installed from it with no image flags, and the Deployment's pod runs from the published image
# under runc as a kubelet would run it (run-pod, tests/e2e/src/container.rs: the chart's
# securityContext, limits and ServiceAccount token; its probes polled). DEMO_RUNTIME=process runs
# the binary as a host process with the pod's ServiceAccount token instead (no root needed; a
# first runc run builds the image's release binary, several minutes more).
#
# Settings (environment): DEMO_PORT_BASE (19400; the harness uses base..base+6, the operator's
# metrics base+10), so the demo sits beside a test run (16400); DEMO_RUNTIME (runc or process).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export HARNESS_PORT_BASE=${DEMO_PORT_BASE:-19400}
unset HARNESS_DIR KUBECONFIG
# shellcheck source=../cluster/lib.sh
source "$root/tests/cluster/lib.sh"

NAMESPACE=gpu-operator
RELEASE=gpu-operator
METRICS_ADDR=127.0.0.1:$((HARNESS_PORT_BASE + 10))
SCENARIO_1=(--set driver.enabled=true --set toolkit.enabled=true --set devicePlugin.enabled=true
            --set dcgmExporter.enabled=true --set migManager.enabled=true)
TIME_SLICING=$root/charts/gpu-operator/ci/time-slicing-values.yaml
runtime=${DEMO_RUNTIME:-$([[ $(id -u) == 0 ]] && echo runc || echo process)}
case $runtime in
  runc | process) ;;
  *) echo "demo: DEMO_RUNTIME=$runtime: runc or process" >&2; exit 2 ;;
esac
# The chart refuses to install without an operator image (docs/install.md). With runc the chart
# comes from the registry `make release` published it to, naming the image; as a process the
# Deployment's pod lands on a fake node where nothing is pulled, and the binary runs here instead.
OPERATOR_IMAGE=(--set operator.repository=registry.example.com/gpu-operator)
CHART=$root/charts/gpu-operator

started=$SECONDS
step() { printf '\n\033[1m==> %s\033[0m  (%ss)\n' "$*" "$((SECONDS - started))"; }
die() { echo "demo: error: $*" >&2; exit 1; }
for tool in go cargo openssl curl; do
  command -v "$tool" >/dev/null || die "$tool is needed (see README.md: Go, Rust, openssl, curl)"
done

if [[ -f "$HARNESS_DIR/pids" ]]; then
  step "Stopping the previous demo"
  "$root/tests/demo/demo-down.sh"
fi

step "Building the operator and the fake-node tool (cargo)"
(cd "$root" && cargo build --quiet -p gpu-operator && cargo build --quiet -p e2e --bin fake-nodes)
operator_bin=$CARGO_TARGET_DIR/debug/gpu-operator
if [[ $runtime == runc ]]; then
  step "Building run-pod, the OCI registry, oras and runc's tools (runc from Debian when missing)"
  (cd "$root" && cargo build --quiet -p e2e --bin run-pod)
  run_pod=$CARGO_TARGET_DIR/debug/run-pod
  oras=$("$root/tests/cluster/build.sh" registry oras helm | tail -1)/oras
  "$root/tests/cluster/container-tools.sh" >/dev/null
fi

step "Starting the control plane on 127.0.0.1:$((HARNESS_PORT_BASE + 2)) (a first run builds kube-apiserver, etcd, kwok and helm from their Go modules: tens of minutes)"
"$root/tests/cluster/up.sh" >/dev/null
# shellcheck source=/dev/null
source "$HARNESS_DIR/env"
bin=$HARNESS_BIN

step "Creating fake nodes: a T4, an A100-40GB and an H100 GPU node, and a CPU node"
"$root/tests/cluster/nodes.sh" 3 --prefix demo
kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count

if [[ $runtime == runc ]]; then
  registry=$("$root/tests/cluster/registry.sh" | tail -1)
  version=$(sed -n 's/^version: *//p' "$root/charts/gpu-operator/Chart.yaml" | tr -d '"')
  step "make release REGISTRY=$registry/gpu-operator (the image's release build takes minutes the first time)"
  OUT=$HARNESS_DIR/release "$root/scripts/release.sh" "$registry/gpu-operator" "$version" 2>&1 | tail -4
  CHART=oci://$registry/gpu-operator/charts/gpu-operator
  # The published chart names its image; --plain-http only because this registry is plain HTTP.
  OPERATOR_IMAGE=(--plain-http)
fi

step "helm install $RELEASE ${CHART#"$root/"} -n $NAMESPACE --create-namespace ${OPERATOR_IMAGE[*]} ${SCENARIO_1[*]} --wait"
helm install "$RELEASE" "$CHART" -n "$NAMESPACE" --create-namespace \
  "${OPERATOR_IMAGE[@]}" "${SCENARIO_1[@]}" --wait --timeout 3m | sed -n '1,/^NOTES:/p' | sed '$d'

if [[ $runtime == runc ]]; then
  image=$(kubectl get deployment -n "$NAMESPACE" gpu-operator -o jsonpath='{.spec.template.spec.containers[0].image}')
  step "Running the Deployment's pod from $image under runc (the chart's securityContext, limits and ServiceAccount)"
  nohup "$run_pod" --namespace "$NAMESPACE" --deployment gpu-operator --image "$image" --oras "$oras" \
    >"$HARNESS_DIR/run-pod.log" 2>&1 </dev/null &
  operator_pid=$!
  echo "$operator_pid $(readlink -f "$run_pod")" >"$HARNESS_DIR/operator.pid"
  deadline=$((SECONDS + 120))
  until grep -q 'probes: ready=true' "$HARNESS_DIR/run-pod.log"; do
    kill -0 "$operator_pid" 2>/dev/null || { cat "$HARNESS_DIR/run-pod.log"; die "run-pod exited"; }
    ((SECONDS < deadline)) || { cat "$HARNESS_DIR/run-pod.log"; die "the operator container was not ready after 120s"; }
    sleep 0.5
  done
  grep '^run-pod:' "$HARNESS_DIR/run-pod.log"
  operator_log=$(sed -n 's/^run-pod: .* log \([^;]*\);.*/\1/p' "$HARNESS_DIR/run-pod.log" | head -1)
else
step "Running the operator as ServiceAccount $NAMESPACE/gpu-operator (only the chart's RBAC)"
# The operator pod of the Deployment sits on a fake node, where no container runs; the binary
# runs here instead, with the same identity the pod would have.
token=$(kubectl create token gpu-operator -n "$NAMESPACE" --duration 24h)
server=$(kubectl config view --raw -o jsonpath='{.clusters[0].cluster.server}')
ca=$(kubectl config view --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
operator_kubeconfig=$HARNESS_DIR/operator.kubeconfig
umask 077
cat >"$operator_kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: harness
  cluster: {server: "$server", certificate-authority-data: "$ca"}
users:
- name: gpu-operator
  user: {token: "$token"}
contexts:
- name: gpu-operator
  context: {cluster: harness, user: gpu-operator, namespace: $NAMESPACE}
current-context: gpu-operator
EOF
umask 022
KUBECONFIG=$operator_kubeconfig OPERATOR_NAMESPACE=$NAMESPACE POD_NAME=gpu-operator-demo \
  RUST_LOG=info,kube=warn nohup "$operator_bin" run --metrics-addr "$METRICS_ADDR" \
  --metrics-secure=false --health-addr 127.0.0.1:0 \
  >"$HARNESS_DIR/operator.log" 2>&1 </dev/null &
operator_pid=$!
echo "$operator_pid $(readlink -f "$operator_bin")" >"$HARNESS_DIR/operator.pid"
echo "operator pid $operator_pid, log $HARNESS_DIR/operator.log, metrics http://$METRICS_ADDR/metrics"
operator_log=$HARNESS_DIR/operator.log
fi

# policy_field JSONPATH
policy_field() { kubectl get clusterpolicy cluster-policy -o jsonpath="$1" 2>/dev/null || true; }
# Waits until the policy is ready for its current generation.
await_ready() {
  local deadline=$((SECONDS + 180))
  while true; do
    local state generation observed
    state=$(policy_field '{.status.state}')
    generation=$(policy_field '{.metadata.generation}')
    observed=$(policy_field '{.status.conditions[?(@.type=="Ready")].observedGeneration}')
    [[ "$state" == ready && "$observed" == "$generation" ]] && return 0
    kill -0 "$operator_pid" 2>/dev/null || { tail -20 "$operator_log"; die "the operator exited"; }
    ((SECONDS < deadline)) || { tail -20 "$operator_log"; die "policy not ready after 180s (state ${state:-none})"; }
    sleep 0.5
  done
}
components() {
  kubectl get clusterpolicy cluster-policy -o jsonpath='{range .status.components[*]}{.name}{"\t"}{.ready}/{.desired}{"\t"}{.message}{"\n"}{end}' |
    column -t -s $'\t'
}

step "Waiting for ClusterPolicy cluster-policy to be ready"
await_ready
kubectl get clusterpolicy
echo
components

step "Operand pods per node (GPU operands on GPU nodes only; NFD's worker everywhere)"
kubectl get pods -n "$NAMESPACE" --sort-by=.spec.nodeName \
  -o custom-columns='NODE:.spec.nodeName,POD:.metadata.name,STATUS:.status.phase'

plugin=nvidia-device-plugin-daemonset
ds_line() {
  kubectl get ds -n "$NAMESPACE" "$1" -o jsonpath='{.metadata.name}{"\t"}generation {.metadata.generation}{"\t"}config-hash {.spec.template.metadata.annotations.nvidia\.com/gpu-operator\.config-hash}{"\t"}updated {.status.updatedNumberScheduled}/{.status.desiredNumberScheduled}, available {.status.numberAvailable}{"\n"}' |
    sed 's/config-hash \t/config-hash (none)\t/'
}
step "Before time-slicing: the config consumers"
{ ds_line "$plugin"; ds_line gpu-feature-discovery; } | column -t -s $'\t'

step "helm upgrade $RELEASE ... -f charts/gpu-operator/ci/time-slicing-values.yaml (every GPU shared 4 ways)"
sed -n '/^devicePlugin:/,/^node-feature-discovery:/p' "$TIME_SLICING" | sed '$d'
before=$(kubectl get ds -n "$NAMESPACE" "$plugin" -o jsonpath='{.metadata.generation}')
helm upgrade "$RELEASE" "$CHART" -n "$NAMESPACE" "${OPERATOR_IMAGE[@]}" "${SCENARIO_1[@]}" \
  -f "$TIME_SLICING" --wait --timeout 3m >/dev/null
echo "ClusterPolicy spec.devicePlugin.config: $(policy_field '{.spec.devicePlugin.config}')"

step "The device plugin rolling (the operator changed its pod template's config hash)"
last=""
deadline=$((SECONDS + 120))
while true; do
  line=$(ds_line "$plugin")
  [[ "$line" != "$last" ]] && { printf '%s\n' "$line" | column -t -s $'\t'; last=$line; }
  generation=$(kubectl get ds -n "$NAMESPACE" "$plugin" -o jsonpath='{.metadata.generation}')
  rolled=$(kubectl get ds -n "$NAMESPACE" "$plugin" -o jsonpath='{.status.observedGeneration} {.status.updatedNumberScheduled} {.status.numberAvailable} {.status.desiredNumberScheduled}')
  read -r observed updated available desired <<<"$rolled"
  if ((generation > before)) && [[ "$observed" == "$generation" && "$updated" == "$desired" && "$available" == "$desired" ]]; then
    break
  fi
  ((SECONDS < deadline)) || die "device plugin did not roll within 120s"
  sleep 0.2
done
await_ready
echo
echo "Both config consumers rolled; operands that do not read the config, such as the driver, did not:"
{ ds_line "$plugin"; ds_line gpu-feature-discovery; ds_line nvidia-driver-daemonset; } | column -t -s $'\t'
echo
echo "The plugins mount the operator's validated, immutable copy of the config:"
kubectl get configmap -n "$NAMESPACE" -l app.kubernetes.io/managed-by=gpu-operator -o name | grep device-plugin-config || true
echo
components

step "Done in $((SECONDS - started))s. The cluster stays up; explore it with"
cat <<EOF
  export PATH="$bin:\$PATH" KUBECONFIG=$KUBECONFIG
  kubectl get clusterpolicy cluster-policy -o yaml         # spec from the chart, status from the operator
  kubectl get pods -n $NAMESPACE -o wide
  kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.present
  kubectl edit configmap -n $NAMESPACE device-plugin-config   # replicas 4 -> 8 rolls the plugins again
  kubectl patch clusterpolicy cluster-policy --type merge -p '{"spec":{"dcgmExporter":{"enabled":false}}}'
  helm get values $RELEASE -n $NAMESPACE
  tail -f $operator_log
EOF
if [[ $runtime == process ]]; then
  echo "  curl -s http://$METRICS_ADDR/metrics | grep ^gpu_operator"
else
  echo "  grep ^run-pod: $HARNESS_DIR/run-pod.log   # the operator container: probes, limits"
fi
cat <<EOF

Stop everything with: make demo-down
EOF
