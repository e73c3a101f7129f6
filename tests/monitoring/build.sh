#!/usr/bin/env bash
# Builds monitoring-check (check/: Prometheus' rule parser, config loader, scrape client and
# exposition parser, and Grafana's dashboard schema, at the versions check/go.mod pins) into a
# cache outside the clone, or reuses it (tests/go-tool.sh). Prints the binary's path as its last
# line. A cold build downloads the modules it imports and compiles them: Prometheus' config
# package brings its remote-write authenticators (Azure, Google, AWS SigV4) along, so with
# empty Go caches this takes about 3 minutes on a shared 2-core machine, 25 s with Go's build
# cache warm.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$here/../go-tool.sh" "$here/check" monitoring-check \
  "${MONITORING_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/monitoring-check}" \
  "the Prometheus rule and Grafana dashboard checker"
