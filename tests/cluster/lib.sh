# Shared settings of up.sh, down.sh and nodes.sh: where the harness lives and which ports it
# uses. Every port can be set on its own; HARNESS_PORT_BASE moves them all at once so that two
# harnesses (a test run and a demo, say) can run side by side.
# shellcheck shell=bash

HARNESS_PORT_BASE=${HARNESS_PORT_BASE:-16400}
ETCD_CLIENT_PORT=${ETCD_CLIENT_PORT:-$((HARNESS_PORT_BASE + 0))}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-$((HARNESS_PORT_BASE + 1))}
APISERVER_PORT=${APISERVER_PORT:-$((HARNESS_PORT_BASE + 2))}
CONTROLLER_MANAGER_PORT=${CONTROLLER_MANAGER_PORT:-$((HARNESS_PORT_BASE + 3))}
SCHEDULER_PORT=${SCHEDULER_PORT:-$((HARNESS_PORT_BASE + 4))}
KWOK_PORT=${KWOK_PORT:-$((HARNESS_PORT_BASE + 5))}
# The OCI registry, started only by what publishes to it (registry.sh).
REGISTRY_PORT=${REGISTRY_PORT:-$((HARNESS_PORT_BASE + 6))}
# The OLM catalog (`opm serve` of the catalog image) that the e2e olm_catalog starts and stops
# itself (tests/e2e/src/olm_catalog.rs reads the same variables).
OLM_CATALOG_PORT=${OLM_CATALOG_PORT:-$((HARNESS_PORT_BASE + 7))}
HARNESS_DIR=${HARNESS_DIR:-${TMPDIR:-/tmp}/gpu-operator-harness-$APISERVER_PORT}

# Rust builds go to a cache outside the clone; cargo's fingerprints include the compiler
# version, so a toolchain change rebuilds everything in it.
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/cargo-target}
export CARGO_TARGET_DIR
