#!/usr/bin/env bash
# Runs the end-to-end tests: starts a harness (tests/cluster/up.sh) with a small fake GPU fleet,
# runs every test of the e2e crate against it one at a time, and stops it again, also on failure.
# Extra arguments go to the test binaries (e.g. a test name filter).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cluster=$root/tests/cluster
# shellcheck source=cluster/lib.sh
source "$cluster/lib.sh"
# The harness is started here: a test that finds no cluster (or no harness tool) fails instead of
# skipping itself (tests/e2e/src/cluster.rs).
export E2E_REQUIRE_CLUSTER=1

# E2E_SUITE picks the test files: core (`make test`, what CI runs), long (`make test-long`: the
# suites that run for minutes, load the control plane or need the release tools: a registry,
# oras, opm, OLM's catalog operator, krew, runc), or all (the default).
suite=${E2E_SUITE:-all}
case $suite in core | long | all) ;; *) echo "e2e.sh: E2E_SUITE=$suite: one of core, long, all" >&2; exit 2 ;; esac
# config_map_memory is a load test (thousands of large ConfigMaps, about 100 s).
long_suites=(chaos release olm_catalog krew config_map_memory)
is_long() { [[ " ${long_suites[*]} " == *" $1 "* ]]; }
for name in "${long_suites[@]}"; do
  [[ -f $root/tests/e2e/tests/$name.rs ]] || { echo "e2e.sh: long suite $name: no tests/e2e/tests/$name.rs" >&2; exit 2; }
done

# A harness left behind by an interrupted run is stopped first.
if [[ -f "$HARNESS_DIR/pids" ]]; then "$cluster/down.sh"; fi

# Build the tests and the operator binary they run before the harness starts, so compile time
# is not spent with it running. The tests run a copy of the binary (GPU_OPERATOR_BIN), so a
# build from another checkout that shares the target directory cannot swap it mid-run.
operator_bin=$(mktemp -t gpu-operator-e2e-bin.XXXXXX)
built=$(cd "$root" && cargo build -p gpu-operator --quiet --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu-operator" and m.get("executable"):
        print(m["executable"])')
cp "$built" "$operator_bin" && chmod 755 "$operator_bin"
export GPU_OPERATOR_BIN=${GPU_OPERATOR_BIN:-$operator_bin}
(cd "$root" && cargo test -p e2e --tests --no-run --quiet)

"$cluster/up.sh" >/dev/null
trap '"$cluster/down.sh"; rm -f "$operator_bin"' EXIT
# shellcheck source=/dev/null
source "$HARNESS_DIR/env"
export HARNESS_PORT_BASE

# The standard fleet: 6 GPU nodes (2 each of T4, A100-40GB, H100), half of them tainted like
# real GPU pools, and one CPU-only node.
"$cluster/nodes.sh" 3 --prefix gpu
"$cluster/nodes.sh" 3 --prefix gpu-tainted --taint --cpu-nodes 0

cd "$root"
# The test files of the suite asked for, in order; the chaos run restarts the API server and
# etcd, so it goes last and no other test meets a control plane it left behind.
targets=()
for file in tests/e2e/tests/*.rs; do
  name=$(basename "$file" .rs)
  if is_long "$name"; then kind=long; else kind=core; fi
  if [[ $suite == all || $suite == "$kind" ]] && [[ $name != chaos ]]; then targets+=(--test "$name"); fi
done
if ((${#targets[@]})); then cargo test -p e2e "${targets[@]}" -- --test-threads=1 "$@"; fi
if [[ $suite != core ]]; then cargo test -p e2e --test chaos -- --test-threads=1 "$@"; fi
