#!/usr/bin/env bash
# CI's image check (`make image-check`): builds the image twice and checks it.
#  1. `make image` twice gives the same digest: the second build goes to another file from a
#     fresh staging folder (other mtimes), and both archives must be identical byte for byte.
#  2. The archive is a valid OCI layout (index, manifest and config media types, every digest,
#     size and diff ID recomputed by go-containerregistry's validate), and prints what
#     `skopeo inspect`/`crane config` would: user, entrypoint, env, labels, the layer's files.
#  3. User, entrypoint and labels are those of image/image.env, version and revision those of
#     Cargo.toml and git; no shell in the image; the binary is static.
#  4. The binary extracted from the layer runs: `--version` names the version and the commit,
#     and `crd` prints the committed CRD; as root, also chrooted into the unpacked layer as the
#     image's user (no shell, no shared libraries there).
#
# usage: scripts/image-check.sh [ARCHIVE]   (default: the output of scripts/image.sh)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../image/image.env
source "$root/image/image.env"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/cargo-target}
archive=${1:-$CARGO_TARGET_DIR/image/$IMAGE_NAME.oci.tar}

log() { echo "image-check: $*" >&2; }
die() { log "FAILED: $*"; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

started=$SECONDS
first=$("$root/scripts/image.sh" "$archive" | tail -1)
log "first build: $first ($((SECONDS - started))s)"
started=$SECONDS
second=$("$root/scripts/image.sh" "$tmp/again.oci.tar" | tail -1)
log "second build: $second ($((SECONDS - started))s)"
[[ $first == sha256:* ]] || die "scripts/image.sh printed no digest: $first"
[[ $first == "$second" ]] || die "two builds of the same tree differ: $first vs $second"
cmp -s "$archive" "$tmp/again.oci.tar" || die "the two archives differ although their digests agree"
log "same digest twice: $first"

# What the image must say: the workspace version, and the commit build.rs embeds.
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml")
[[ -n $version ]] || die "no version in [workspace.package] of Cargo.toml"
commit=${GPU_OPERATOR_COMMIT:-$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)}

tool=$("$root/scripts/image.sh" --tool)

"$tool" check "$archive" \
  --user "$IMAGE_USER" \
  --entrypoint "$IMAGE_BINARY" \
  --label "org.opencontainers.image.title=$IMAGE_TITLE" \
  --label "org.opencontainers.image.description=$IMAGE_DESCRIPTION" \
  --label "org.opencontainers.image.licenses=$IMAGE_LICENSES" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$commit" \
  --require-label org.opencontainers.image.created \
  --absent /bin/sh --absent /bin/bash --absent /usr/bin/sh --absent /bin/busybox \
  --static "$IMAGE_BINARY" \
  --extract "$IMAGE_BINARY=$tmp/gpu-operator" \
  --extract "$IMAGE_CA_BUNDLE=$tmp/ca-certificates.crt" \
  --extract "/etc/passwd=$tmp/passwd" \
  --extract "$IMAGE_LICENSE=$tmp/LICENSE" \
  --extract "$IMAGE_SBOM=$tmp/sbom.cdx.json" \
  --rootfs "$tmp/rootfs" \
  >"$tmp/summary.json" || { cat "$tmp/summary.json" >&2; die "oci-image check"; }
cat "$tmp/summary.json"

# The summary names the tag: the version.
grep -q "\"refName\": \"$version\"" "$tmp/summary.json" || die "the archive's ref name is not $version"

# The files the layer carries work.
[[ $(grep -c 'BEGIN CERTIFICATE' "$tmp/ca-certificates.crt") -ge 100 ]] ||
  die "the CA bundle holds fewer than 100 certificates"
grep -q "^nonroot:x:${IMAGE_USER%%:*}:${IMAGE_USER##*:}:" "$tmp/passwd" || die "/etc/passwd lacks user ${IMAGE_USER}"
cmp -s "$tmp/LICENSE" "$root/LICENSE" || die "$IMAGE_LICENSE differs from LICENSE"

# The SBOM is the one tools/sbom writes for this tree (its tests hold it to `cargo tree` and
# Cargo.lock) and names the binary's version.
cargo run --quiet --locked --manifest-path "$root/Cargo.toml" -p sbom >"$tmp/sbom.expected.json" ||
  die "tools/sbom failed"
cmp -s "$tmp/sbom.cdx.json" "$tmp/sbom.expected.json" || die "$IMAGE_SBOM differs from what tools/sbom writes"
grep -q "\"purl\": \"pkg:cargo/gpu-operator@$version\"" "$tmp/sbom.cdx.json" ||
  die "$IMAGE_SBOM does not name gpu-operator $version"
log "SBOM: $(grep -c '"bom-ref": "pkg:cargo/' "$tmp/sbom.cdx.json") packages ($IMAGE_SBOM)"

printed=$("$tmp/gpu-operator" --version) || die "the image's binary does not run"
log "gpu-operator --version: $printed"
[[ $printed == "gpu-operator $version (commit $commit)" ]] ||
  die "--version printed '$printed', want 'gpu-operator $version (commit $commit)'"
"$tmp/gpu-operator" crd >"$tmp/crd.yaml" || die "the image's binary failed on crd"
cmp -s "$tmp/crd.yaml" "$root/crds/nvidia.com_clusterpolicies.yaml" ||
  die "the image's binary prints another CRD than crds/nvidia.com_clusterpolicies.yaml"

# Inside the image's own file system (nothing else: no shell, no libraries), as its user. Needs
# root for chroot; CI runs as root.
if [[ $(id -u) == 0 ]] && command -v chroot >/dev/null 2>&1; then
  in_image=$(chroot --userspec="$IMAGE_USER" "$tmp/rootfs" "$IMAGE_BINARY" --version) ||
    die "the binary does not run in the image's file system as $IMAGE_USER"
  [[ $in_image == "$printed" ]] || die "in the image's file system --version printed '$in_image'"
  chroot --userspec="$IMAGE_USER" "$tmp/rootfs" "$IMAGE_BINARY" crd | cmp -s - "$root/crds/nvidia.com_clusterpolicies.yaml" ||
    die "in the image's file system, crd printed another CRD"
  log "runs in the image's own file system as $IMAGE_USER (chroot): --version, crd"
else
  log "not root: skipped running the binary inside the image's file system (chroot)"
fi

size=$(stat -c %s "$archive")
log "passed: $archive, digest $first, $((size / 1024)) KiB"
