#!/usr/bin/env bash
# Supply-chain check of every crate in Cargo.lock with cargo-deny (`make lint`; policy in
# deny.toml): licences, bans (wildcards, duplicates reported), sources (crates.io only) and the
# RustSec advisories. cargo-deny is built from crates.io at the version pinned here, once, into
# ~/.cache/gpu-operator/tools/.
#
# The advisory database is a git repository on github.com. Where github.com cannot be reached
# (this project's build machines reach package registries only) the advisory check is reported
# as NOT RUN, loudly, and the other checks still gate; DENY_REQUIRE_ADVISORIES=1 makes an
# unreachable database a failure (release builds).
#
# usage: scripts/cargo-deny.sh [--tool]   (--tool: build or reuse cargo-deny, print its path)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=0.20.2
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/tools
dest=$cache/cargo-deny-$version

log() { echo "cargo-deny.sh: $*" >&2; }

if [[ ! -x $dest/bin/cargo-deny ]]; then
  log "building cargo-deny $version from crates.io (once)"
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/.cargo-deny.XXXXXX")
  # Its own target folder: the workspace's build cache is left alone. Unoptimised (--debug):
  # it checks one Cargo.lock in seconds either way, and an optimised build of its few hundred
  # crates cost a cold CI run minutes.
  if ! cargo install cargo-deny --version "$version" --locked --debug --root "$tmp" --target-dir "$tmp/target" --quiet; then
    rm -rf "$tmp"
    log "building cargo-deny failed"
    exit 1
  fi
  rm -rf "$tmp/target" "$dest"
  mv "$tmp" "$dest"
fi
deny=$dest/bin/cargo-deny
if [[ ${1:-} == --tool ]]; then
  echo "$deny"
  exit 0
fi

cd "$root"
checks=(bans licenses sources)
if curl -sf -o /dev/null -m 10 https://github.com/rustsec/advisory-db; then
  checks=(advisories "${checks[@]}")
elif [[ ${DENY_REQUIRE_ADVISORIES:-} == 1 ]]; then
  log "FAILED: the RustSec advisory database (github.com/rustsec/advisory-db) cannot be fetched"
  exit 1
else
  log "advisories NOT RUN: github.com/rustsec/advisory-db cannot be reached from this machine"
fi
"$deny" --locked check --hide-inclusion-graph "${checks[@]}"
log "passed: ${checks[*]}"
