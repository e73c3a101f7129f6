#!/usr/bin/env bash
# Builds monitoring-check (check/: Prometheus' rule parser and Grafana's dashboard schema at the
# versions check/go.mod pins) into a cache outside the clone, keyed by the Go version and the
# module's files, and reuses it when present. Prints the binary's path as its last line.
# A cold build downloads the modules it imports and compiles them (about 1 CPU-minute; 3 minutes
# of wall time on 2 busy cores).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
module="$here/check"
cache_root=${MONITORING_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/monitoring-check}

log() { echo "build.sh: $*" >&2; }

command -v go >/dev/null 2>&1 || { log "go is not installed (needed to build the rule and dashboard checker)"; exit 1; }
digest=$( { go env GOVERSION; cat "$module/go.mod" "$module/go.sum" "$module/main.go"; } | sha256sum | cut -c1-12)
dest="$cache_root/$digest"
binary="$dest/monitoring-check"

if [[ -f "$dest/.complete" && -x "$binary" ]]; then
  log "cached in $dest"
  echo "$binary"
  exit 0
fi

log "building the Prometheus rule and Grafana dashboard checker (a cold build takes minutes)"
started=$(date +%s)
mkdir -p "$cache_root"
tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(
  cd "$module"
  CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly" go build -o "$tmp/monitoring-check" .
) >&2
touch "$tmp/.complete"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
log "built in $(( $(date +%s) - started ))s: $dest"
echo "$binary"
