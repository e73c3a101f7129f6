#!/usr/bin/env bash
# Publishes a release to an OCI registry (`make release REGISTRY=... VERSION=...`), without a
# container daemon:
#
#   REGISTRY/gpu-operator:VERSION          the operator image, the archive `make image` builds
#                                          (scripts/image.sh), pushed with its digest unchanged
#   a referrer of that image               its CycloneDX SBOM, artifactType
#                                          application/vnd.cyclonedx+json, subject the image
#   oci://REGISTRY/charts/gpu-operator     the Helm chart, VERSION, whose operator.repository and
#                                          operator.version are the image above, so it installs
#                                          with no flags
#   OUT/images.txt                         every image the release runs or deploys by default,
#                                          one per line, for mirroring into an air-gapped registry
#   REGISTRY/gpu-operator-bundle:vVERSION  the OLM bundle (bundle/), its CSV naming the image
#                                          above by digest (scripts/olm-catalog.sh)
#   REGISTRY/gpu-operator-catalog:vVERSION the file-based catalog for a CatalogSource: channel
#                                          `stable` with this bundle, after the bundle images in
#                                          OLM_PREVIOUS_BUNDLES (environment, space-separated,
#                                          oldest first), each replaced by the next
#
# The arm64 image is published by a step not written yet; it goes where "Not published here"
# stands below. The kubectl-gpu archive and its krew
# manifest are scripts/krew-plugin.sh's, which needs the URL the archive will be downloaded
# from (a forge's release page, not an OCI registry).
#
# usage: scripts/release.sh REGISTRY [VERSION]
#   REGISTRY  host[:port][/path], for example ghcr.io/example or 127.0.0.1:5000/gpu-operator.
#             Plain HTTP only for 127.0.0.1 and localhost; anything else is HTTPS.
#             Credentials: oras and helm read ~/.docker/config.json (`oras login`, `helm
#             registry login`).
#   VERSION   the version this checkout builds (Cargo.toml, Chart.yaml); it may be left out,
#             and must equal it when given.
#   OUT       (environment) where the files go; default $CARGO_TARGET_DIR/publish/VERSION.
#
# Tools: oras, helm and opm, built from their Go modules by tests/cluster/build.sh (cached); the
# image as scripts/image.sh needs it (Rust, Go, libc6-dev, ca-certificates); python3 with
# PyYAML for the image list.
set -euo pipefail
shopt -s inherit_errexit

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../image/image.env
source "$root/image/image.env"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-operator/cargo-target}

log() { echo "release.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

registry=${1:-}
version=${2:-}
[[ -n $registry ]] || die "REGISTRY is not set: make release REGISTRY=host[:port][/path] (for example REGISTRY=127.0.0.1:5000/gpu-operator)"
registry=${registry%/}
registry=${registry#oci://}
[[ $registry =~ ^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._/-]+)?$ ]] ||
  die "REGISTRY=$registry is not host[:port][/path] in lower case (for example 127.0.0.1:5000/gpu-operator)"

chart_src=$root/charts/gpu-operator
chart_version=$(sed -n 's/^version: *//p' "$chart_src/Chart.yaml" | tr -d '"')
app_version=$(sed -n 's/^appVersion: *//p' "$chart_src/Chart.yaml" | tr -d '"')
[[ $chart_version == "$app_version" ]] ||
  die "charts/gpu-operator/Chart.yaml: version $chart_version and appVersion $app_version differ; set both to the release version"
version=${version:-$chart_version}
[[ $version == "$chart_version" ]] ||
  die "VERSION=$version, but this checkout builds $chart_version (Cargo.toml, charts/gpu-operator/Chart.yaml): bump the version there (xtask/tests/release.rs checks they agree) or leave VERSION unset"
command -v python3 >/dev/null && python3 -c 'import yaml' 2>/dev/null ||
  die "python3 with PyYAML is needed for the image list (apt-get install python3-yaml)"

