#!/usr/bin/env bash
# Builds validate-bundle (validate/: the operator-framework bundle validators at the version
# validate/go.mod pins) into a cache outside the clone, keyed by the Go version and the wrapper
# module's files, and reuses it when present. Prints the binary's path as its last line.
# A cold build downloads the module graph and compiles it (a few minutes on 2 cores).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
module="$here/validate"
cache_root=${OLM_VALIDATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/olm-validate}

log() { echo "build.sh: $*" >&2; }

command -v go >/dev/null 2>&1 || { log "go is not installed (needed to build the bundle validators)"; exit 1; }
digest=$( { go env GOVERSION; cat "$module/go.mod" "$module/go.sum" "$module/main.go"; } | sha256sum | cut -c1-12)
dest="$cache_root/$digest"
binary="$dest/validate-bundle"

if [[ -f "$dest/.complete" && -x "$binary" ]]; then
  log "cached in $dest"
  echo "$binary"
  exit 0
fi

log "building the operator-framework bundle validators (cold builds take minutes)"
started=$(date +%s)
mkdir -p "$cache_root"
tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(
  cd "$module"
  CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly" go build -o "$tmp/validate-bundle" .
) >&2
touch "$tmp/.complete"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
log "built in $(( $(date +%s) - started ))s: $dest"
echo "$binary"
