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
# config_map_memory is a load test (thousands of large ConfigMaps, about 100 s); resilience
# restarts the API server and black-holes the leader's Lease renewals (about 300 s).
long_suites=(chaos release olm_catalog krew config_map_memory resilience)
is_long() { [[ " ${long_suites[*]} " == *" $1 "* ]]; }
for name in "${long_suites[@]}"; do
  [[ -f $root/tests/e2e/tests/$name.rs ]] || { echo "e2e.sh: long suite $name: no tests/e2e/tests/$name.rs" >&2; exit 2; }
done

# Build the tests and the operator binary they run before the harness starts, so compile time
# is not spent with it running. The tests run a copy of the binary (GPU_OPERATOR_BIN), so a
# build from another checkout that shares the target directory cannot swap it mid-run. The
# binary comes from `cargo test`, which builds it for the operator's integration tests with the
# features of the unit-test build (tokio's `test-util`, a dev-dependency's): `cargo build -p
# gpu-operator` resolves them without it and compiled tokio, hyper, kube and the operator again
# (about a minute of a cold CI run).
operator_bin=$(mktemp -t gpu-operator-e2e-bin.XXXXXX)
built=$(cd "$root" && cargo test -p gpu-operator --no-run --quiet --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu-operator"
            and m["target"]["kind"] == ["bin"] and not m["profile"]["test"] and m.get("executable")):
        print(m["executable"])')
cp "$built" "$operator_bin" && chmod 755 "$operator_bin"
export GPU_OPERATOR_BIN=${GPU_OPERATOR_BIN:-$operator_bin}
# The test binaries, by test file name, built once: each lane runs them directly (cargo would
# hold the build directory's lock while one lane's tests run).
declare -A binary
while read -r name path; do binary[$name]=$path; done < <(
  cd "$root" && cargo test -p e2e --tests --no-run --quiet --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])'
)

cd "$root"
# The test files of the suite asked for, in order; the chaos run restarts the API server and
# etcd, so it goes last (in the one lane the long suites run in) and no other test meets a
# control plane it left behind.
targets=()
for file in tests/e2e/tests/*.rs; do
  name=$(basename "$file" .rs)
  if is_long "$name"; then kind=long; else kind=core; fi
  if [[ $suite == all || $suite == "$kind" ]] && [[ $name != chaos ]]; then targets+=("$name"); fi
done
if [[ $suite != core ]]; then targets+=(chaos); fi

# E2E_LANES harnesses run the files side by side (`make e2e`: 3), each with its own control
# plane (ports HARNESS_PORT_BASE + 100 * lane), fleet and temp folder, so no test sees
# another's cluster. On 2 cores two lanes keep the CPU busy already (the control planes'
# work); a third took the warm suite from 25 to 24 minutes by filling the waits. Files go to
# the lane with the least work so far, longest first, by their seconds in a warm two-lane run
# (weights below; a file not listed counts 30).
lanes=${E2E_LANES:-1}
if [[ $suite != core ]]; then lanes=1; fi
declare -A weight=(
  [upgrade]=275 [apply]=219 [controller]=211 [migrate]=176 [helm]=121
  [nvidia_driver]=121 [sharing]=116 [hostile_tenant]=106 [render]=87 [gpu_readiness]=83 [plan]=82
  [contract]=76 [dra]=67 [teardown]=54 [driver_toolkit]=53 [vm_workloads]=49 [precompiled]=49
  [runtime_flavours]=46 [nfd]=44 [olm_install]=39 [doctor]=38 [confine]=37 [steady]=31
  [by_model]=29 [sandbox]=27 [node_pools]=27 [openshift]=25 [harness]=25 [olm]=23 [shipped]=20
  [probes]=19 [service_monitor]=17 [doctor_dra]=14 [nfd_real]=13 [crd]=9 [monitoring]=3
  [leader]=47
)
declare -a load lane_of
for ((i = 0; i < lanes; i++)); do load[i]=0 lane_of[i]=""; done
mapfile -t by_weight < <(for t in "${targets[@]}"; do echo "${weight[$t]:-30} $t"; done | sort -s -rn -k1,1 | awk '{print $2}')
for t in "${by_weight[@]}"; do
  best=0
  for ((i = 1; i < lanes; i++)); do ((load[i] < load[best])) && best=$i; done
  lane_of[best]+=" $t"
  load[best]=$((load[best] + ${weight[$t]:-30}))
done

# One lane: its harness and fleet, then its files in name order, every file run even after a
# failure; stops its harness however it ends.
run_lane() {
  local lane=$1 mine=" ${lane_of[$1]} " failed=() child=
  shift
  export HARNESS_PORT_BASE=$((base_port + 100 * lane))
  # The lane's harness folder, where lib.sh puts it for these ports (a harness an interrupted
  # run left there is stopped first).
  HARNESS_DIR=$(bash -c "unset HARNESS_DIR; source '$cluster/lib.sh'; echo \"\$HARNESS_DIR\"")
  export HARNESS_DIR
  trap '"$cluster/down.sh" >/dev/null 2>&1 || true' EXIT
  trap 'kill "$child" 2>/dev/null || true; exit 143' TERM
  "$cluster/down.sh" >/dev/null 2>&1 || true
  "$cluster/up.sh" >/dev/null
  # shellcheck source=/dev/null
  source "$HARNESS_DIR/env"
  # Files the tests write to the temp folder (kubeconfigs by name, say) stay in the lane's.
  export TMPDIR=$lanes_tmp/lane-$lane
  mkdir -p "$TMPDIR"
  # The standard fleet: 6 GPU nodes (2 each of T4, A100-40GB, H100), half of them tainted
  # like real GPU pools, and one CPU-only node.
  "$cluster/nodes.sh" 3 --prefix gpu
  "$cluster/nodes.sh" 3 --prefix gpu-tainted --taint --cpu-nodes 0
  # Tests run where cargo runs them: in the package's folder.
  cd "$root/tests/e2e"
  for t in "${targets[@]}"; do
    [[ $mine == *" $t "* ]] || continue
    echo "     Running tests/$t.rs (${binary[$t]})"
    "${binary[$t]}" --test-threads=1 "$@" &
    child=$!
    wait "$child" || failed+=("$t")
  done
  if ((${#failed[@]})); then
    echo "e2e.sh: lane $lane: failed: ${failed[*]}"
    return 1
  fi
}

base_port=$HARNESS_PORT_BASE
lanes_tmp=$(mktemp -d -t gpu-operator-e2e-lanes.XXXXXX)
trap 'kill "${lane_pids[@]}" 2>/dev/null || true; wait || true; rm -rf "$operator_bin" "$lanes_tmp"' EXIT
lane_pids=()
for ((i = 0; i < lanes; i++)); do
  if ((lanes == 1)); then
    run_lane 0 "$@" &
  else
    echo "e2e.sh: lane $i (ports $((base_port + 100 * i))+, about ${load[i]}s):${lane_of[i]}"
    run_lane "$i" "$@" >"$lanes_tmp/lane-$i.log" 2>&1 &
  fi
  lane_pids+=($!)
done
status=0
for ((i = 0; i < lanes; i++)); do
  if ! wait "${lane_pids[i]}"; then status=1; fi
  if ((lanes > 1)); then
    echo "e2e.sh: ---- lane $i ----"
    cat "$lanes_tmp/lane-$i.log"
  fi
done
exit "$status"
