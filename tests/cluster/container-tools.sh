#!/usr/bin/env bash
# What running the operator image as a kubelet would (tests/e2e/src/container.rs) needs:
# Debian's runc package, installed with apt-get when it is missing (as .ci/run installs what a
# bare machine lacks; needs root, as runc itself does), netns-run (the pod's own network
# namespace, with the API server's loopback port forwarded into it) and seccomp-default
# (containerd's RuntimeDefault profile), both built by build.sh. Prints the folder holding
# netns-run and seccomp-default as its last line.
#
# usage: tests/cluster/container-tools.sh
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "container-tools.sh: $*" >&2; }

if ! command -v runc >/dev/null 2>&1; then
  if [[ $(id -u) != 0 ]]; then
    log "runc is not installed and this is not root: apt-get install runc (containers need root here)"
    exit 1
  fi
  log "installing Debian's runc package"
  # Without recommends: criu (checkpointing) is not used.
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends runc; } >&2
fi
log "$(runc --version | head -1)"
"$here/build.sh" netns-run seccomp | tail -1
