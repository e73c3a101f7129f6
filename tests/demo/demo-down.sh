#!/usr/bin/env bash
# `make demo-down`: stops the operator `make demo` started (by its recorded pid, checking the pid
# still runs the binary it started) and the demo's harness (tests/cluster/down.sh).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export HARNESS_PORT_BASE=${DEMO_PORT_BASE:-19400}
unset HARNESS_DIR
# shellcheck source=../cluster/lib.sh
source "$root/tests/cluster/lib.sh"

pid_file=$HARNESS_DIR/operator.pid
if [[ -f "$pid_file" ]]; then
  read -r pid binary <"$pid_file"
  ours() { [[ -e "/proc/$pid" && "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" == "$binary" ]]; }
  if ours; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do ours || break; sleep 0.1; done
    if ours; then
      echo "demo-down: operator ($pid) ignored SIGTERM for 10s; sending SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    echo "demo-down: stopped the operator ($pid)" >&2
  fi
  rm -f "$pid_file"
fi
# A container run-pod left behind (it was killed before it could stop it): deleted through runc.
if command -v runc >/dev/null 2>&1; then
  for state in "$HARNESS_DIR"/containers/*/state; do
    [[ -d $state ]] || continue
    for id in $(runc --root "$state" list -q 2>/dev/null); do
      runc --root "$state" delete --force "$id" 2>/dev/null || true
      echo "demo-down: deleted container $id" >&2
    done
  done
fi
"$root/tests/cluster/down.sh"
