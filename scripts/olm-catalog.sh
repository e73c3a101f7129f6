#!/usr/bin/env bash
# Publishes OLM bundle images and the file-based catalog (FBC) that lists them, to an OCI
# registry, without a container daemon (`make release` runs it; so does the e2e olm_catalog):
#
#   REGISTRY/gpu-operator-bundle:vVERSION    one per bundle folder given: its manifests/ and
#                                            metadata/ as one layer, with the standard
#                                            operators.operatorframework.io.bundle.* labels
#                                            taken from metadata/annotations.yaml
#   REGISTRY/gpu-operator-catalog:vVERSION   the catalog (VERSION of the last bundle): FBC at
#                                            /configs (label operators.operatorframework.io.
#                                            index.configs.v1), with opm as entrypoint and
#                                            grpc_health_probe as OLM's registry pod probes it
#   OUT/catalog/                             the same FBC, for `opm serve OUT/catalog`
#
# The catalog is `opm render` of every bundle image (pulled back from the registry, so what is
# listed is what was pushed), one olm.package (default channel `stable`) and one olm.channel
# `stable` whose entries chain in the order given: each entry `replaces` the one before it and
# carries its CSV's olm.skipRange annotation as `skipRange`.
#
# usage: scripts/olm-catalog.sh REGISTRY OUT BUNDLE...
#   REGISTRY  host[:port][/path]; plain HTTP only on 127.0.0.1 and localhost
#   OUT       an empty or new folder for the archives and the FBC
#   BUNDLE    oldest first: a bundle folder (built and pushed here) or the reference of a bundle
#             image already published (rendered only; how a release keeps its predecessors in
#             the channel, OLM_PREVIOUS_BUNDLES in scripts/release.sh)
#
# Tools: opm, oras (tests/cluster/build.sh opm oras), image/oci-image (scripts/image.sh --tool),
# python3 with PyYAML. SOURCE_DATE_EPOCH (default: HEAD's commit time) is every time in the
# images, so the same inputs give the same digests.
set -euo pipefail
shopt -s inherit_errexit

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "olm-catalog.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

