#!/usr/bin/env bash
# Builds monitoring-check (check/: Prometheus' rule parser and Grafana's dashboard schema at the
# versions check/go.mod pins) into a cache outside the clone, or reuses it (tests/go-tool.sh).
# Prints the binary's path as its last line. A cold build downloads the modules it imports and
# compiles them (15 s on an idle 2-core machine).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$here/../go-tool.sh" "$here/check" monitoring-check \
  "${MONITORING_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/monitoring-check}" \
  "the Prometheus rule and Grafana dashboard checker"
