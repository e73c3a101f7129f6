#!/usr/bin/env bash
# Builds the harness binaries (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok, helm, nfd-master, nfd-worker and the pod-sandbox they run in, OLM's olm-operator
# and catalog operator with csv-rbac, netns-run, krew, the OCI registry and oras, opm) from their
# Go modules into a cache outside the clone, one folder per tool keyed by its version, the Go
# toolchain and its go.sum, and reuses them when present.
# Prints the folder holding all binaries (symlinks) as its last line.
#
# usage: tests/cluster/build.sh [TOOL...]
#   TOOL: kubernetes etcd kwok helm nfd olm netns-run krew registry oras opm seccomp
# With tools named, builds only those and prints a folder holding only their binaries: the OLM
# bundle needs helm alone (`make chart`, `make bundle`), `make release` helm and oras.
# Without tools named it builds those every harness runs. The tools only `make release` and the
# long end-to-end suites use (`make test-long`) are built when named, each a cold build of
# minutes: the registry and oras, opm (builds and serves the OLM catalog), krew.
set -euo pipefail
# A failed build inside $(build ...) must stop the script, not be cached as complete.
shopt -s inherit_errexit

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

cache_root=${HARNESS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/harness}
mkdir -p "$cache_root"
go_version=$(go env GOVERSION)

log() { echo "build.sh: $*" >&2; }

tools=(kubernetes etcd kwok helm nfd olm netns-run krew registry oras opm)
# The container runner's seccomp profile (block at the end); built when named.
tools+=(seccomp)
for tool in "$@"; do
  if [[ " ${tools[*]} " != *" $tool "* ]]; then
    log "unknown tool $tool (one of: ${tools[*]})"
    exit 2
  fi
