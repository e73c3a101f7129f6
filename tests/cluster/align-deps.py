#!/usr/bin/env python3
"""Aligns the shared Go dependencies of the harness tools CI builds beside each other.

Go's build cache keys a compiled package by its module's selected version and by the compiled
form of everything it imports, so two tools reuse one compilation of client-go, api,
apimachinery, gRPC or protobuf only when they select exactly the same versions of the whole
closure below it. Each wrapper module resolves its own versions, and a cold CI machine compiled
those packages once per tool: minutes of CPU each (measured in tests/cluster/README.md).

This raises every module that two or more of TOOLS compile to the highest version any of them
selects (raised requirements: only upgrades, which Go's compatibility rule allows), until they
agree, then tidies each go.mod it changed. A wrapper that replaces the `k8s.io/*` staging
modules (NFD's, which builds against k8s.io/kubernetes itself) moves its replacements and
k8s.io/kubernetes with k8s.io/api.
Kubernetes' own wrapper stays as its release pins it: a replaced module keeps the version it was
required at in the build cache's key, so a downgrade by `replace` would not share anyway, and
the API server is what every test talks to.

usage: tests/cluster/align-deps.py [--check]
  --check: change nothing; list the modules that differ and exit 1 if any do.
Run it after bumping any version in versions.env (README.md, "Bumping a version").
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The modules built beside each other in every CI run (`make tools`) that share Kubernetes'
# client libraries. etcd keeps its own (no client-go; its server is built with its release's gRPC
# and etcd libraries); helm needs the next Kubernetes minor's libraries (k8s.io/* v0.37), which
# would pull every other tool a release ahead, and so would the monitoring checker's Prometheus.
# The tools only the long suites build (krew, the registry, oras, opm) keep theirs.
TOOLS = [ROOT / "tests/cluster/go" / name for name in ("kwok", "nfd", "olm")] + [
    ROOT / "tests/olm/validate"
]
STAGING = re.compile(r"^v0\.(\d+\.\d+)$")


def go(folder: Path, *args: str, mod: str = "readonly") -> str:
    env = dict(os.environ, GOFLAGS=f"-mod={mod}", GOWORK="off")
    done = subprocess.run(["go", *args], cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"align-deps: go {' '.join(args)} in {folder}: {done.stderr.strip()}")
    return done.stdout


def semver_key(version: str):
    """orders Go module versions (semver; pseudo-versions are pre-releases)"""
    core, _, pre = version.lstrip("v").split("+")[0].partition("-")
    numbers = tuple(int(n) for n in core.split("."))
    if not pre:
        return numbers, (1,)
    return numbers, (0, tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")))


def patterns(folder: Path) -> list[str]:
    """what the folder's builds compile: its `tool` lines and its own code"""
    tools = json.loads(go(folder, "mod", "edit", "-json")).get("Tool") or []
    return ["./..."] + (["tool"] if tools else [])


def selected(folder: Path) -> dict[str, str]:
    """module path -> the version the folder's builds select (the build cache's key), for the
    modules whose packages they compile: the `tool` lines and the folder's own code"""
    template = "{{with .Module}}{{.Path}} {{.Version}}{{end}}"
    modules = {}
    for line in go(folder, "list", "-deps", "-f", template, *patterns(folder)).splitlines():
        # The standard library has no module; the wrapper's own packages have no version.
        fields = line.split()
        if len(fields) == 2:
            modules[fields[0]] = fields[1]
    return modules


def staging_replacements(folder: Path, kubernetes: str) -> list[str]:
    """`go mod edit` flags that replace every k8s.io/* staging module k8s.io/kubernetes@VERSION
    requires at v0.0.0 by its published version (README.md, "Bumping a version")"""
    info = json.loads(go(folder, "mod", "download", "-json", f"k8s.io/kubernetes@{kubernetes}"))
    staging = "v0." + kubernetes.removeprefix("v1.")
    text = Path(info["GoMod"]).read_text()
    names = sorted(set(re.findall(r"^\s*(k8s\.io/[\w./-]+) v0\.0\.0$", text, re.M)))
    return [f"-replace={name}={name}@{staging}" for name in names]


def main() -> int:
    check = sys.argv[1:] == ["--check"]
    changed: set[Path] = set()
    for _ in range(6):
        modules = {tool: selected(tool) for tool in TOOLS}
        target: dict[str, str] = {}
        users: dict[str, int] = {}
        for chosen in modules.values():
            for path, version in chosen.items():
                users[path] = users.get(path, 0) + 1
                if path not in target or semver_key(version) > semver_key(target[path]):
                    target[path] = version
        # k8s.io/kubernetes moves with the staging modules it is released with.
        api = STAGING.match(target.get("k8s.io/api", ""))
        if api:
            target["k8s.io/kubernetes"] = f"v1.{api.group(1)}"
        changes = {
            tool: {
                path: target[path]
                for path, version in chosen.items()
                if (users[path] > 1 or path == "k8s.io/kubernetes") and version != target[path]
            }
            for tool, chosen in modules.items()
        }
        if not any(changes.values()):
            if not check:
                for tool in changed:
                    go(tool, "mod", "tidy", mod="mod")
            print("align-deps: the tools select the same versions of every module they share")
            return 0
        for tool, change in changes.items():
            for path, version in sorted(change.items()):
                print(f"{tool.relative_to(ROOT)}: {path} {modules[tool][path]} -> {version}")
        if check:
            print(
                "align-deps: these tools compile the shared modules once each; run "
                "tests/cluster/align-deps.py (tests/cluster/README.md, \"Bumping a version\")",
                file=sys.stderr,
            )
            return 1
        for tool, change in changes.items():
            if not change:
                continue
            changed.add(tool)
            # A wrapper that replaces modules by version (NFD's staging modules) replaces them
            # by the new version, or the old replacement would win over the raised requirement.
            replaced = {
                r["Old"]["Path"]
                for r in json.loads(go(tool, "mod", "edit", "-json")).get("Replace") or []
                if r["New"].get("Version")
            }
            edits = [f"-replace={p}={p}@{v}" for p, v in change.items() if p in replaced]
            if "k8s.io/kubernetes" in change:
                edits += staging_replacements(tool, change["k8s.io/kubernetes"])
            # Raised as requirements: loading the build with -mod=mod then lets Go's minimal
            # version selection raise whatever they need in turn (the next round aligns those).
            edits += [f"-require={p}@{v}" for p, v in sorted(change.items())]
            go(tool, "mod", "edit", *edits)
            go(tool, "list", "-deps", *patterns(tool), mod="mod")
    sys.exit("align-deps: the versions did not settle after 6 rounds")


if __name__ == "__main__":
    sys.exit(main())
