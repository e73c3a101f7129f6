#!/usr/bin/env bash
# Creates N fake GPU nodes (a T4 / A100 / H100 mix with NFD and GFD labels, capacity, nodeInfo)
# plus one CPU-only node on the running harness; `--taint` adds nvidia.com/gpu=present:NoSchedule,
# `--undiscovered` leaves out NFD's and GFD's labels (for real NFD to find the GPUs), `--os
# ubuntu:24.04` makes the GPU nodes report another OS than Ubuntu 22.04 (NFD's os_release labels).
#   nodes.sh N [--taint] [--prefix NAME] [--cpu-nodes M] [--undiscovered] [--os ID:VERSION]
#   nodes.sh --delete          removes every fake node
# The node shapes live in tests/e2e/src/nodes.rs, shared with the Rust tests.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
if [[ -z "${KUBECONFIG:-}" && -f "$HARNESS_DIR/env" ]]; then
  # shellcheck source=/dev/null
  source "$HARNESS_DIR/env"
fi
[[ -n "${KUBECONFIG:-}" ]] || { echo "nodes.sh: no harness running (KUBECONFIG unset, no $HARNESS_DIR/env)" >&2; exit 1; }

cd "$here/../.."
exec cargo run --quiet -p e2e --bin fake-nodes -- "$@"
