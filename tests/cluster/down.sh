#!/usr/bin/env bash
# Stops exactly the processes up.sh recorded (by pid, checking each is still the binary we
# started, so a recycled pid is never signalled) and removes the harness folder.
# Same environment as up.sh (HARNESS_DIR or the ports of lib.sh).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"

log() { echo "down.sh: $*" >&2; }

pids_file="$HARNESS_DIR/pids"
if [[ ! -f "$pids_file" ]]; then
  log "nothing recorded in $HARNESS_DIR"
  rm -rf "$HARNESS_DIR"
  exit 0
fi

# ours PID BINARY: true while PID is still running BINARY
ours() { [[ -e "/proc/$1" && "$(readlink -f "/proc/$1/exe" 2>/dev/null)" == "$2" ]]; }

# Stop in reverse start order: kwok and the controllers before the API server, etcd last.
mapfile -t entries < <(tac "$pids_file")
for entry in "${entries[@]}"; do
  read -r name pid binary <<<"$entry"
  if ours "$pid" "$binary"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do ours "$pid" "$binary" || break; sleep 0.1; done
    if ours "$pid" "$binary"; then
      log "$name ($pid) ignored SIGTERM for 5s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
done

left=()
for entry in "${entries[@]}"; do
  read -r name pid binary <<<"$entry"
  if ours "$pid" "$binary"; then left+=("$name($pid)"); fi
done
if ((${#left[@]})); then
  log "still running: ${left[*]}; leaving $HARNESS_DIR in place"
  exit 1
fi
rm -rf "$HARNESS_DIR"
log "stopped ${#entries[@]} processes and removed $HARNESS_DIR"
