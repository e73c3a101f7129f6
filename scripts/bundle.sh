#!/usr/bin/env bash
# Writes the OLM bundle (bundle/ by default): renders the Helm chart's operator Deployment with
# scripts/bundle-values.yaml and hands it to `gpu-operator bundle`, which adds the CSV's
# generated parts (RBAC from `gpu-operator rbac`, the CRD from `gpu-operator crd`, image
# variables, alm-examples from examples/). `make bundle` runs it; operator/tests/bundle.rs and
# tests/e2e/tests/olm.rs fail when the committed bundle differs from a fresh one.
#
# usage: scripts/bundle.sh PATH-TO-gpu-operator [OUTPUT-DIR]   (helm must be on PATH)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${1:?usage: scripts/bundle.sh PATH-TO-gpu-operator [OUTPUT-DIR]}
out=${2:-$root/bundle}
command -v helm >/dev/null 2>&1 || {
  echo "bundle.sh: helm is not on PATH (tests/cluster/build.sh prints a folder that holds it)" >&2
  exit 1
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Offline, as users render the chart: no cluster, Helm's default capabilities.
helm template gpu-operator "$root/charts/gpu-operator" --namespace gpu-operator \
  -f "$root/scripts/bundle-values.yaml" \
  --show-only templates/operator.yaml >"$tmp/deployment.yaml"
"$bin" bundle --deployment "$tmp/deployment.yaml" --output "$out"
