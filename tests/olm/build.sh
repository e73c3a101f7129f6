#!/usr/bin/env bash
# Builds validate-bundle (validate/: the operator-framework bundle validators at the version
# validate/go.mod pins) into a cache outside the clone, or reuses it (tests/go-tool.sh).
# Prints the binary's path as its last line. A cold build downloads the module graph and
# compiles it (a few minutes on 2 cores).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$here/../go-tool.sh" "$here/validate" validate-bundle \
  "${OLM_VALIDATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/olm-validate}" \
  "the operator-framework bundle validators"
