#!/usr/bin/env bash
# Starts a standard OCI registry (distribution's cmd/registry, what Docker's registry:3 image
# runs; built by build.sh) on 127.0.0.1:$REGISTRY_PORT, plain HTTP, with its storage under
# $HARNESS_DIR/registry. `make release` publishes to it in the release test
# (tests/e2e/tests/release.rs). It is recorded in $HARNESS_DIR/pids like the control plane, so
# down.sh stops it by pid. Only what needs a registry starts it: a harness does not.
#
# Reuses a registry this harness already runs. Prints its address (127.0.0.1:PORT) as the last
# line. Same environment as up.sh (the ports and HARNESS_DIR of lib.sh); start it after up.sh
# when both are wanted (up.sh refuses a work folder that records processes).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"

log() { echo "registry.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

address=127.0.0.1:$REGISTRY_PORT
mkdir -p "$HARNESS_DIR/logs"
work=$(cd "$HARNESS_DIR" && pwd)
pids_file=$work/pids

# ours PID BINARY: true while PID is still running BINARY (as down.sh checks it)
ours() { [[ -e "/proc/$1" && "$(readlink -f "/proc/$1/exe" 2>/dev/null)" == "$2" ]]; }

if [[ -f $pids_file ]]; then
  while read -r name pid binary; do
    if [[ $name == registry ]] && ours "$pid" "$binary"; then
      log "already running ($pid) on $address"
      echo "$address"
      exit 0
    fi
  done <"$pids_file"
fi

if (exec 3<>"/dev/tcp/127.0.0.1/$REGISTRY_PORT") 2>/dev/null; then
  die "port $REGISTRY_PORT on 127.0.0.1 is taken; set REGISTRY_PORT (or HARNESS_PORT_BASE) to a free port"
fi

bin=$("$here/build.sh" registry | tail -1)
binary=$(readlink -f "$bin/registry")

mkdir -p "$work/registry/storage"
# The registry's own configuration format (distribution's configuration/configuration.go).
# No debug or metrics listener: only the API, on loopback.
cat >"$work/registry/config.yml" <<EOF
version: 0.1
log:
  level: info
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $work/registry/storage
  delete:
    enabled: true
http:
  addr: $address
EOF

# OTEL_TRACES_EXPORTER=none: distribution v3 traces through OpenTelemetry, whose default
# exporter would dial a collector on loopback for every request.
OTEL_TRACES_EXPORTER=none nohup "$binary" serve "$work/registry/config.yml" \
  >"$work/logs/registry.log" 2>&1 </dev/null &
echo "registry $! $binary" >>"$pids_file"

for _ in $(seq 100); do
  if curl -sf "http://$address/v2/" >/dev/null; then
    log "ready on $address (storage $work/registry/storage, log $work/logs/registry.log)"
    echo "$address"
    exit 0
  fi
  ours "$!" "$binary" || break
  sleep 0.1
done
tail -n 20 "$work/logs/registry.log" >&2 || true
die "the registry did not answer on http://$address/v2/ (log: $work/logs/registry.log)"
