#!/usr/bin/env bash
# Starts a real control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and kwok (fake nodes and pod lifecycle). Logs, pids, certificates and the
# audit log live under $HARNESS_DIR. Waits until every component is ready, then prints
# `export KUBECONFIG=...` (admin) as its last line. Stop it with down.sh (same environment).
#
# Settings (environment): the ports and HARNESS_DIR of lib.sh; HARNESS_PSA_ENFORCE / _AUDIT /
# _WARN (cluster-wide Pod Security defaults, privileged / baseline / baseline);
# HARNESS_NODE_LEASE_SECONDS (kwok node lease, 40); HARNESS_NODE_GRACE (controller-manager
# node-monitor grace period, 50s; raise both for thousands of nodes); HARNESS_KWOK_PARALLELISM
# (kwok's workers for pod stages, node stages and node leases, 16; manifests/kwok.yaml);
# HARNESS_GOGC and HARNESS_GOMEMLIMIT (the control plane's garbage collector, 400 and 6GiB).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"

log() { echo "up.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

if [[ -f "$HARNESS_DIR/pids" ]]; then
  die "a harness is already recorded in $HARNESS_DIR; run down.sh first (same HARNESS_* settings)"
fi

bin=$("$here/build.sh")
export PATH="$bin:$PATH"

mkdir -p "$HARNESS_DIR"/{pki,logs,etcd}
work=$(cd "$HARNESS_DIR" && pwd)
pki=$work/pki

# Anything that fails from here on stops what was started so far.
cleanup_on_error() {
  local rc=$?
  log "start-up failed (exit $rc); logs are in $work/logs; stopping what was started"
  for f in "$work"/logs/*.log; do
    [[ -f "$f" ]] || continue
    echo "---- tail of $f" >&2
    tail -n 15 "$f" >&2
  done
  "$here/down.sh" >&2 || true
  exit "$rc"
}
trap cleanup_on_error ERR

for port in "$ETCD_CLIENT_PORT" "$ETCD_PEER_PORT" "$APISERVER_PORT" "$CONTROLLER_MANAGER_PORT" "$SCHEDULER_PORT" "$KWOK_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "port $port on 127.0.0.1 is taken; set HARNESS_PORT_BASE (or the single *_PORT variable) to free ports"
  fi
done

# --- PKI: a CA, the API server's serving certificate, one client certificate per identity,
# and the service-account key pair.
openssl_quiet() { openssl "$@" 2>/dev/null; }
openssl_quiet req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=gpu-operator-harness-ca" \
  -keyout "$pki/ca.key" -out "$pki/ca.crt"

# sign NAME SUBJECT [SAN]: a certificate for NAME signed by the CA
sign() {
  local name=$1 subject=$2 san=${3:-}
  openssl_quiet req -newkey rsa:2048 -nodes -subj "$subject" -keyout "$pki/$name.key" -out "$pki/$name.csr"
  local ext="$pki/$name.ext"
  if [[ -n "$san" ]]; then
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$san" >"$ext"
  else
    printf 'extendedKeyUsage=clientAuth\n' >"$ext"
  fi
  openssl_quiet x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -extfile "$ext" -out "$pki/$name.crt"
}
sign apiserver "/CN=kube-apiserver" \
  "IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
sign admin "/O=system:masters/CN=admin"
sign controller-manager "/CN=system:kube-controller-manager"
sign scheduler "/CN=system:kube-scheduler"
sign kwok "/O=system:masters/CN=kwok"
openssl_quiet genrsa -out "$pki/sa.key" 2048
openssl_quiet rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub"

server="https://127.0.0.1:$APISERVER_PORT"
# kubeconfig NAME: a kubeconfig with NAME's client certificate, embedded
kubeconfig() {
  local name=$1 file="$work/$1.kubeconfig"
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: harness
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$pki/ca.crt")
users:
- name: $name
  user:
    client-certificate-data: $(base64 -w0 <"$pki/$name.crt")
    client-key-data: $(base64 -w0 <"$pki/$name.key")
contexts:
- name: harness
  context: {cluster: harness, user: $name}
current-context: harness
EOF
  chmod 600 "$file"
}
for identity in admin controller-manager scheduler kwok; do kubeconfig "$identity"; done

sed -e "s|@PSA_ENFORCE@|${HARNESS_PSA_ENFORCE:-privileged}|" \
  -e "s|@PSA_AUDIT@|${HARNESS_PSA_AUDIT:-baseline}|" \
  -e "s|@PSA_WARN@|${HARNESS_PSA_WARN:-baseline}|" \
  "$here/manifests/admission.yaml" >"$work/admission.yaml"
sed -e "s|@KUBECONFIG@|$work/scheduler.kubeconfig|" "$here/manifests/kube-scheduler.yaml" >"$work/kube-scheduler.yaml"
cp "$here/manifests/audit-policy.yaml" "$work/audit-policy.yaml"
sed -e "s|@PARALLELISM@|${HARNESS_KWOK_PARALLELISM:-16}|" "$here/manifests/kwok.yaml" >"$work/kwok.yaml"

# The control plane's Go processes collect garbage at 4x the default heap growth (GOGC 400):
# on a 2-core CI machine the end-to-end lanes are CPU-bound, and the API server spent about
# 15 % of its CPU in the collector at GOGC 100 (a CPU profile of the controller suite). The
# soft memory limit makes collection frequent again as a heap nears it (thousands of nodes).
gc_env=(GOGC="${HARNESS_GOGC:-400}" GOMEMLIMIT="${HARNESS_GOMEMLIMIT:-6GiB}")

# start NAME BINARY ARGS...: runs BINARY in the background with its log under logs/ and
# records "NAME PID BINARY" so down.sh stops exactly this process.
start() {
  local name=$1 binary
  binary=$(readlink -f "$(command -v "$2")")
  shift 2
  env "${gc_env[@]}" nohup "$binary" "$@" >"$work/logs/$name.log" 2>&1 </dev/null &
  echo "$name $! $binary" >>"$work/pids"
}

# wait_for WHAT SECONDS COMMAND...: polls COMMAND until it succeeds
wait_for() {
  local what=$1 seconds=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "$what not ready after ${seconds}s"
      return 1
    fi
    sleep 0.2
  done
  log "$what ready"
}

curl_admin() {
  curl -sf --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" "$@"
}

started=$SECONDS
start etcd etcd --name harness --data-dir "$work/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "harness=http://127.0.0.1:$ETCD_PEER_PORT" \
  --unsafe-no-fsync --log-level warn
wait_for etcd 60 curl -sf "http://127.0.0.1:$ETCD_CLIENT_PORT/health"

start kube-apiserver kube-apiserver \
  --etcd-servers "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" \
  --cert-dir "$work/pki" \
  --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
  --client-ca-file "$pki/ca.crt" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 \
  --authorization-mode Node,RBAC --allow-privileged=true \
  --endpoint-reconciler-type none \
  --enable-admission-plugins OwnerReferencesPermissionEnforcement,PodSecurity \
  --admission-control-config-file "$work/admission.yaml" \
  --audit-policy-file "$work/audit-policy.yaml" --audit-log-path "$work/audit.log" \
  --audit-log-format json --audit-log-maxsize 0 --audit-log-mode blocking \
  --max-requests-inflight 1000 --max-mutating-requests-inflight 500
wait_for kube-apiserver 120 curl_admin "$server/readyz"

start kube-controller-manager kube-controller-manager \
  --kubeconfig "$work/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$work/controller-manager.kubeconfig" \
  --authorization-kubeconfig "$work/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$CONTROLLER_MANAGER_PORT" --cert-dir "$work/pki/kcm" \
  --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
  --use-service-account-credentials=true --leader-elect=false \
  --kube-api-qps 500 --kube-api-burst 1000 \
  --concurrent-daemonset-syncs 4 --concurrent-gc-syncs 20 \
  --node-monitor-grace-period "${HARNESS_NODE_GRACE:-50s}"
start kube-scheduler kube-scheduler --config "$work/kube-scheduler.yaml" \
  --authentication-kubeconfig "$work/scheduler.kubeconfig" \
  --authorization-kubeconfig "$work/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" --cert-dir "$work/pki/scheduler"
wait_for kube-controller-manager 120 curl -sfk "https://127.0.0.1:$CONTROLLER_MANAGER_PORT/healthz"
wait_for kube-scheduler 120 curl -sfk "https://127.0.0.1:$SCHEDULER_PORT/healthz"

# kwok's stages come from the kwok module itself, so they always match the pinned kwok.
kwok_dir=$(cd "$here/go/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
export KUBECONFIG="$work/admin.kubeconfig"
kubectl apply --server-side -f "$kwok_dir/kustomize/crd/bases/kwok.x-k8s.io_stages.yaml" >/dev/null
# Polled, not `kubectl wait`: a CRD created a moment ago has no status.conditions yet, which
# `kubectl wait --for condition=...` reports as an error instead of waiting.
wait_for "Stage CRD" 60 sh -c "kubectl get crd stages.kwok.x-k8s.io \
  -o jsonpath='{.status.conditions[?(@.type==\"Established\")].status}' | grep -qx True"
for stage in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
  pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
  kubectl apply --server-side -f "$kwok_dir/kustomize/stage/$stage.yaml" >/dev/null
done

start kwok kwok --kubeconfig "$work/kwok.kubeconfig" --config "$work/kwok.yaml" \
  --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
  --enable-crds Stage --cidr 10.244.0.1/16 --node-ip 127.0.0.1 \
  --node-lease-duration-seconds "${HARNESS_NODE_LEASE_SECONDS:-40}" \
  --server-address "127.0.0.1:$KWOK_PORT"
wait_for kwok 60 curl -sf "http://127.0.0.1:$KWOK_PORT/healthz"

# Pods need the default ServiceAccount, which the controller manager creates.
wait_for "default ServiceAccount" 60 kubectl get serviceaccount default -n default

cat >"$work/env" <<EOF
export PATH="$bin:\$PATH"
export KUBECONFIG="$work/admin.kubeconfig"
export HARNESS_DIR="$work"
export HARNESS_AUDIT_LOG="$work/audit.log"
export HARNESS_BIN="$bin"
EOF
trap - ERR
log "control plane ready in $((SECONDS - started))s (state in $work; stop with tests/cluster/down.sh)"
echo "export PATH=\"$bin:\$PATH\""
echo "export KUBECONFIG=$work/admin.kubeconfig"
