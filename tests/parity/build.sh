#!/usr/bin/env bash
# Builds the device-plugin parity oracle (device-plugin/: the plugin's own config package at the
# pinned version, plus its start-up checks) into a cache outside the clone, keyed by the Go
# version and the wrapper module's files, and reuses it when present. Prints the binary's path
# as its last line.
#
# Exit status 3 means the oracle cannot be built on this machine because the plugin's module
# cannot be downloaded (no Go, or the module proxy does not serve it); callers may skip the
# comparison then. Any other failure is a real error.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
module="$here/device-plugin"
cache_root=${PARITY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/parity}

log() { echo "build.sh: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
  log "go is not installed"
  exit 3
fi
go_version=$(go env GOVERSION)
digest=$( {
  echo "$go_version"
  cat "$module/go.mod" "$module/main.go"
  if [[ -f "$module/go.sum" ]]; then cat "$module/go.sum"; fi
} | sha256sum | cut -c1-12)
dest="$cache_root/$digest"
binary="$dest/device-plugin-parity"

if [[ -f "$dest/.complete" && -x "$binary" ]]; then
  log "cached in $dest"
  echo "$binary"
  exit 0
fi

mkdir -p "$cache_root"
tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
cp "$module/go.mod" "$module/main.go" "$tmp/"
if [[ -f "$module/go.sum" ]]; then cp "$module/go.sum" "$tmp/"; fi

# Without a committed go.sum the checksums come from the module proxy and the checksum
# database, as `go mod tidy` would fetch them; the resulting go.sum is kept beside the binary.
log "downloading github.com/NVIDIA/k8s-device-plugin (cold builds take a minute)"
if ! (cd "$tmp" && GOFLAGS=-mod=mod go mod download github.com/NVIDIA/k8s-device-plugin) >"$tmp/download.log" 2>&1; then
  log "cannot download the plugin's module:"
  sed 's/^/  /' "$tmp/download.log" >&2
  exit 3
fi
(
  cd "$tmp"
  GOFLAGS=-mod=mod go mod tidy
  CGO_ENABLED=0 go build -trimpath -o "$tmp/out/device-plugin-parity" .
) >&2
mkdir -p "$tmp/out"
cp "$tmp/go.mod" "$tmp/go.sum" "$tmp/out/"
touch "$tmp/out/.complete"
rm -rf "$dest"
mv "$tmp/out" "$dest"
if [[ ! -f "$module/go.sum" ]]; then
  log "no go.sum is committed; the one used is $dest/go.sum (commit it as tests/parity/device-plugin/go.sum)"
fi
echo "$binary"
