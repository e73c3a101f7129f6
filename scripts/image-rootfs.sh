#!/usr/bin/env bash
# Writes the operator image's whole file system into DIR: the one definition of what the image
# holds, used by scripts/image.sh (`make image`) and by the Containerfile's build stage.
#
#   /usr/local/bin/gpu-operator          static binary (glibc linked in: +crt-static), 0755
#   /etc/ssl/certs/ca-certificates.crt   Debian's ca-certificates package, concatenated, 0644
#   /etc/passwd, /etc/group              root and nonroot (65532), from image/rootfs/, 0644
#   /licenses/LICENSE                    Apache-2.0, 0644
#   /usr/share/doc/gpu-operator/sbom.cdx.json  CycloneDX SBOM of what the binary links (tools/sbom), 0644
#
# No shell and nothing else. The binary is the same in any checkout: --remap-path-prefix takes
# the checkout, Cargo's home and the target folder out of it.
#
# usage: scripts/image-rootfs.sh DIR   (DIR must not exist yet)
#   needs cargo, a *-linux-gnu Rust host with static glibc (libc6-dev), Debian's ca-certificates
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../image/image.env
source "$root/image/image.env"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/cargo-target}
dir=${1:?usage: scripts/image-rootfs.sh DIR}

log() { echo "image-rootfs.sh: $*" >&2; }
die() { log "$*"; exit 1; }

[[ ! -e $dir ]] || die "$dir exists already"
host=$(rustc -vV | sed -n 's/^host: //p')
[[ $host == *-unknown-linux-gnu ]] || die "host $host: the image needs a *-unknown-linux-gnu Rust toolchain (static glibc)"
[[ -n $(find /usr/lib /usr/lib64 -name libc.a -print -quit 2>/dev/null) ]] ||
  die "no static glibc (libc.a): install libc6-dev"
command -v dpkg-query >/dev/null 2>&1 ||
  die "dpkg-query not found: the CA bundle comes from Debian's ca-certificates package"
ca_version=$(dpkg-query -W -f='${db:Status-Status} ${Version}' ca-certificates 2>/dev/null) || true
[[ $ca_version == "installed "* ]] ||
  die "Debian's ca-certificates package is not installed (apt-get install ca-certificates)"
log "ca-certificates ${ca_version#installed }"

# --target keeps RUSTFLAGS off build scripts and proc macros, which cannot be static.
cargo_home=${CARGO_HOME:-$HOME/.cargo}
log "cargo build --profile image --target $host (static)"
RUSTFLAGS="-C target-feature=+crt-static --remap-path-prefix=$root=/src --remap-path-prefix=$cargo_home=/cargo --remap-path-prefix=$CARGO_TARGET_DIR=/target" \
  cargo build --quiet --locked --manifest-path "$root/Cargo.toml" --profile image --target "$host" \
  -p gpu-operator --bin gpu-operator

mkdir -p "$dir"
install -D -m 0755 "$CARGO_TARGET_DIR/$host/image/gpu-operator" "$dir$IMAGE_BINARY"
install -D -m 0644 "$root/LICENSE" "$dir$IMAGE_LICENSE"
# The SBOM from the same lock file and target as the binary (no RUSTFLAGS: a host tool).
log "sbom --target $host"
mkdir -p "$(dirname "$dir$IMAGE_SBOM")"
cargo run --quiet --locked --manifest-path "$root/Cargo.toml" -p sbom -- --target "$host" >"$dir$IMAGE_SBOM"
chmod 0644 "$dir$IMAGE_SBOM"
(cd "$root/image/rootfs" && find . -type f) | while read -r file; do
  install -D -m 0644 "$root/image/rootfs/$file" "$dir/${file#./}"
done
# As update-ca-certificates builds the bundle: every certificate of the package, each ending in
# a newline, in a fixed order.
mkdir -p "$(dirname "$dir$IMAGE_CA_BUNDLE")"
dpkg-query -L ca-certificates | grep -E '^/usr/share/ca-certificates/mozilla/.*\.crt$' | LC_ALL=C sort |
  while read -r cert; do sed -e '$a\' "$cert"; done >"$dir$IMAGE_CA_BUNDLE"
chmod 0644 "$dir$IMAGE_CA_BUNDLE"
[[ -s $dir$IMAGE_CA_BUNDLE ]] || die "ca-certificates holds no certificates"
