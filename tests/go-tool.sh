#!/usr/bin/env bash
# go-tool.sh MODULE BINARY CACHE_ROOT WHAT: builds the Go program in folder MODULE (its go.mod
# pins every dependency) as BINARY into CACHE_ROOT/<digest>/, the digest taken from the Go
# version and the module's go.mod, go.sum and .go files, and reuses that build when present.
# WHAT names the tool in the log. Prints the binary's path as its last line. The test checkers
# (tests/olm/build.sh, tests/monitoring/build.sh) call it; the harness tools have build.sh.
set -euo pipefail

module=$1 name=$2 cache_root=$3 what=$4
log() { echo "$(basename "$module")/$name: $*" >&2; }

command -v go >/dev/null 2>&1 || { log "go is not installed (needed to build $what)"; exit 1; }
digest=$( { go env GOVERSION; cat "$module/go.mod" "$module/go.sum" "$module"/*.go; } | sha256sum | cut -c1-12)
dest="$cache_root/$digest"
binary="$dest/$name"

# One build at a time per tool: a second caller (.ci/run builds the tools beside the Rust
# builds, `make e2e` asks again) waits for the first and then finds the result cached.
mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9

if [[ -f "$dest/.complete" && -x "$binary" ]]; then
  log "cached in $dest"
  echo "$binary"
  exit 0
fi

log "building $what (a cold build takes minutes)"
started=$(date +%s)
tmp=$(mktemp -d "$cache_root/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(
  cd "$module"
  CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly" go build -o "$tmp/$name" .
) >&2
touch "$tmp/.complete"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
log "built in $(( $(date +%s) - started ))s: $dest"
echo "$binary"
