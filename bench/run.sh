#!/usr/bin/env bash
# The benchmark (bench/README.md): starts its own harness with N fake GPU nodes, measures the operator
# (release build) and, with OPERATOR_CMD, another operator command on the same cluster, writes
# bench/results/n<N>.{json,md}, refreshes bench/results/summary.md over every n*.json there,
# and stops the harness, also on failure. See bench/README.md.
#   bench/run.sh [N]              (default 100; N=... from make)
# Settings (environment): OPERATOR_CMD, OPERATOR_NAME, BENCH_CHANGES (25), BENCH_STEADY_SECONDS
# (60), BENCH_ARGS (more bench flags), BENCH_SKIP_BUILD, BENCH_KEEP, HARNESS_PORT_BASE (20400),
# BENCH_OUT (bench/results), BENCH_DHAT (a file: heap-profile our operator with dhat-rs into it;
# its timings are then not comparable), OPERATOR_RUNTIME (`runc`: our operator runs from its
# image, `make image`, under runc as the chart's Deployment says, with its securityContext and
# memory/CPU limits as cgroup limits; results then go to bench/results/runc/ by default, and
# OPERATOR_IMAGE=ARCHIVE reuses an archive already built).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cluster=$root/tests/cluster
n=${1:-${N:-100}}
export HARNESS_PORT_BASE=${HARNESS_PORT_BASE:-20400}
unset HARNESS_DIR KUBECONFIG
# 5,000 nodes: ~45,000 operand pods for two cores. More kwok workers, so pods are readied as
# fast as they are created; and leases renewed every 150 s, not 30 s (kwok renews at a quarter
# of the duration): with 5,000 nodes renewing every 30 s behind a busy API server, leases
# expired and nodes went NotReady (bench/results/README.md, the 5,000-node run).
if ((n >= 5000)); then
  export HARNESS_KWOK_PARALLELISM=${HARNESS_KWOK_PARALLELISM:-32}
  export HARNESS_NODE_LEASE_SECONDS=${HARNESS_NODE_LEASE_SECONDS:-600}
  export HARNESS_NODE_GRACE=${HARNESS_NODE_GRACE:-1200s}
fi
# Thousands of nodes: longer node leases and grace period keep heartbeats from saturating the
# CPUs (as tests/cluster/scale.sh does).
if ((n >= 1000)); then
  export HARNESS_NODE_LEASE_SECONDS=${HARNESS_NODE_LEASE_SECONDS:-120}
  export HARNESS_NODE_GRACE=${HARNESS_NODE_GRACE:-300s}
fi
# shellcheck source=../tests/cluster/lib.sh
source "$cluster/lib.sh"
runtime=${OPERATOR_RUNTIME:-process}
case $runtime in
  process) out=${BENCH_OUT:-$root/bench/results} ;;
  runc) out=${BENCH_OUT:-$root/bench/results/runc} ;;
  *) echo "bench/run.sh: OPERATOR_RUNTIME=$runtime: process or runc" >&2; exit 2 ;;
esac

log() { echo "bench/run.sh: $*" >&2; }

# Release builds, before the harness starts so compile time is not spent with it running
# (BENCH_SKIP_BUILD=1 reuses the binaries already there, e.g. to repeat a run).
features=()
if [[ -n "${BENCH_DHAT:-}" ]]; then
  features=(--features gpu-operator/dhat-heap)
  export DHAT_OUT=$BENCH_DHAT
fi
# The operator is built as its image builds it (scripts/image-rootfs.sh): statically linked, so
# the resident code is what the image runs, without the pages of a dynamic libc and libm. Its
# own target folder (`--target`) keeps the flag off the bench and the build scripts.
host=$(rustc -vV | sed -n 's/^host: //p')
release=$CARGO_TARGET_DIR/release
operator=$CARGO_TARGET_DIR/$host/release/gpu-operator
image=${OPERATOR_IMAGE:-$CARGO_TARGET_DIR/image/gpu-operator.oci.tar}
if [[ $runtime == runc ]]; then
  [[ -z "${BENCH_DHAT:-}" ]] || { log "BENCH_DHAT needs OPERATOR_RUNTIME=process"; exit 2; }
  # The image's own build (the `image` profile, static): no separate operator build here.
  if [[ -z "${BENCH_SKIP_BUILD:-}" && -z "${OPERATOR_IMAGE:-}" ]]; then
    (cd "$root" && scripts/image.sh "$image" >/dev/null)
  fi
  [[ -f $image ]] || { log "no image archive at $image (make image, or OPERATOR_IMAGE=...)"; exit 2; }
  "$cluster/container-tools.sh" >/dev/null
elif [[ -z "${BENCH_SKIP_BUILD:-}" ]]; then
  (cd "$root" && RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --quiet \
    --target "$host" -p gpu-operator --bin gpu-operator "${features[@]}")
fi
if [[ -z "${BENCH_SKIP_BUILD:-}" ]]; then
  (cd "$root" && cargo build --release --quiet -p e2e --bin bench)
fi

if [[ -f "$HARNESS_DIR/pids" ]]; then "$cluster/down.sh"; fi
"$cluster/up.sh" >/dev/null
# BENCH_KEEP=DIR keeps the audit log and the operator's and components' logs for analysis.
keep() {
  if [[ -n "${BENCH_KEEP:-}" ]]; then
    mkdir -p "$BENCH_KEEP"
    cp -r "$HARNESS_DIR/audit.log" "$HARNESS_DIR/logs" "$HARNESS_DIR"/*.log "$BENCH_KEEP/" 2>/dev/null || true
  fi
}
trap 'keep; "$cluster/down.sh"' EXIT
# shellcheck source=/dev/null
source "$HARNESS_DIR/env"

args=(run --nodes "$n" --out "$out"
  --changes "${BENCH_CHANGES:-25}" --steady-seconds "${BENCH_STEADY_SECONDS:-60}")
if [[ $runtime == runc ]]; then
  args+=(--image "$image" --chart "$root/charts/gpu-operator")
else
  args+=(--gpu-operator "$operator")
fi
if [[ -n "${OPERATOR_CMD:-}" ]]; then
  args+=(--operator-name "${OPERATOR_NAME:-other}" --operator-cmd "$OPERATOR_CMD")
fi
# shellcheck disable=SC2206 # BENCH_ARGS is a list of flags
args+=(${BENCH_ARGS:-})
log "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$release/bench" "${args[@]}"
shopt -s nullglob
results=("$out"/n*.json)
"$release/bench" summary "${results[@]}" >"$out/summary.md"
log "wrote $out/n$n.json, $out/n$n.md and $out/summary.md"
