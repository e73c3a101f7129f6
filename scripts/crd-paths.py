#!/usr/bin/env python3
"""Lists every field path of a CustomResourceDefinition's schema, one per line.

    scripts/crd-paths.py CRD.yaml > paths.txt

Each line is `PATH<TAB>TYPE<TAB>DEFAULT<TAB>ENUM`:
  PATH     dotted from the version's root schema (`spec.driver.upgradePolicy.drain.enable`);
           `[]` marks the items of an array, `{}` the values of a map (additionalProperties).
  TYPE     the schema's `type`, `int-or-string` for x-kubernetes-int-or-string, `any` for a
           field with neither (x-kubernetes-preserve-unknown-fields alone).
  DEFAULT  the server-side default as compact JSON, or `-` when there is none.
  ENUM     the allowed values as a compact JSON list, or `-` when the field has no enum.

The ClusterPolicy API test (crates/api/src/nvidia_compat_tests.rs) reads the same format from
operator/tests/fixtures/nvidia-v26.7-clusterpolicy-paths.txt, which is this script's output for
NVIDIA's v26.7.0 CRD (config/crd/bases/nvidia.com_clusterpolicies.yaml at tag v26.7.0 of
github.com/NVIDIA/gpu-operator). Only the first version of the CRD is listed.
"""

import json
import sys

import yaml


def schema_type(schema):
    if schema.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    return schema.get("type", "any")


def compact(value):
    return "-" if value is None else json.dumps(value, separators=(",", ":"), sort_keys=True)


def walk(schema, path, out):
    out.append((path, schema_type(schema), compact(schema.get("default")), compact(schema.get("enum"))))
    for name, child in sorted((schema.get("properties") or {}).items()):
        walk(child, f"{path}.{name}" if path else name, out)
    items = schema.get("items")
    if isinstance(items, dict):
        walk(items, f"{path}[]", out)
    additional = schema.get("additionalProperties")
    if isinstance(additional, dict):
        walk(additional, f"{path}{{}}", out)


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} CRD.yaml")
    with open(sys.argv[1], encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    crd = next(d for d in docs if d.get("kind") == "CustomResourceDefinition")
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    out = []
    for top in ("spec", "status"):
        if top in root.get("properties", {}):
            walk(root["properties"][top], top, out)
    for fields in out:
        print("\t".join(fields))


if __name__ == "__main__":
    main()
