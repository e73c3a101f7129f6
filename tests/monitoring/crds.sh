#!/usr/bin/env bash
# Prints the folder of the Prometheus Operator's CRDs (example/prometheus-operator-crd of its Go
# module, at PROMETHEUS_OPERATOR_VERSION in tests/cluster/versions.env) as its last line, after
# downloading the module into Go's module cache if it is not there yet (a few MB, once).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../cluster/versions.env
. "$here/../cluster/versions.env"
module=github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
dir=$(GOFLAGS=-mod=mod go mod download -json "$module" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
crds="$dir/example/prometheus-operator-crd"
[ -f "$crds/monitoring.coreos.com_servicemonitors.yaml" ] || {
  echo "crds.sh: no ServiceMonitor CRD in $module ($crds)" >&2
  exit 1
}
echo "$crds"