# Plain HTTP only on loopback: a registry anywhere else is reached over TLS.
host=${registry%%/*}
plain=()
if [[ $host =~ ^(127\.0\.0\.1|localhost)(:[0-9]+)?$ ]]; then plain=(--plain-http); fi

out=${OUT:-$CARGO_TARGET_DIR/publish/$version}
# Emptied first, so nothing of an earlier run is taken for this one's; a folder that holds
# anything this script did not write is refused rather than emptied.
if [[ -d $out && -n $(ls -A "$out") && ! -f $out/.release-sh ]]; then
  die "OUT=$out holds files release.sh did not write; name a new or empty folder"
fi
rm -rf "$out"
mkdir -p "$out"
touch "$out/.release-sh"
out=$(cd "$out" && pwd)

bin=$("$root/tests/cluster/build.sh" helm oras | tail -1)
oras=$bin/oras
helm=$bin/helm

# --- The image: the reproducible archive, pushed as it is (the manifest digest stays).
log "building the image (scripts/image.sh)"
digest=$("$root/scripts/image.sh" "$out/$IMAGE_NAME.oci.tar" | tail -1)
[[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || die "scripts/image.sh printed no digest (last line: $digest)"
sbom=$out/$IMAGE_NAME.sbom.cdx.json
[[ -s $sbom ]] || die "scripts/image.sh wrote no SBOM at $sbom"

image=$registry/$IMAGE_NAME
log "pushing $image:$version ($digest)"
# oras reads the archive (a tar of an OCI layout) as it is; the tag is its ref.name annotation.
"$oras" cp --from-oci-layout ${plain:+--to-plain-http} "$out/$IMAGE_NAME.oci.tar:$version" "$image:$version" >&2
pushed=$("$oras" resolve "${plain[@]}" "$image:$version")
[[ $pushed == "$digest" ]] || die "$image:$version resolves to $pushed, not the built $digest"

# --- The SBOM as a referrer of the image (OCI 1.1: artifactType, subject). Its created time is
# the image's, so publishing the same commit again gives the same referrer.
epoch=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct 2>/dev/null || echo 0)}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
sbom_type=application/vnd.cyclonedx+json
log "attaching the SBOM to $image@$digest"
sbom_ref=$(cd "$out" && "$oras" attach "${plain[@]}" --artifact-type "$sbom_type" \
  --annotation "org.opencontainers.image.created=$created" \
  --format go-template --template '{{.digest}}' \
  "$image@$digest" "$(basename "$sbom"):$sbom_type")
[[ $sbom_ref =~ ^sha256:[0-9a-f]{64}$ ]] || die "oras attach printed no digest: $sbom_ref"

# --- The chart, with the image it was released with as its default (values.yaml's operator
# block: repository "" and version "" in a checkout, which makes an install fail naming them).
stage=$out/chart
mkdir "$stage"
cp -r "$chart_src" "$stage/"
python3 - "$stage/gpu-operator/values.yaml" "$registry" "$version" <<'EOF'
import re, sys
path, repository, version = sys.argv[1:]
text = open(path).read()
block = re.search(r"^operator:\n((?:  .*\n|\s*\n)*)", text, re.M)
if not block:
    sys.exit(f"{path}: no top-level operator: block")
body = block.group(1)
for key, value in (("repository", repository), ("version", version)):
    line = re.compile(rf'^  {key}: ""$', re.M)
    if len(line.findall(body)) != 1:
        sys.exit(f'{path}: operator.{key} is not the checkout\'s "" (one line `  {key}: ""`)')
    body = line.sub(f'  {key}: "{value}"', body)
open(path, "w").write(text[: block.start(1)] + body + text[block.end(1):])
EOF
"$helm" lint --strict "$stage/gpu-operator" >&2
"$helm" package --destination "$out" "$stage/gpu-operator" >&2
package=$out/gpu-operator-$version.tgz
[[ -f $package ]] || die "helm package wrote no $package"
chart=oci://$registry/charts
log "pushing the chart to $chart/gpu-operator:$version"
"$helm" push "$package" "$chart" "${plain[@]}" >&2

# --- The image list: the operator by tag and digest, then every operand image the operator
# deploys by default (the bundle's relatedImages, pinned by digest where one is known) and those
# only the chart's values name (the DRA driver).
python3 - "$image:$version@$digest" "$root/bundle/manifests/gpu-operator.clusterserviceversion.yaml" \
  "$stage/gpu-operator/values.yaml" >"$out/images.txt" <<'EOF'
import sys, yaml
operator, csv_path, values_path = sys.argv[1:]
csv = yaml.safe_load(open(csv_path))
images = {}
for entry in csv["spec"]["relatedImages"]:
    if entry["name"] != "gpu-operator":
        images[entry["image"].split("@")[0]] = entry["image"]
def walk(node):
    if isinstance(node, dict):
        parts = [node.get(k) for k in ("repository", "image", "version")]
        if all(isinstance(p, str) and p for p in parts):
            images.setdefault(f"{parts[0]}/{parts[1]}:{parts[2]}", f"{parts[0]}/{parts[1]}:{parts[2]}")
        for value in node.values():
            walk(value)
    elif isinstance(node, list):
        for value in node:
            walk(value)
values = yaml.safe_load(open(values_path))
walk({k: v for k, v in values.items() if k != "operator"})
print(operator)
driver = "nvcr.io/nvidia/driver:"
for tagged, ref in sorted(images.items()):
    if tagged.startswith(driver):
        # The operator appends each GPU node's OS to the driver's tag.
        print(f"# {ref}-<os><version>, for example -ubuntu22.04, -ubuntu24.04, -rhel9.6: the OS of your GPU nodes")
    else:
        print(ref)
EOF

# --- The OLM bundle, its operator image the one pushed above (the committed bundle names the
# placeholder registry of scripts/bundle-values.yaml), and the catalog listing it.
olm_bundle=$out/olm-bundle
cp -r "$root/bundle" "$olm_bundle"
python3 - "$olm_bundle/manifests/gpu-operator.clusterserviceversion.yaml" "$image@$digest" <<'EOF'
import sys, yaml
path, released = sys.argv[1:]
text = open(path).read()
placeholder = yaml.safe_load(text)["metadata"]["annotations"]["containerImage"]
if text.count(placeholder) < 3:
    sys.exit(f"{path}: the operator image {placeholder} is not in containerImage, the Deployment and relatedImages")
open(path, "w").write(text.replace(placeholder, released))
EOF
read -r -a previous <<<"${OLM_PREVIOUS_BUNDLES:-}"
olm=$("$root/scripts/olm-catalog.sh" "$registry" "$out/olm" "${previous[@]}" "$olm_bundle")
olm_bundle_ref=$(sed -n 's/^bundle=//p' <<<"$olm" | tail -1)
olm_catalog_ref=$(sed -n 's/^catalog=//p' <<<"$olm")
[[ -n $olm_bundle_ref && -n $olm_catalog_ref ]] || die "scripts/olm-catalog.sh printed no bundle or catalog: $olm"

# Not published here (a later step): linux/arm64 images (this machine builds linux/amd64 only;
# scripts/image.sh builds for the host). The krew plugin: scripts/krew-plugin.sh.

log "published $image:$version@$digest, SBOM $sbom_ref, chart $chart/gpu-operator:$version, OLM bundle $olm_bundle_ref and catalog $olm_catalog_ref; image list $out/images.txt"
cat <<EOF
image=$image:$version@$digest
sbom=$image@$sbom_ref
chart=$chart/gpu-operator
chart_version=$version
images=$out/images.txt
olm_bundle=$olm_bundle_ref
olm_catalog=$olm_catalog_ref
EOF
