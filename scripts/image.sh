#!/usr/bin/env bash
# Builds the operator's OCI image without a container daemon (`make image`) and writes it as an
# OCI archive (a tar of an OCI image layout, what `skopeo copy oci-archive:FILE ...` reads).
#
# One layer, no base image, nothing that runs a shell: the files scripts/image-rootfs.sh writes
# (the static binary, Debian's CA bundle, passwd/group, the licence). User 65532:65532,
# entrypoint the binary, org.opencontainers.image.* labels (image/image.env has the fixed
# values; version and revision are what the binary's --version prints).
#
# Reproducible: the same sources, toolchain and ca-certificates package give the same digest.
# Every time in the image (layer and archive mtimes, config "created") is SOURCE_DATE_EPOCH, by
# default the commit time of HEAD; owners, modes and order are fixed. The archive is assembled
# by image/oci-image (go-containerregistry), built on first use into
# ~/.cache/gpu-operator/oci-image/.
#
# usage: scripts/image.sh [OUTPUT.oci.tar]
#   default output: $CARGO_TARGET_DIR/image/gpu-operator.oci.tar. Prints the manifest digest
#   as its last line.
#        scripts/image.sh --tool
#   builds (or reuses) image/oci-image and prints its path.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../image/image.env
source "$root/image/image.env"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/cargo-target}
out=${1:-$CARGO_TARGET_DIR/image/$IMAGE_NAME.oci.tar}

log() { echo "image.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# The archive writer: a small Go program over go-containerregistry, cached by the digest of its
# sources and the Go version.
oci_image_tool() {
  local module=$root/image/oci-image cache dest digest tmp
  command -v go >/dev/null 2>&1 || die "go is not installed (needed to build image/oci-image)"
  cache=${OCI_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/oci-image}
  digest=$( { go env GOVERSION; cat "$module/go.mod" "$module/go.sum" "$module/main.go"; } | sha256sum | cut -c1-12)
  dest=$cache/$digest
  if [[ ! -f $dest/.complete ]]; then
    log "building image/oci-image (go-containerregistry)"
    mkdir -p "$cache"
    tmp=$(mktemp -d "$cache/.build.XXXXXX")
    (cd "$module" && CGO_ENABLED=0 GOFLAGS="-trimpath -mod=readonly" go build -o "$tmp/oci-image" .) >&2 ||
      { rm -rf "$tmp"; die "building image/oci-image failed"; }
    touch "$tmp/.complete"
    rm -rf "$dest"
    mv "$tmp" "$dest"
  fi
  echo "$dest/oci-image"
}

if [[ ${1:-} == --tool ]]; then
  oci_image_tool
  exit 0
fi

# Rust host triple -> OCI platform.
host=$(rustc -vV | sed -n 's/^host: //p')
case $host in
  x86_64-unknown-linux-gnu) platform=linux/amd64 ;;
  aarch64-unknown-linux-gnu) platform=linux/arm64 ;;
  *) die "host $host: only x86_64/aarch64-unknown-linux-gnu builds are supported (static glibc)" ;;
esac

tool=$(oci_image_tool)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
"$root/scripts/image-rootfs.sh" "$stage/rootfs"

# Version and commit as the binary reports them: "gpu-operator 0.1.0 (commit abc...)".
read -r name version commit_word commit <<<"$("$stage/rootfs$IMAGE_BINARY" --version)" ||
  die "$IMAGE_BINARY --version printed nothing"
[[ $name == gpu-operator && $commit_word == "(commit" ]] ||
  die "unexpected --version output: $name $version $commit_word $commit"
commit=${commit%)}

epoch=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct 2>/dev/null || echo 0)}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)

mkdir -p "$(dirname "$out")"
log "writing $out (version $version, commit $commit, created $created)"
"$tool" build -o "$out" \
  --platform "$platform" \
  --tree "$stage/rootfs" \
  --user "$IMAGE_USER" \
  --entrypoint "$IMAGE_BINARY" \
  --env "PATH=$IMAGE_ENV_PATH" \
  --env "SSL_CERT_FILE=$IMAGE_CA_BUNDLE" \
  --label "org.opencontainers.image.title=$IMAGE_TITLE" \
  --label "org.opencontainers.image.description=$IMAGE_DESCRIPTION" \
  --label "org.opencontainers.image.licenses=$IMAGE_LICENSES" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$commit" \
  --label "org.opencontainers.image.created=$created" \
  --created "$epoch" \
  --ref-name "$version"
# The image's SBOM also beside the archive, for scanners and release assets.
sbom=${out%.oci.tar}.sbom.cdx.json
cp "$stage/rootfs$IMAGE_SBOM" "$sbom"
log "SBOM: $sbom"
