#!/usr/bin/env bash
# `make chaos N=...`: the chaos suite's run of N faults (tests/e2e/src/chaos) on a harness of its
# own, started here on its own port base (HARNESS_PORT_BASE, default 16600, so an e2e run on the
# default 16400 can go on beside it) with the standard fleet, and stopped again, also on failure.
# CHAOS_SEED replays a run; CHAOS_ETCD_MAX_SECONDS bounds how long etcd is stopped (default 60).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cluster=$root/tests/cluster
export HARNESS_PORT_BASE=${HARNESS_PORT_BASE:-16600}
# shellcheck source=cluster/lib.sh
source "$cluster/lib.sh"
# The harness is started here: no cluster is a failure, not a skip (tests/e2e/src/cluster.rs).
export E2E_REQUIRE_CLUSTER=1
export CHAOS_FAULTS=${1:-100}

# etcd is stopped for up to 60 s: with the default 50 s node-monitor grace the node controller
# marks nodes NotReady and their pods unready, which kwok (unlike a kubelet) never undoes, so the
# faults after it would measure the fake kubelets instead of the operator.
export HARNESS_NODE_GRACE=${HARNESS_NODE_GRACE:-180s}

if [[ -f "$HARNESS_DIR/pids" ]]; then "$cluster/down.sh"; fi
(cd "$root" && cargo build -p gpu-operator --quiet && cargo test -p e2e --test chaos --no-run --quiet)

"$cluster/up.sh" >/dev/null
trap '"$cluster/down.sh"' EXIT
# shellcheck source=/dev/null
source "$HARNESS_DIR/env"

# The standard fleet of tests/e2e.sh.
"$cluster/nodes.sh" 3 --prefix gpu
"$cluster/nodes.sh" 3 --prefix gpu-tainted --taint --cpu-nodes 0

cd "$root"
cargo test -p e2e --test chaos -- --nocapture --test-threads=1
