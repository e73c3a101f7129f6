#!/usr/bin/env bash
# Packages the kubectl plugin `kubectl gpu` for krew: an archive holding the operator binary
# under the plugin's name (`kubectl-gpu`: the binary runs as the plugin when called by that
# name) and the licence, its SHA-256, and krew's plugin manifest naming the archive's URL.
# The archive is reproducible: fixed order, owner and times, gzip without a name or time.
#
# usage: scripts/krew-plugin.sh BINARY VERSION URL_BASE OUT_DIR
#   BINARY    the gpu-operator binary, built for ARCH (default: this machine's)
#   VERSION   the release (v1.2.3)
#   URL_BASE  where the archive will be downloaded from (the manifest's uri is URL_BASE/ARCHIVE)
#   OUT_DIR   written: kubectl-gpu-linux-ARCH.tar.gz, its .sha256, gpu.yaml
#
# Install: kubectl krew install --manifest=OUT_DIR/gpu.yaml
#          (add --archive=OUT_DIR/kubectl-gpu-linux-ARCH.tar.gz for a local copy)
set -euo pipefail

if (($# != 4)); then
  sed -n '7,11p' "$0" >&2
  exit 2
fi
binary=$1 version=$2 url_base=${3%/} out=$4
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

case ${ARCH:-$(uname -m)} in
  x86_64 | amd64) arch=amd64 ;;
  aarch64 | arm64) arch=arm64 ;;
  *) echo "krew-plugin.sh: unknown architecture ${ARCH:-$(uname -m)} (set ARCH=amd64|arm64)" >&2; exit 2 ;;
esac
if [[ ! $version =~ ^v[0-9]+\.[0-9]+\.[0-9]+ ]]; then
  echo "krew-plugin.sh: VERSION $version is no semantic version with a leading v (krew needs one)" >&2
  exit 2
fi

mkdir -p "$out"
archive=kubectl-gpu-linux-$arch.tar.gz
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
install -m 0755 "$binary" "$staging/kubectl-gpu"
install -m 0644 "$root/LICENSE" "$staging/LICENSE"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
  -C "$staging" -cf - kubectl-gpu LICENSE | gzip -n -9 >"$out/$archive"
sha=$(sha256sum "$out/$archive" | cut -d' ' -f1)
echo "$sha  $archive" >"$out/$archive.sha256"

cat >"$out/gpu.yaml" <<EOF
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: gpu
spec:
  version: $version
  shortDescription: Explains why GPU pods are Pending, node by node
  description: |
    kubectl gpu doctor reads the GPU nodes, the operands of the GPU operator and the
    ClusterPolicy, and names each fault with the command that fixes it: a missing toleration,
    a node that advertises no GPU, a validator that is not ready, a runtime without the
    nvidia handler. kubectl gpu plan -f policy.yaml shows what applying a policy will do
    (pods that roll, nodes a driver upgrade cordons and drains, labels and advertised GPUs
    that change); kubectl gpu render prints what a policy deploys.
  caveats: |
    Reads nodes, pods and the ClusterPolicy with your kubeconfig's credentials; plan also
    sends the policy as a dry run (it needs create and update on clusterpolicies).
  platforms:
  - selector:
      matchLabels:
        os: linux
        arch: $arch
    uri: $url_base/$archive
    sha256: $sha
    bin: kubectl-gpu
    files:
    - from: kubectl-gpu
      to: .
    - from: LICENSE
      to: .
EOF
echo "$out/gpu.yaml"