(($# >= 3)) || die "usage: scripts/olm-catalog.sh REGISTRY OUT BUNDLE..."
registry=${1%/}
out=$2
shift 2
command -v python3 >/dev/null && python3 -c 'import yaml' 2>/dev/null ||
  die "python3 with PyYAML is needed (apt-get install python3-yaml)"

host=${registry%%/*}
plain=() use_http=()
if [[ $host =~ ^(127\.0\.0\.1|localhost)(:[0-9]+)?$ ]]; then plain=(--plain-http) use_http=(--use-http); fi

mkdir -p "$out"
[[ -z $(ls -A "$out") ]] || die "OUT=$out is not empty"
out=$(cd "$out" && pwd)

bin=$("$root/tests/cluster/build.sh" opm oras | tail -1)
opm=$bin/opm
oras=$bin/oras
tool=$("$root/scripts/image.sh" --tool | tail -1)
epoch=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct 2>/dev/null || echo 0)}

# image_push ARCHIVE REF: pushes an archive oci-image wrote and checks the digest arrived.
image_push() {
  local archive=$1 ref=$2 tag=${2##*:} digest pushed
  digest=$(tail -1 "$archive.digest")
  "$oras" cp --from-oci-layout ${plain:+--to-plain-http} "$archive:$tag" "$ref" >&2
  pushed=$("$oras" resolve "${plain[@]}" "$ref")
  [[ $pushed == "$digest" ]] || die "$ref resolves to $pushed, not the built $digest"
  echo "$ref@$digest"
}

# csv_field BUNDLE_DIR FIELD: name, version, skipRange or replaces of the bundle's CSV.
csv_field() {
  python3 - "$1" "$2" <<'EOF'
import glob, sys, yaml
folder, field = sys.argv[1:]
found = [d for f in glob.glob(f"{folder}/manifests/*.yaml") for d in [yaml.safe_load(open(f))]
         if isinstance(d, dict) and d.get("kind") == "ClusterServiceVersion"]
if len(found) != 1:
    sys.exit(f"{folder}/manifests: {len(found)} ClusterServiceVersions, want 1")
csv = found[0]
value = {"name": csv["metadata"]["name"], "version": csv["spec"]["version"],
         "skipRange": (csv["metadata"].get("annotations") or {}).get("olm.skipRange", ""),
         "replaces": csv["spec"].get("replaces", "")}[field]
print(value)
EOF
}

refs=()
for bundle in "$@"; do
  if [[ ! -d $bundle ]]; then
    refs+=("$bundle")
    continue
  fi
  [[ -f $bundle/metadata/annotations.yaml && -d $bundle/manifests ]] ||
    die "$bundle is not a bundle folder (manifests/, metadata/annotations.yaml)"
  version=$(csv_field "$bundle" version)
  # The bundle format's labels are the annotations, as `operator-sdk bundle` writes them into
  # bundle.Dockerfile; OLM and opm read them from the image config.
  labels=()
  while IFS= read -r label; do labels+=(--label "$label"); done < <(python3 - "$bundle/metadata/annotations.yaml" <<'EOF'
import sys, yaml
for key, value in sorted(yaml.safe_load(open(sys.argv[1]))["annotations"].items()):
    print(f"{key}={value}")
EOF
)
  stage=$out/bundle-$version
  mkdir -p "$stage/rootfs"
  cp -r "$bundle/manifests" "$bundle/metadata" "$stage/rootfs/"
  archive=$out/gpu-operator-bundle-$version.oci.tar
  "$tool" build -o "$archive" --tree "$stage/rootfs" "${labels[@]}" \
    --created "$epoch" --ref-name "v$version" \
    --comment "the OLM bundle (manifests/, metadata/) of gpu-operator $version" >"$archive.digest"
  rm -rf "$stage"
  ref=$(image_push "$archive" "$registry/gpu-operator-bundle:v$version")
  log "pushed bundle $ref"
  # By digest: the catalog names exactly what was pushed.
  refs+=("$registry/gpu-operator-bundle@${ref##*@}")
done

# --- The FBC: rendered bundles, then the package and its channel.
mkdir -p "$out/catalog/gpu-operator"
rendered=$out/rendered.json
# opm pulls through containers/image, which refuses to run without a signature policy. Where the
# machine has none (no containers-common), the one containers-common installs by default: the
# bundles are named by digest, which is the check that holds here.
if [[ -z ${CONTAINERS_POLICY_JSON:-} && ! -f $HOME/.config/containers/policy.json &&
  ! -f /etc/containers/policy.json && ! -f /usr/share/containers/policy.json ]]; then
  echo '{"default": [{"type": "insecureAcceptAnything"}]}' >"$out/policy.json"
  export CONTAINERS_POLICY_JSON=$out/policy.json
fi
"$opm" render "${use_http[@]}" --output json "${refs[@]}" >"$rendered"
python3 - "$rendered" "$out/catalog/gpu-operator/catalog.json" <<'EOF'
import base64, json, sys
rendered, target = sys.argv[1:]
decoder, text, pos, bundles = json.JSONDecoder(), open(rendered).read(), 0, []
while True:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text):
        break
    blob, pos = decoder.raw_decode(text, pos)
    if blob.get("schema") == "olm.bundle":
        bundles.append(blob)
if not bundles:
    sys.exit("opm render gave no olm.bundle")
packages = {b["package"] for b in bundles}
if packages != {"gpu-operator"}:
    sys.exit(f"bundles of packages {sorted(packages)}, want gpu-operator only")
def csv_of(bundle):
    for p in bundle["properties"]:
        if p["type"] == "olm.bundle.object":
            obj = json.loads(base64.b64decode(p["value"]["data"]))
            if obj.get("kind") == "ClusterServiceVersion":
                return obj
    sys.exit(f"bundle {bundle['name']} has no ClusterServiceVersion object")
entries = []
for b in bundles:
    entry = {"name": b["name"]}
    if entries:
        entry["replaces"] = entries[-1]["name"]
    skip_range = (csv_of(b)["metadata"].get("annotations") or {}).get("olm.skipRange")
    if skip_range:
        entry["skipRange"] = skip_range
    entries.append(entry)
package = {"schema": "olm.package", "name": "gpu-operator", "defaultChannel": "stable"}
channel = {"schema": "olm.channel", "package": "gpu-operator", "name": "stable", "entries": entries}
with open(target, "w") as f:
    for blob in [package, channel, *bundles]:
        json.dump(blob, f, indent=2, sort_keys=True)
        f.write("\n")
EOF
rm "$rendered"
"$opm" validate "$out/catalog" >&2

# --- The catalog image: the FBC, and opm to serve it as OLM's registry pod runs it.
last=$(python3 -c 'import json,sys
d=json.JSONDecoder(); t=open(sys.argv[1]).read(); p=0; last=None
while p < len(t):
    while p < len(t) and t[p].isspace(): p += 1
    if p >= len(t): break
    b, p = d.raw_decode(t, p)
    if b.get("schema") == "olm.channel": last = b["entries"][-1]["name"]
print(last.split(".v", 1)[1])' "$out/catalog/gpu-operator/catalog.json")
stage=$out/catalog-image
mkdir -p "$stage/rootfs/configs" "$stage/rootfs/bin"
cp -r "$out/catalog/gpu-operator" "$stage/rootfs/configs/"
cp "$opm" "$stage/rootfs/bin/opm"
cp "$bin/grpc-health-probe" "$stage/rootfs/bin/grpc_health_probe"
archive=$out/gpu-operator-catalog-$last.oci.tar
"$tool" build -o "$archive" --tree "$stage/rootfs" \
  --label operators.operatorframework.io.index.configs.v1=/configs \
  --user 65532:65532 --entrypoint /bin/opm --cmd serve --cmd /configs \
  --created "$epoch" --ref-name "v$last" \
  --comment "the OLM file-based catalog of gpu-operator up to $last, and opm" >"$archive.digest"
rm -rf "$stage"
catalog=$(image_push "$archive" "$registry/gpu-operator-catalog:v$last")
log "pushed catalog $catalog"
printf 'bundle=%s\n' "${refs[@]}"
echo "catalog=$catalog"
echo "fbc=$out/catalog"
