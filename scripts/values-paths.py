#!/usr/bin/env python3
"""Lists every key path of a Helm values file with its value, one per line.

    scripts/values-paths.py values.yaml > paths.txt

Each line is `PATH<TAB>VALUE`:
  PATH   the keys from the top, joined with `.`; a key holding `.` or `"` is written in double
         quotes with `"` doubled (`operator.annotations."openshift.io/scc"`).
  VALUE  the value as compact JSON. Mappings are descended; scalars, lists and empty mappings
         are leaves (a list is one value, as `--set`/`-f` replace lists whole).

The chart test tests/e2e/tests/helm.rs rebuilds a values file from
operator/tests/fixtures/nvidia-v26.7-values-paths.txt, this script's output for NVIDIA's
v26.7.0 default values (deployments/gpu-operator/values.yaml at tag v26.7.0 of
github.com/NVIDIA/gpu-operator), and renders the chart with it.
"""

import json
import sys

import yaml


def segment(key):
    key = str(key)
    if "." in key or '"' in key:
        return '"' + key.replace('"', '""') + '"'
    return key


def walk(value, path, out):
    if isinstance(value, dict) and value:
        for key, child in value.items():
            walk(child, path + [segment(key)], out)
    else:
        out.append((".".join(path), json.dumps(value, separators=(",", ":"), sort_keys=True)))


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} values.yaml")
    with open(sys.argv[1], encoding="utf-8") as f:
        values = yaml.safe_load(f) or {}
    out = []
    walk(values, [], out)
    for path, value in out:
        print(f"{path}\t{value}")


if __name__ == "__main__":
    main()