done
only=("$@")
# wanted TOOL: whether to build TOOL (every tool of a harness when none is named)
wanted() { ((${#only[@]} == 0)) || [[ " ${only[*]} " == *" $1 "* ]]; }
# named TOOL: whether TOOL was named (the tools only some tests need)
named() { [[ " ${only[*]} " == *" $1 "* ]]; }

# key TOOL VERSION -> folder name that changes whenever the inputs of the build change: the Go
# version, go.mod, go.sum and the wrapper module's own Go files (only go/nfd has any).
key() {
  local tool=$1 version=$2 digest
  digest=$( {
    echo "$go_version"
    cat "$here/go/$tool/go.mod" "$here/go/$tool/go.sum"
    find "$here/go/$tool" -name '*.go' -print0 | LC_ALL=C sort -z | xargs -0 -r cat
    # Only when set, so the folders of the tools built without tags keep their names.
    if [[ -n ${tags:-} ]]; then echo "tags $tags"; fi
  } | sha256sum | cut -c1-12)
  echo "$tool-$version-$digest"
}

# build TOOL VERSION LDFLAGS PACKAGE... : builds the packages of wrapper module go/TOOL, with the
# Go build tags in $tags when set (`tags=x build ...`)
build() {
  local tool=$1 version=$2 ldflags=$3
  shift 3
  local dest tmp started lock
  dest="$cache_root/$(key "$tool" "$version")"
  # One build of a tool at a time: a second caller (.ci/run builds the harness beside the Rust
  # builds, then `make e2e` asks again) waits for the first and finds it cached. The lock is
  # per tool, so `build.sh helm` is not held up by a Kubernetes build.
  exec {lock}>"$cache_root/.lock-$tool"
  flock "$lock"
  if [[ -f "$dest/.complete" ]]; then
    exec {lock}>&-
    log "$tool $version: cached in $dest"
    echo "$dest"
    return
  fi
  log "$tool $version: building $* (cold builds take minutes)"
  started=$(date +%s)
  tmp=$(mktemp -d "$cache_root/.build-$tool.XXXXXX")
  (
    cd "$here/go/$tool"
    CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly" go build ${tags:+-tags "$tags"} -ldflags "$ldflags" -o "$tmp/" "$@"
  ) >&2
  # go build names a /vN module's binary after the element before it: etcd's is "server".
  if [[ $tool == etcd ]]; then mv "$tmp/server" "$tmp/etcd"; fi
  # OLM's own CRDs, from the operator-framework/api module its build used (package crds).
  if [[ $tool == olm ]]; then
    mkdir "$tmp/olm-crds"
    cp "$(cd "$here/go/olm" && GOFLAGS=-mod=readonly go list -m -f '{{.Dir}}' github.com/operator-framework/api)"/crds/*.yaml "$tmp/olm-crds/"
  fi
  touch "$tmp/.complete"
  rm -rf "$dest"
  mv "$tmp" "$dest"
  log "$tool $version: built in $(( $(date +%s) - started ))s"
  exec {lock}>&-
  echo "$dest"
}

kube_ldflags() {
  local v=$1 major minor flags="-s -w" pkg
  major=${v#v}; major=${major%%.*}
  minor=${v#v*.}; minor=${minor%%.*}
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    flags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$flags"
}

dirs=()
if wanted kubernetes; then
  dirs+=("$(build kubernetes "$KUBERNETES_VERSION" "$(kube_ldflags "$KUBERNETES_VERSION")" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)")
fi
if wanted etcd; then dirs+=("$(build etcd "$ETCD_VERSION" "-s -w" go.etcd.io/etcd/server/v3)"); fi
if wanted kwok; then
  dirs+=("$(build kwok "$KWOK_VERSION" "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${KUBERNETES_VERSION#v}" \
    sigs.k8s.io/kwok/cmd/kwok)")
fi
if wanted helm; then
  dirs+=("$(build helm "$HELM_VERSION" "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
    helm.sh/helm/v3/cmd/helm)")
fi
# NFD as its image is built (its Dockerfile): host files are read under the /host- prefix.
if wanted nfd; then
  dirs+=("$(build nfd "$NFD_VERSION" "-s -w -X sigs.k8s.io/node-feature-discovery/pkg/version.version=$NFD_VERSION -X sigs.k8s.io/node-feature-discovery/pkg/utils/hostpath.pathPrefix=/host-" \
    sigs.k8s.io/node-feature-discovery/cmd/nfd-master sigs.k8s.io/node-feature-discovery/cmd/nfd-worker ./pod-sandbox)")
fi
# OLM's olm-operator (cmd/olm) and catalog operator (cmd/catalog, which resolves Subscriptions
# against a CatalogSource into InstallPlans); not the package server, an aggregated API server.
# With them csv-rbac (ours), which prints the RBAC OLM's resolver makes for a CSV.
if wanted olm; then
  dirs+=("$(build olm "$OLM_VERSION" \
    "-s -w -X github.com/operator-framework/operator-lifecycle-manager/pkg/version.OLMVersion=${OLM_VERSION#v}" \
    github.com/operator-framework/operator-lifecycle-manager/cmd/olm \
    github.com/operator-framework/operator-lifecycle-manager/cmd/catalog ./csv-rbac)")
fi
# Ours: runs a tool that binds every address (olm) in a network namespace of its own.
if wanted netns-run; then dirs+=("$(build netns-run local "-s -w" .)"); fi
# krew, which installs the kubectl-gpu plugin from the archive and manifest
# scripts/krew-plugin.sh writes (tests/e2e/tests/krew.rs).
if named krew; then
  dirs+=("$(build krew "$KREW_VERSION" "-s -w -X sigs.k8s.io/krew/internal/version.gitTag=$KREW_VERSION" \
    sigs.k8s.io/krew/cmd/krew)")
fi
# The OCI registry (distribution, what Docker's registry:3 image runs) that `make release`
# publishes to in the release test (tests/cluster/registry.sh starts it), and oras, the client
# that pushes the image layout and attaches its SBOM as a referrer (scripts/release.sh).
if named registry; then
  dirs+=("$(build registry "$REGISTRY_VERSION" "-s -w -X github.com/distribution/distribution/v3/version.version=$REGISTRY_VERSION" \
    github.com/distribution/distribution/v3/cmd/registry)")
fi
if named oras; then
  dirs+=("$(build oras "$ORAS_VERSION" "-s -w -X oras.land/oras/internal/version.BuildMetadata=" oras.land/oras/cmd/oras)")
fi
# Ours, for the operator image run under runc (e2e::container, tests/cluster/container-tools.sh):
# prints containerd's RuntimeDefault seccomp profile (its contrib/seccomp, pinned in go.mod).
if named seccomp; then dirs+=("$(build seccomp local "-s -w" .)"); fi
# opm (operator-registry's cmd/opm, at the version OLM_VERSION's OLM requires): renders the bundle
# image into the file-based catalog that `make release` publishes, and serves a catalog over gRPC
# for OLM's catalog operator (tests/e2e/tests/olm_catalog.rs); with it grpc-health-probe, which
# OLM's registry pod probes a catalog image with (the catalog image carries both).
# containers_image_openpgp as upstream builds opm: the other signature backends need cgo.
if named opm; then
  dirs+=("$(tags=containers_image_openpgp build opm "$OPM_VERSION" \
    "-s -w -X github.com/operator-framework/operator-registry/cmd/opm/version.opmVersion=$OPM_VERSION" \
    github.com/operator-framework/operator-registry/cmd/opm github.com/grpc-ecosystem/grpc-health-probe)")
fi

# One folder of symlinks for PATH, itself keyed by the tool folders it points into.
bin="$cache_root/bin-$(printf '%s\n' "${dirs[@]}" | sha256sum | cut -c1-12)"
if [[ ! -d "$bin" ]]; then
  tmp=$(mktemp -d "$cache_root/.bin.XXXXXX")
  for d in "${dirs[@]}"; do
    for f in "$d"/*; do ln -s "$f" "$tmp/"; done
  done
  # Another build.sh may have made the same folder meanwhile: then ours goes.
  mv -T "$tmp" "$bin" 2>/dev/null || rm -rf "$tmp"
fi
echo "$bin"
